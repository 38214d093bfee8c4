"""Benchmarks of training end to end under Lightning: the policies on GPUs, the shipped config,
compilation, the shape warm-up, the monitor's overhead (docs/lightning.md, docs/monitoring.md)."""

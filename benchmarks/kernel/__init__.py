"""Benchmarks of the fused AdaLN op (lightning_adaptiveload.ops) and of the surgery that puts it into
models (docs/kernel.md, docs/surgery.md)."""

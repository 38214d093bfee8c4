"""Benchmarks of the data side: DataModule throughput, the sample index, integrity checks, encoding
(docs/data.md)."""

"""The benchmark scripts (run as `python benchmarks/....py` from the repository root) and their shared
result header, benchmarks/_meta.py. A regular package, so that `benchmarks._meta` resolves to this
folder even where another installed distribution ships a top-level `benchmarks` package."""

"""The benchmark scripts, grouped by part (kernel/, scheduling/, data/, e2e/) and run from the
repository root as `python benchmarks/<part>/<name>.py`; their shared result header is
benchmarks/_meta.py, their committed results benchmarks/results/. A regular package, so that
`benchmarks.*` resolves to this folder even where another installed distribution ships a
top-level `benchmarks` package."""

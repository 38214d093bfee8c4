"""The header of every benchmark's result file: what ran, when, where, with which versions.

The scripts live in benchmarks/<part>/ as the package is grouped (kernel/, scheduling/, data/,
e2e/) and run from the repository root as `python benchmarks/<part>/<name>.py`; their result files
go to benchmarks/results/ (RESULTS). Every script starts its imports the same way, before anything
of this package or of examples/ is imported:

    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root (see benchmarks/_meta.py)
    from benchmarks._meta import REPO, RESULTS, run_meta, write_result  # noqa: E402

That one line is what puts this checkout first on sys.path, both when a script runs as a file
(Python puts only the script's own folder there) and when a test loads it by path: `benchmarks.*`,
`examples.*` and this checkout's `lightning_adaptiveload` then come from the repository root. A
result file names this checkout's commit, so the package measured must be this checkout's, not an
installed copy of another commit (`pip install .` copies the package); run_meta refuses one. The
one exception is data/index_load.py, whose measured child processes import the package their
PYTHONPATH names (this checkout's or a baseline commit's): it puts the root on sys.path in its
driver only.

Every result JSON is written by write_result with run_meta's header first.
"""
from __future__ import annotations

import datetime
import os
import platform
import subprocess
import sys
from pathlib import Path

import numpy as np

import lightning_adaptiveload

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"  # the committed result files


def git_commit() -> str:
    """The repository's HEAD commit, with "+dirty" when tracked files differ from it; "unknown"
    outside a git checkout (e.g. a copy of the tree on another machine without .git)."""
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True,
                              timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO,
                               capture_output=True, text=True, timeout=10, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return head + ("+dirty" if dirty else "")


def run_meta(benchmark: str, argv: list[str] | None = None, **versions: str) -> dict:
    """benchmark, command, date (UTC), git commit, device (the GPU's name when torch sees one, else
    the CPU, with the load average: a shared machine's timings scale with it) and versions
    (python, numpy, torch, CUDA, cuDNN, lightning, this package, plus `versions`). The command is
    sys.argv, or the script and `argv` when its main(argv) was called with arguments."""
    import lightning
    import torch

    package = Path(lightning_adaptiveload.__file__).resolve()
    if REPO not in package.parents:  # imported before _meta could put this checkout first
        raise RuntimeError(f"{benchmark}: lightning_adaptiveload was imported from {package.parent}, not from this "
                           f"checkout ({REPO}); put the repository root first on sys.path before importing it "
                           f"(benchmarks/_meta.py says how), or run with PYTHONPATH={REPO}")
    cuda = torch.cuda.is_available()
    meta = {
        "benchmark": benchmark,
        "command": " ".join([Path(sys.executable).name] + (sys.argv if argv is None else sys.argv[:1] + list(argv))),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "git_commit": git_commit(),
        "device": (f"{torch.cuda.get_device_name(0)} x{torch.cuda.device_count()}" if cuda
                   else f"CPU: {platform.processor() or platform.machine()}, {os.cpu_count()} cores visible"),
        "versions": {"python": platform.python_version(), "numpy": np.__version__, "torch": torch.__version__,
                     "cuda": torch.version.cuda, "cudnn": torch.backends.cudnn.version() if cuda else None,
                     "lightning": lightning.__version__,
                     "lightning_adaptiveload": lightning_adaptiveload.__version__, **versions},
    }
    if not cuda:
        meta["load_average_1_5_15min_at_end"] = list(os.getloadavg())
    return meta


def write_result(path: str | Path, doc: dict, announce: bool = True, allow_nan: bool = True) -> None:
    """Write a benchmark's result document (run_meta's header first) as indented JSON, folders made
    as needed; with allow_nan=False a NaN or infinity is an error instead of non-standard JSON."""
    import json

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=1, allow_nan=allow_nan) + "\n")
    if announce:
        print(f"wrote {path}")

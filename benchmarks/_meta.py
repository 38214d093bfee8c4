"""Header fields of a CPU benchmark's result file: what ran, when, where, with which versions."""
from __future__ import annotations

import datetime
import os
import platform
import sys
from pathlib import Path

import numpy as np

import lightning_adaptiveload


def cpu_run_meta(benchmark: str, **versions: str) -> dict:
    """benchmark, command, date (UTC), device, load average and versions (python, numpy, this
    package, plus `versions`). The machine is shared, so timings scale with the load average."""
    return {
        "benchmark": benchmark,
        "command": " ".join([Path(sys.executable).name] + sys.argv),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": f"CPU: {platform.processor() or platform.machine()}, {os.cpu_count()} cores visible",
        "load_average_1_5_15min_at_end": list(os.getloadavg()),
        "versions": {"python": platform.python_version(), "numpy": np.__version__,
                     "lightning_adaptiveload": lightning_adaptiveload.__version__, **versions},
    }

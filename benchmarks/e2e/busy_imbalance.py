"""Busy time shows the imbalance that DDP hides from step times: the measured comparison.

    python benchmarks/e2e/busy_imbalance.py --out /tmp/busy_imbalance_cpu.json     # 2-process gloo DDP, CPU
    python benchmarks/e2e/busy_imbalance.py --accelerator gpu --out ...           # 2 GPUs, NCCL

Runs tests/callbacks/ddp_monitor_script.py in its `busy` mode (the run tests/callbacks/test_monitor.py
checks the monitor's records of): 2 ranks train on the same batches, but rank r first does
WORK_UNITS[r] units of matrix products outside autograd, and LoadBalanceMonitor profiles every
step. The gradient all-reduce makes the ranks' step times nearly equal (the faster rank waits
in it); busy time, the ranks' time in ops outside communication, should follow the work. From the
run's balance_per_rank.csv: the work's CV across ranks, the mean over steps of the busy-time CV
and of the step-time CV across ranks, and how often rank 1 was busier than rank 0. Checks (as the
unit test asserted before these measured times left the unit suite: on a shared CPU they depend on
what else runs): busy CV above half the work's CV, step-time CV below the busy CV, rank 1 busier
on at least 75% of the steps. The same arithmetic with injected times is a unit test:
tests/monitoring/test_balance.py::test_busy_time_shows_imbalance_that_equal_step_times_hide.
Exit status 1 when a check misses.
"""
from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root (see benchmarks/_meta.py)
from benchmarks._meta import REPO, run_meta, write_result  # noqa: E402
from lightning_adaptiveload.monitoring.per_rank_log import CSV_NAME, read_per_rank_csv  # noqa: E402
from tests.callbacks.ddp_monitor_script import BUSY_STEPS, MATMULS_PER_UNIT, WORK_UNITS  # noqa: E402

SCRIPT = REPO / "tests" / "callbacks" / "ddp_monitor_script.py"


def pcv(values) -> float:
    """Population CV (fp64, statistics module)."""
    values = [float(v) for v in values]
    return statistics.pstdev(values) / statistics.fmean(values)


def measure(accelerator: str, timeout_s: float) -> dict:
    """One busy-mode run of the DDP script; its per-rank columns and the comparisons."""
    with tempfile.TemporaryDirectory() as tmp:
        proc = subprocess.run([sys.executable, str(SCRIPT), tmp, accelerator, "2", "busy"], capture_output=True,
                              text=True, timeout=timeout_s, cwd=REPO)
        if proc.returncode != 0:
            raise SystemExit(f"busy_imbalance: the DDP run failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
        cols = read_per_rank_csv(Path(tmp) / "run" / "version_0" / CSV_NAME)
    busy, step_ms = cols["busy_ms"], cols["step_time_ms"]
    if busy.shape != (BUSY_STEPS, 2) or not np.isfinite(busy).all():
        raise SystemExit(f"busy_imbalance: expected busy time on all {BUSY_STEPS} steps of 2 ranks, got {busy.shape}")
    work_cv = pcv(WORK_UNITS.values())
    busy_cv = statistics.fmean(pcv(row) for row in busy)
    step_cv = statistics.fmean(pcv(row) for row in step_ms)
    rank1_busier = float((busy[:, 1] > busy[:, 0]).mean())
    checks = [
        {"check": "busy CV > 0.5 x work CV", "value": busy_cv, "bound": 0.5 * work_cv, "passed": busy_cv > 0.5 * work_cv},
        {"check": "step-time CV < busy CV", "value": step_cv, "bound": busy_cv, "passed": step_cv < busy_cv},
        {"check": "rank 1 busier on >= 75% of steps", "value": rank1_busier, "bound": 0.75,
         "passed": rank1_busier >= 0.75},
    ]
    return {"work_cv": work_cv, "busy_cv_mean": busy_cv, "step_time_cv_mean": step_cv,
            "rank1_busier_frac": rank1_busier, "checks": checks,
            "per_step": {"busy_ms": busy.tolist(), "comm_ms": cols["comm_ms"].tolist(), "step_time_ms": step_ms.tolist()}}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--accelerator", choices=("cpu", "gpu"), default="cpu")
    parser.add_argument("--repeats", type=int, default=1, help="runs, one after the other; each is checked")
    parser.add_argument("--timeout-s", type=float, default=240.0, help="per run")
    parser.add_argument("--out", type=Path, required=True, help="result JSON")
    args = parser.parse_args(argv)
    runs = [measure(args.accelerator, args.timeout_s) for _ in range(args.repeats)]
    for i, run in enumerate(runs):
        print(f"run {i}: work CV {run['work_cv']:.3f}, busy CV {run['busy_cv_mean']:.3f}, "
              f"step-time CV {run['step_time_cv_mean']:.3f}, rank 1 busier on {100 * run['rank1_busier_frac']:.0f}%")
        for c in run["checks"]:
            print(f"  {'PASS' if c['passed'] else 'MISS'}  {c['check']:<34} {c['value']:.4f} (bound {c['bound']:.4f})")
    doc = run_meta("busy_imbalance", argv) | {
        "settings": {"accelerator": args.accelerator, "ranks": 2, "steps": BUSY_STEPS, "work_units": WORK_UNITS,
                     "matmuls_per_unit": MATMULS_PER_UNIT, "script": str(SCRIPT.relative_to(REPO))},
        "runs": runs}
    write_result(args.out, doc)
    return 0 if all(c["passed"] for run in runs for c in run["checks"]) else 1


if __name__ == "__main__":
    sys.exit(main())

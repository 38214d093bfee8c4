"""Is the CPU demo's calibration trusted on a busy machine? (issue 28, item 8)

Runs `adaptiveload fit --config C` for each CPU demo config (examples/configs/demo.yaml and
wan21_demo.yaml) `--runs` times, each in a fresh root dir (no calibration cache: every run
calibrates), the synthetic shards of a config written once and shared by its runs. With `--load`, one
busy-loop process per core keeps every core busy throughout (what a newcomer's machine does while a
browser, an IDE or a test suite runs). Kept per run: the exit status, the wall seconds, whether the
fit was trusted on its first pass (no "the fit is not trusted" line), whether it fell back to
token_equal, calibration.json's trusted / source / seconds / cold_seconds / verify_seconds, the
training throughput the LoadBalanceMonitor printed (tokens/s), and the output's last lines. Writes benchmarks/results/
cpu_robustness.json (--out) and a PNG beside it. Run from the repository root:

    python benchmarks/e2e/cpu_robustness.py --runs 2 --load

Each run takes 15-100 s on 2 cores; the defaults (3 runs of 2 configs) take several minutes.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root (see benchmarks/_meta.py)
from benchmarks._meta import REPO, RESULTS, run_meta, write_result  # noqa: E402

CONFIGS = ("examples/configs/demo.yaml", "examples/configs/wan21_demo.yaml")
DISTRUST_LINE = "the fit is not trusted"  # calibration/loop.py: the first pass was distrusted, measured again
FALLBACK_LINE = "falls back to the token_equal policy"  # calibration/loop.py: the second pass too
THROUGHPUT = re.compile(r"global throughput:\s+([0-9.]+) tokens/s")  # monitoring/balance.py's summary
BUSY_LOOP = "while True:\n    pass\n"
LOG_TAIL = 40  # lines of each fit's output kept in the result


def parse_log(text: str) -> dict:
    """What a fit's output says: trusted_first_pass (no distrust line), fell_back (to token_equal),
    tokens_per_s (the last throughput line of the monitor's summary; None without one)."""
    found = THROUGHPUT.findall(text)
    return {"trusted_first_pass": DISTRUST_LINE not in text, "fell_back": FALLBACK_LINE in text,
            "tokens_per_s": float(found[-1]) if found else None}


def read_calibration(root: Path) -> dict | None:
    """The fields of the run's calibration.json (the one under `root`, newest first) that say how
    calibration went; None when the run wrote none."""
    found = sorted(root.rglob("calibration.json"), key=lambda p: p.stat().st_mtime)
    if not found:
        return None
    doc = json.loads(found[-1].read_text(encoding="utf-8"))
    return {key: doc.get(key) for key in ("trusted", "source", "policy", "seconds", "cold_seconds", "verify_seconds")}


def summarize(runs: list[dict]) -> dict:
    """Per config: runs, how many exited 0, were trusted on the first pass, were trusted in the end
    and fell back; median wall seconds and tokens/s of the runs that printed one."""
    out = {}
    for config in dict.fromkeys(r["config"] for r in runs):
        mine = [r for r in runs if r["config"] == config]
        rates = [r["tokens_per_s"] for r in mine if r["tokens_per_s"] is not None]
        out[config] = {"runs": len(mine), "ok": sum(r["rc"] == 0 for r in mine),
                       "trusted_first_pass": sum(r["trusted_first_pass"] for r in mine),
                       "trusted": sum(bool(r["calibration"] and r["calibration"]["trusted"]) for r in mine),
                       "fell_back": sum(r["fell_back"] for r in mine),
                       "median_wall_s": statistics.median(r["wall_s"] for r in mine),
                       "median_tokens_per_s": statistics.median(rates) if rates else None}
    return out


def fit_command(config: str, root: Path, data: Path) -> list[str]:
    """`adaptiveload fit` of `config` with its logs, caches and checkpoints under `root` and its shards
    under `data` (the package of this checkout: run from the repository root)."""
    return [sys.executable, "-m", "lightning_adaptiveload", "fit", "--config", config,
            "--trainer.default_root_dir", str(root), "--trainer.logger.init_args.save_dir", str(root),
            "--data.shards", str(data / "shards"), "--data.index", str(data / "index.jsonl")]


def run_once(config: str, root: Path, data: Path, timeout_s: float, log_path: Path) -> dict:
    """One fit; its record, with the last LOG_TAIL lines of its output and whether it wrote the
    config's shards first (the first run of a config does: its wall time includes that)."""
    synthesized = not (data / "index.jsonl").exists()
    begin = time.perf_counter()
    try:
        proc = subprocess.run(fit_command(config, root, data), cwd=REPO, capture_output=True, text=True,
                              timeout=timeout_s)
        rc, text = proc.returncode, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as e:
        rc, text = 124, (e.stdout or b"").decode(errors="replace") + (e.stderr or b"").decode(errors="replace")
    wall_s = time.perf_counter() - begin
    log_path.write_text(text, encoding="utf-8")
    return {"config": config, "rc": rc, "wall_s": round(wall_s, 2), "synthesized": synthesized, **parse_log(text),
            "calibration": read_calibration(root), "log_tail": text.splitlines()[-LOG_TAIL:]}


def plot(runs: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_wall, ax_rate) = plt.subplots(1, 2, figsize=(11, 4))
    labels = [f"{Path(r['config']).stem} #{i}" for i, r in enumerate(runs)]
    colors = ["tab:green" if r["trusted_first_pass"] else ("tab:red" if r["fell_back"] else "tab:orange")
              for r in runs]
    ax_wall.bar(labels, [r["wall_s"] for r in runs], color=colors)
    ax_wall.set_ylabel("wall s of the fit")
    ax_rate.bar(labels, [r["tokens_per_s"] or 0 for r in runs], color=colors)
    ax_rate.set_ylabel("training tokens/s")
    for ax in (ax_wall, ax_rate):
        ax.tick_params(axis="x", rotation=60)
    fig.suptitle(f"{title}\ngreen: trusted on the first pass; orange: on the second; red: fell back to token_equal")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3, help="fresh runs per config")
    parser.add_argument("--load", action="store_true", help="one busy-loop process per core during the runs")
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS))
    parser.add_argument("--timeout-s", type=float, default=600.0, help="per run")
    parser.add_argument("--out", type=Path, default=RESULTS / "cpu_robustness.json")
    args = parser.parse_args(argv)
    if args.runs < 1:
        parser.error(f"--runs must be >= 1, got {args.runs}")
    cores = os.cpu_count() or 1
    load = [subprocess.Popen([sys.executable, "-c", BUSY_LOOP]) for _ in range(cores)] if args.load else []
    runs = []
    try:
        with tempfile.TemporaryDirectory(prefix="cpu_robustness_") as tmp:
            logs = Path(tmp) / "logs"
            logs.mkdir()
            for config in args.configs:
                data = Path(tmp) / Path(config).stem / "data"
                for i in range(args.runs):
                    run = run_once(config, Path(tmp) / Path(config).stem / f"run{i}", data, args.timeout_s,
                                   logs / f"{Path(config).stem}_{i}.log")
                    runs.append(run)
                    print(f"{config} run {i}: rc {run['rc']}, {run['wall_s']:.1f} s, trusted on the first pass "
                          f"{run['trusted_first_pass']}, fell back {run['fell_back']}, {run['tokens_per_s']} tokens/s",
                          flush=True)
                    if run["rc"] != 0:
                        print(Path(logs / f"{Path(config).stem}_{i}.log").read_text()[-3000:])
    finally:
        for proc in load:  # only the processes this script started
            proc.kill()
            proc.wait()
    summary = summarize(runs)
    doc = run_meta("cpu_robustness", argv) | {
        "settings": {"runs": args.runs, "load_processes": len(load), "cores": cores, "configs": args.configs,
                     "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS")},
        "summary": summary, "runs": runs}
    write_result(args.out, doc)
    plot(runs, args.out.with_suffix(".png"), f"CPU demo calibration, {len(load)} busy-loop process(es) on "
                                             f"{cores} core(s)")
    return 0 if all(s["ok"] == s["runs"] for s in summary.values()) else 1


if __name__ == "__main__":
    sys.exit(main())

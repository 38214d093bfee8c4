"""Overhead of LoadBalanceMonitor: time inside its hooks, and of its busy-time profiler windows,
vs the training step time.

Trains the example video DiT (tiny config) on mixed-shape random batches with 1 process and with
2-process DDP (gloo), each run in a fresh subprocess, in these setups: no monitor; the monitor at
log_every_n_steps=50 with busy time off and at its default sampling (one profiled step every
busy_every_n_logs=DEFAULT_BUSY_EVERY_N_LOGS logs); log_every_n_steps=1 (worst case: a gather, CSV
append and logger call every step); and a profiled step every 5th step, to measure what one
profiled step costs. Reports the monitor's self-timed hook overhead per step (perf_counter around
its hooks, including gathers, file writes and opening/closing/reading profiler windows) as a
fraction of the mean step time, and for the profiled steps: the window's host time per profiled
step and how much longer a profiled step runs than unprofiled steps of the same shape (the
profiler records every op). Their sum over the default period of steps is the default sampling's
busy-time overhead. As a cross-check: training wall time per step with vs without the monitor.

    python benchmarks/e2e/monitor_overhead.py          # CPU, tiny DiT, writes results/monitor_overhead.json
    python benchmarks/e2e/monitor_overhead.py --preset h200 --out benchmarks/results/monitor_overhead_h200.json
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import lightning.pytorch as pl
import numpy as np
import torch
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root (see benchmarks/_meta.py)
from benchmarks._meta import RESULTS, run_meta, write_result  # noqa: E402
from examples.video_dit.module import VideoDiTModule  # noqa: E402
from lightning_adaptiveload.callbacks import LoadBalanceMonitor  # noqa: E402
from lightning_adaptiveload.callbacks.monitor import DEFAULT_BUSY_EVERY_N_LOGS  # noqa: E402
from lightning_adaptiveload.monitoring.per_rank_log import CSV_NAME, read_per_rank_csv  # noqa: E402

# Per preset: model size, precision, accelerator and the (B, T, H, W) latent shapes (16 channels)
# cycled through; tokens per sample = T * H/2 * W/2 (cpu: 64 ... 512, h200: 1024 ... 8192).
PRESETS = {
    "cpu": {"model": dict(dim=64, num_layers=2, num_heads=4, ffn_dim=128, text_dim=32, freq_dim=32),
            "precision": "32-true", "accelerator": "cpu",
            "shapes": [(8, 1, 16, 16), (4, 2, 16, 16), (2, 4, 16, 16), (2, 2, 16, 32), (1, 8, 16, 16), (4, 1, 16, 32)]},
    "h200": {"model": dict(dim=1536, num_layers=6, num_heads=12, ffn_dim=8960, text_dim=32, freq_dim=256),
             "precision": "bf16-mixed", "accelerator": "gpu",
             "shapes": [(8, 1, 64, 64), (4, 2, 64, 64), (2, 4, 64, 64), (2, 2, 64, 128), (1, 8, 64, 64),
                        (4, 1, 64, 128)]},
}
WARMUP_STEPS = 5
# name -> (log_every_n_steps, busy_every_n_logs); log_every None: no monitor.
SETUPS = {
    "no monitor": (None, None),
    "log every 50, busy off": (50, 0),
    "log every 50, busy default": (50, DEFAULT_BUSY_EVERY_N_LOGS),
    "log every 1, busy off": (1, 0),
    "log every 5, busy every log": (5, 1),
}


def _batches(n: int, shapes: list[tuple], text_dim: int) -> list[dict]:
    g = torch.Generator().manual_seed(0)
    out = []
    for i in range(n):
        b, t, h, w = shapes[i % len(shapes)]
        out.append({"latents": torch.randn(b, 16, t, h, w, generator=g),
                    "text": torch.randn(b, 8, text_dim, generator=g),
                    "seq_len": t * (h // 2) * (w // 2), "keys": [f"{i}/{j}" for j in range(b)]})
    return out


class TrainClock(pl.Callback):
    """Wall time of training from the start of step WARMUP_STEPS to the end of training (s)."""

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == WARMUP_STEPS and not hasattr(self, "start"):
            self.start = time.perf_counter()

    def on_train_end(self, trainer, pl_module):
        if trainer.strategy.root_device.type == "cuda":
            torch.cuda.synchronize()
        self.wall_s = time.perf_counter() - self.start
        self.steps = trainer.global_step - WARMUP_STEPS


def profiled_step_inflation_ms(log_dir: str) -> float:
    """Mean over profiled rows (every rank, after WARMUP_STEPS) of the step time minus the median
    step time of the unprofiled rows of the same rank and batch shape: the time a profiler window
    adds inside the timed step. NaN without profiled rows."""
    cols = read_per_rank_csv(Path(log_dir) / CSV_NAME)
    keep = cols["step"][:, 0] >= WARMUP_STEPS
    step_ms, profiled = cols["step_time_ms"][keep], np.isfinite(cols["busy_ms"][keep])
    shape = cols["samples"][keep] * 1e9 + cols["seq_len"][keep]
    extra = []
    for r in range(step_ms.shape[1]):
        for i in np.flatnonzero(profiled[:, r]):
            same = (shape[:, r] == shape[i, r]) & ~profiled[:, r]
            extra.append(step_ms[i, r] - np.median(step_ms[same, r]))
    return float(np.mean(extra)) if extra else float("nan")


def worker(args) -> None:
    preset = PRESETS[args.preset]
    torch.manual_seed(0)
    if preset["accelerator"] == "cpu":
        torch.set_num_threads(1)  # one core per process: 2-process runs do not oversubscribe the 2-core host
    model = VideoDiTModule(**preset["model"])
    clock = TrainClock()
    callbacks = [clock]
    monitor = None
    if args.log_every:
        monitor = LoadBalanceMonitor(verbose=False, busy_every_n_logs=args.busy_every)
        callbacks.append(monitor)
    with tempfile.TemporaryDirectory() as tmp:
        trainer = pl.Trainer(accelerator=preset["accelerator"], devices=args.devices, precision=preset["precision"],
                             strategy="ddp" if args.devices > 1 else "auto", max_steps=args.steps,
                             logger=CSVLogger(tmp), log_every_n_steps=args.log_every or 50, callbacks=callbacks,
                             enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
        loader = DataLoader(_batches(args.steps * args.devices, preset["shapes"], preset["model"]["text_dim"]),
                            batch_size=None, shuffle=False)
        trainer.fit(model, train_dataloaders=loader)
        if trainer.is_global_zero:
            result = {"train_wall_ms_per_step": 1e3 * clock.wall_s / clock.steps, "timed_steps": clock.steps}
            if monitor is not None:
                result.update({k: monitor.summary[k] for k in
                               ("step_time_ms_mean", "monitor_overhead_ms_per_step", "monitor_overhead_frac", "steps")})
                result["busy_steps"] = monitor.summary.get("busy_steps", 0)
                if result["busy_steps"]:
                    result.update({k: monitor.summary[k] for k in ("busy_warm_up_ms", "busy_window_ms_per_step")})
                    result["profiled_step_inflation_ms"] = profiled_step_inflation_ms(monitor.log_dir)
            Path(args.result).write_text(json.dumps(result))


def run_setup(devices: int, log_every: int | None, busy_every: int | None, steps: int, preset: str) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        result_path = Path(tmp) / "result.json"
        cmd = [sys.executable, __file__, "--worker", "--devices", str(devices), "--steps", str(steps),
               "--preset", preset, "--result", str(result_path)]
        if log_every:
            cmd += ["--log-every", str(log_every), "--busy-every", str(busy_every)]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
        if proc.returncode != 0:
            raise RuntimeError(f"worker failed ({' '.join(cmd)}):\n{proc.stderr[-4000:]}")
        return json.loads(result_path.read_text())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=400,
                        help="train steps per run (the default sampling profiles one step in "
                             f"{50 * DEFAULT_BUSY_EVERY_N_LOGS})")
    parser.add_argument("--repeats", type=int, default=2, help="runs per setup (setups interleaved)")
    parser.add_argument("--devices-list", default="1,2", help="process counts to run, comma separated")
    parser.add_argument("--preset", choices=sorted(PRESETS), default="cpu", help="model size, precision, device")
    parser.add_argument("--out", default=str(RESULTS / "monitor_overhead.json"))
    # worker mode (one training run; used by the driver)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--devices", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--log-every", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--busy-every", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return 0

    from tqdm import tqdm

    devices_list = [int(d) for d in args.devices_list.split(",")]
    runs = [(d, name, rep) for rep in range(args.repeats) for d in devices_list for name in SETUPS]
    rows: dict[tuple[int, str], list[dict]] = {}
    for devices, name, _ in tqdm(runs, desc="training runs"):
        rows.setdefault((devices, name), []).append(run_setup(devices, *SETUPS[name], args.steps, args.preset))

    def median(rs: list[dict], key: str) -> float:
        return float(np.median([r[key] for r in rs]))

    table = []
    for devices in devices_list:
        base = median(rows[(devices, "no monitor")], "train_wall_ms_per_step")
        for name, (every, busy_every) in SETUPS.items():
            rs = rows[(devices, name)]
            wall = median(rs, "train_wall_ms_per_step")
            entry = {"processes": devices, "setup": name, "log_every_n_steps": every, "busy_every_n_logs": busy_every,
                     "train_wall_ms_per_step": wall, "wall_vs_no_monitor": wall / base - 1.0, "runs": rs}
            if every:
                for key in ("step_time_ms_mean", "monitor_overhead_ms_per_step", "monitor_overhead_frac", "busy_steps"):
                    entry[key] = median(rs, key)
            if every and busy_every and all(r["busy_steps"] for r in rs):
                for key in ("busy_warm_up_ms", "busy_window_ms_per_step", "profiled_step_inflation_ms"):
                    entry[key] = median(rs, key)
            table.append(entry)
        # What one profiled step costs (window host time + longer step), measured where many steps
        # are profiled, spread over the default sampling's period of steps.
        probe = next(e for e in table if e["processes"] == devices and e["setup"] == "log every 5, busy every log")
        cost_ms = probe["busy_window_ms_per_step"] + probe["profiled_step_inflation_ms"]
        period = 50 * DEFAULT_BUSY_EVERY_N_LOGS
        probe["cost_ms_per_profiled_step"] = cost_ms
        probe["default_sampling_overhead_frac"] = cost_ms / (period * probe["step_time_ms_mean"])

    print(f"\n{'procs':>5} {'setup':<28} {'wall ms/step':>12} {'vs none':>8} {'step ms':>9} "
          f"{'hooks ms/step':>13} {'hooks/step':>10} {'profiled':>8} {'window ms':>9} {'in-step ms':>10}")
    for e in table:
        if e["log_every_n_steps"]:
            hooks = (f"{e['step_time_ms_mean']:>9.2f} {e['monitor_overhead_ms_per_step']:>13.3f} "
                     f"{100 * e['monitor_overhead_frac']:>9.2f}% {e['busy_steps']:>8.0f}")
        else:
            hooks = f"{'-':>9} {'-':>13} {'-':>10} {'-':>8}"
        busy = (f" {e['busy_window_ms_per_step']:>9.1f} {e['profiled_step_inflation_ms']:>10.1f}"
                if "busy_window_ms_per_step" in e else "")
        print(f"{e['processes']:>5} {e['setup']:<28} {e['train_wall_ms_per_step']:>12.2f} "
              f"{100 * e['wall_vs_no_monitor']:>7.1f}% {hooks}{busy}")
    for e in table:
        if "default_sampling_overhead_frac" in e:
            print(f"{e['processes']} process(es): one profiled step costs {e['cost_ms_per_profiled_step']:.1f} ms; "
                  f"at the default sampling (1 step in {50 * DEFAULT_BUSY_EVERY_N_LOGS}) "
                  f"{100 * e['default_sampling_overhead_frac']:.2f}% of training time")

    preset = PRESETS[args.preset]
    doc = {
        **run_meta("monitor_overhead"),
        "preset": args.preset, "model": {"class": "examples VideoDiTModule", **preset["model"]},
        "precision": preset["precision"], "shapes_BTHW": preset["shapes"], "steps": args.steps,
        "warmup_steps_excluded_from_wall": WARMUP_STEPS, "default_busy_every_n_logs": DEFAULT_BUSY_EVERY_N_LOGS,
        "repeats": args.repeats, "table": table,
    }
    write_result(args.out, doc)
    return 0


if __name__ == "__main__":
    sys.exit(main())

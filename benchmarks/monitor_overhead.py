"""Overhead of LoadBalanceMonitor: time inside its hooks vs the training step time.

Trains the example video DiT (tiny config) on mixed-shape random batches with 1 process and with
2-process DDP (gloo), each run in a fresh subprocess, in three setups: no monitor, monitor with
log_every_n_steps=50 (the default: one all_gather per 50 steps), and log_every_n_steps=1 (worst
case: a gather, CSV append and logger call every step). Reports the monitor's self-timed hook
overhead per step (perf_counter around its hooks, including gathers and file writes) as a fraction
of the mean step time, and, as a cross-check, training wall time per step with vs without it.

    python benchmarks/monitor_overhead.py          # CPU, tiny DiT, writes results/monitor_overhead.json
    python benchmarks/monitor_overhead.py --preset h200 --out benchmarks/results/monitor_overhead_h200.json
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import lightning
import lightning.pytorch as pl
import numpy as np
import torch
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # for examples/

from examples.video_dit.module import VideoDiTModule  # noqa: E402
from lightning_adaptiveload.callbacks import LoadBalanceMonitor  # noqa: E402

RESULTS = REPO / "benchmarks" / "results"
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
SETUPS = (("no monitor", None), ("monitor, log every 50", 50), ("monitor, log every 1", 1))


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
        monitor = LoadBalanceMonitor(verbose=False)
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
        Path(args.result).write_text(json.dumps(result))


def run_setup(devices: int, log_every: int | None, steps: int, preset: str) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        result_path = Path(tmp) / "result.json"
        cmd = [sys.executable, __file__, "--worker", "--devices", str(devices), "--steps", str(steps),
               "--preset", preset, "--result", str(result_path)]
        if log_every:
            cmd += ["--log-every", str(log_every)]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
        if proc.returncode != 0:
            raise RuntimeError(f"worker failed ({' '.join(cmd)}):\n{proc.stderr[-4000:]}")
        return json.loads(result_path.read_text())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100, help="train steps per run")
    parser.add_argument("--repeats", type=int, default=2, help="runs per setup (setups interleaved)")
    parser.add_argument("--devices-list", default="1,2", help="process counts to run, comma separated")
    parser.add_argument("--preset", choices=sorted(PRESETS), default="cpu", help="model size, precision, device")
    parser.add_argument("--out", default=str(RESULTS / "monitor_overhead.json"))
    # worker mode (one training run; used by the driver)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--devices", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--log-every", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return 0

    from tqdm import tqdm

    devices_list = [int(d) for d in args.devices_list.split(",")]
    runs = [(d, name, every, rep) for rep in range(args.repeats) for d in devices_list for name, every in SETUPS]
    rows: dict[tuple[int, str], list[dict]] = {}
    for devices, name, every, _ in tqdm(runs, desc="training runs"):
        rows.setdefault((devices, name), []).append(run_setup(devices, every, args.steps, args.preset))

    table = []
    for devices in devices_list:
        base = float(np.median([r["train_wall_ms_per_step"] for r in rows[(devices, "no monitor")]]))
        for name, every in SETUPS:
            rs = rows[(devices, name)]
            wall = float(np.median([r["train_wall_ms_per_step"] for r in rs]))
            entry = {"processes": devices, "setup": name, "log_every_n_steps": every,
                     "train_wall_ms_per_step": wall, "wall_vs_no_monitor": wall / base - 1.0, "runs": rs}
            if every:
                entry["step_time_ms_mean"] = float(np.median([r["step_time_ms_mean"] for r in rs]))
                entry["hook_overhead_ms_per_step"] = float(np.median([r["monitor_overhead_ms_per_step"] for r in rs]))
                entry["hook_overhead_frac"] = float(np.median([r["monitor_overhead_frac"] for r in rs]))
            table.append(entry)

    print(f"\n{'procs':>5} {'setup':<24} {'wall ms/step':>12} {'vs none':>8} {'step ms':>9} "
          f"{'hooks ms/step':>13} {'hooks/step':>10}")
    for e in table:
        if e["log_every_n_steps"]:
            hooks = (f"{e['step_time_ms_mean']:>9.2f} {e['hook_overhead_ms_per_step']:>13.3f} "
                     f"{100 * e['hook_overhead_frac']:>9.2f}%")
        else:
            hooks = f"{'-':>9} {'-':>13} {'-':>10}"
        print(f"{e['processes']:>5} {e['setup']:<24} {e['train_wall_ms_per_step']:>12.2f} "
              f"{100 * e['wall_vs_no_monitor']:>7.1f}% {hooks}")

    preset = PRESETS[args.preset]
    device = (f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}" if preset["accelerator"] == "gpu"
              else f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores, shared)")
    doc = {
        "benchmark": "monitor_overhead",
        "command": "python " + " ".join([os.path.relpath(__file__, REPO)] + sys.argv[1:]),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": device,
        "versions": {"python": platform.python_version(), "torch": torch.__version__,
                     "lightning": lightning.__version__, "numpy": np.__version__},
        "preset": args.preset, "model": {"class": "examples VideoDiTModule", **preset["model"]},
        "precision": preset["precision"], "shapes_BTHW": preset["shapes"], "steps": args.steps,
        "warmup_steps_excluded_from_wall": WARMUP_STEPS,
        "repeats": args.repeats, "table": table,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Single-process runs of LoadBalanceMonitor, and its statistics against fp64 formulas."""
from __future__ import annotations

import csv
import json
import statistics
import subprocess
import sys
from pathlib import Path

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger
from tests.callbacks.ddp_monitor_script import RANK_SHAPES, STEPS
from torch.utils.data import DataLoader

from lightning_adaptiveload.callbacks import LoadBalanceMonitor
from lightning_adaptiveload.callbacks.monitor import (
    CSV_NAME, META_NAME, batch_samples_and_seq_len, cross_rank_stats, temporal_cv,
)
from lightning_adaptiveload.cli import main as cli_main

TESTS = Path(__file__).resolve().parent

# (B, T, H, W) of each batch; tokens per sample = T * (H // 2) * (W // 2) (patch 1x2x2).
SHAPES = [(4, 1, 8, 8), (2, 3, 8, 8), (1, 5, 8, 12), (3, 2, 8, 8), (2, 1, 8, 12), (1, 4, 8, 8), (4, 1, 4, 8)]


def _batches(seed: int = 0) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i, (b, t, h, w) in enumerate(SHAPES):
        out.append({"latents": torch.randn(b, 4, t, h, w, generator=g), "seq_len": t * (h // 2) * (w // 2),
                    "keys": [f"s{i}_{j}" for j in range(b)]})
    return out


class TinyModel(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(4, 4)

    def training_step(self, batch, batch_idx):
        x = batch["latents"].movedim(1, -1)
        loss = ((self.proj(x) - x.flip(-1)) ** 2).mean()
        self.log("train/loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


class TinyData(pl.LightningDataModule):
    def __init__(self, cost_model=None):
        super().__init__()
        self.cost_model = cost_model
        self.skipped = {"bad_ndim": 2, "truncated": 1}

    def train_dataloader(self):
        return DataLoader(_batches(), batch_size=None, shuffle=False)


class AffineCost:
    """Stands in for CostModel: predict(B, S) ms."""

    def predict(self, batch_size, seq_len):
        return 1.5 + 0.01 * batch_size * seq_len ** 1.3


def _fit(tmp_path, monitor, datamodule, accumulate=1, log_every=3, epochs=1):
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_epochs=epochs, logger=CSVLogger(tmp_path, name="run"),
                         log_every_n_steps=log_every, accumulate_grad_batches=accumulate,
                         callbacks=[monitor], enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False)
    trainer.fit(TinyModel(), datamodule=datamodule)
    return trainer


def _read_csv(path) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def test_batch_samples_and_seq_len_variants():
    lat = torch.zeros(3, 4, 1, 2, 2)
    assert batch_samples_and_seq_len({"latents": lat, "seq_len": 7}) == (3, 21, 7)
    assert batch_samples_and_seq_len({"latents": lat, "seq_len": torch.tensor(7)}) == (3, 21, 7)
    assert batch_samples_and_seq_len({"keys": ["a", "b", "c"], "seq_len": torch.tensor([5, 9, 2])}) == (3, 16, 9)
    with pytest.raises(KeyError, match="seq_len"):
        batch_samples_and_seq_len({"latents": lat})
    with pytest.raises(KeyError, match="latents"):
        batch_samples_and_seq_len({"seq_len": 3})
    with pytest.raises(ValueError, match="2 entries for 3 samples"):
        batch_samples_and_seq_len({"latents": lat, "seq_len": [1, 2]})


def test_cross_rank_stats_match_fp64_formulas():
    rng = np.random.default_rng(3)
    values = rng.uniform(0.5, 20.0, size=(5, 11))
    got = cross_rank_stats(values)
    for i in range(values.shape[1]):
        col = [float(v) for v in values[:, i]]
        mean = statistics.fmean(col)
        assert got["cv"][i] == pytest.approx(statistics.pstdev(col) / mean, rel=1e-12)
        assert got["max_over_mean"][i] == pytest.approx(max(col) / mean, rel=1e-12)
        assert got["bubble"][i] == pytest.approx(1 - mean / max(col), rel=1e-12)
    zeros = cross_rank_stats(np.zeros((2, 3)))
    assert all(np.all(v == 0) for v in zeros.values())
    assert temporal_cv([4.0]) == 0.0
    seq = rng.uniform(1, 3, size=9).tolist()
    assert temporal_cv(seq) == pytest.approx(statistics.pstdev(seq) / statistics.fmean(seq), rel=1e-12)


def test_single_process_fit_logs_csv_and_metrics(tmp_path, capsys):
    monitor = LoadBalanceMonitor(window=4)
    trainer = _fit(tmp_path, monitor, TinyData(cost_model=AffineCost()))
    log_dir = trainer.logger.log_dir

    rows = _read_csv(f"{log_dir}/{CSV_NAME}")
    assert [int(r["step"]) for r in rows] == list(range(len(SHAPES)))
    assert {r["rank"] for r in rows} == {"0"}
    cost = AffineCost()
    for r, (b, t, h, w) in zip(rows, SHAPES):
        s = t * (h // 2) * (w // 2)
        assert (int(r["samples"]), int(r["seq_len"]), int(r["tokens"])) == (b, s, b * s)
        assert float(r["load"]) == pytest.approx(cost.predict(b, s), rel=1e-5)
        assert float(r["step_time_ms"]) > 0 and float(r["interval_ms"]) >= float(r["step_time_ms"])
    assert json.load(open(f"{log_dir}/{META_NAME}"))["load_unit"] == "ms (cost model)"

    # Logged at steps 2 and 5 (log_every_n_steps=3) and the final partial interval at step 6.
    metrics = [m for m in _read_csv(f"{log_dir}/metrics.csv") if m.get("balance/load_cv")]
    assert [int(m["step"]) for m in metrics] == [2, 5, 6]
    step_ms = [float(r["step_time_ms"]) for r in rows]
    tokens = [int(r["tokens"]) for r in rows]
    intervals = [float(r["interval_ms"]) for r in rows]
    for m, lo, hi in zip(metrics, (0, 3, 6), (3, 6, 7)):
        assert float(m["balance/load_cv"]) == 0.0  # one rank: no cross-rank spread
        assert float(m["balance/bubble_frac"]) == 0.0
        assert float(m["balance/load_max_over_mean"]) == pytest.approx(1.0)
        assert float(m["rank0/tokens"]) == pytest.approx(np.mean(tokens[lo:hi]))
        assert float(m["rank0/step_time_ms"]) == pytest.approx(np.mean(step_ms[lo:hi]), rel=1e-4)
        assert float(m["throughput/tokens_per_s"]) == pytest.approx(
            sum(tokens[lo:hi]) / (sum(intervals[lo:hi]) / 1e3), rel=1e-4)
        window = step_ms[max(0, hi - 4):hi]
        assert float(m["balance/step_time_cv_temporal"]) == pytest.approx(temporal_cv(window), rel=1e-3, abs=1e-6)
        assert float(m["data/skipped"]) == 3 and float(m["data/skipped/bad_ndim"]) == 2
        loads = [float(r["load"]) for r in rows[lo:hi]]
        assert float(m["balance/unpredicted_ms"]) == pytest.approx(
            np.mean(np.subtract(step_ms[lo:hi], loads)), rel=1e-4, abs=1e-3)

    summary = monitor.summary
    assert summary["steps"] == len(SHAPES)
    assert summary["step_time_cv_temporal_run"] == pytest.approx(temporal_cv(step_ms), rel=1e-3)
    assert summary["monitor_overhead_ms_per_step"] > 0
    assert summary["unpredicted_ms_mean"] == pytest.approx(
        np.mean(np.subtract(step_ms, [float(r["load"]) for r in rows])), rel=1e-4, abs=1e-3)
    out = capsys.readouterr().out
    assert "LoadBalanceMonitor: 7 steps x 1 ranks" in out and "monitor overhead" in out
    assert "step time beyond the cost model" in out


def test_proxy_load_without_cost_model_and_grad_accumulation(tmp_path):
    monitor = LoadBalanceMonitor(verbose=False)
    trainer = _fit(tmp_path, monitor, TinyData(cost_model=None), accumulate=2, log_every=2, epochs=2)
    log_dir = trainer.logger.log_dir
    rows = _read_csv(f"{log_dir}/{CSV_NAME}")
    assert len(rows) == 2 * len(SHAPES)
    for r in rows:
        assert float(r["load"]) == pytest.approx(int(r["samples"]) * int(r["seq_len"]) ** 2, rel=1e-5)
    assert json.load(open(f"{log_dir}/{META_NAME}"))["load_unit"].startswith("tokens^2")
    # Two micro-batches per optimizer step: each row carries the optimizer step it belongs to.
    assert [int(r["step"]) for r in rows[:len(SHAPES)]] == [0, 0, 1, 1, 2, 2, 3]
    # One log per 2 optimizer steps, none twice, plus the final flush.
    logged = [int(m["step"]) for m in _read_csv(f"{log_dir}/metrics.csv") if m.get("balance/load_cv")]
    assert logged == sorted(set(logged)) and len(logged) >= 3
    assert monitor.summary["steps"] == 2 * len(SHAPES)
    # Proxy loads are tokens^2, not ms: nothing to compare step times with.
    assert "unpredicted_ms_mean" not in monitor.summary
    assert not any(m.get("balance/unpredicted_ms") for m in _read_csv(f"{log_dir}/metrics.csv"))


def test_resumed_fit_in_the_same_log_dir_keeps_every_batch_once(tmp_path):
    # The first fit trains steps 0..6; resuming from the checkpoint at step 3 trains 3..6 again.
    from lightning.pytorch.callbacks import ModelCheckpoint

    def fit(monitor, ckpt_path=None):
        callbacks = [monitor] + ([] if ckpt_path else [ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=1,
                                                                       save_top_k=-1)])
        trainer = pl.Trainer(accelerator="cpu", devices=1, max_epochs=1, logger=CSVLogger(tmp_path, name="run",
                                                                                           version=0),
                             log_every_n_steps=2, callbacks=callbacks, enable_progress_bar=False,
                             enable_model_summary=False)
        trainer.fit(TinyModel(), datamodule=TinyData(cost_model=AffineCost()), ckpt_path=ckpt_path)
        return trainer

    trainer = fit(LoadBalanceMonitor(verbose=False))
    first = _read_csv(f"{trainer.logger.log_dir}/{CSV_NAME}")
    with open(f"{trainer.logger.log_dir}/{CSV_NAME}", "a") as f:
        f.write("0,")  # a run killed while writing leaves an incomplete last row
    fit(LoadBalanceMonitor(verbose=False), ckpt_path=str(tmp_path / "ckpt" / "epoch=0-step=3.ckpt"))
    rows = _read_csv(f"{trainer.logger.log_dir}/{CSV_NAME}")
    assert [int(r["step"]) for r in rows] == list(range(len(SHAPES)))
    assert rows[:3] == first[:3]  # the rows before the checkpoint are kept as they were


def test_unwritable_csv_warns_and_training_goes_on(tmp_path, monkeypatch):
    # Only rank 0 writes the CSV; an exception there would leave the other ranks in the next gather.
    def full_disk(self, rows):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(LoadBalanceMonitor, "_append_csv", full_disk)
    monitor = LoadBalanceMonitor(verbose=False)
    with pytest.warns(UserWarning, match="No space left on device"):
        trainer = _fit(tmp_path, monitor, TinyData(cost_model=AffineCost()))
    assert trainer.global_step == len(SHAPES) and monitor.summary["steps"] == len(SHAPES)
    metrics = [m for m in _read_csv(f"{trainer.logger.log_dir}/metrics.csv") if m.get("balance/load_cv")]
    assert len(metrics) == 3  # the metrics are still logged


@pytest.mark.cuda
def test_single_gpu_fit_synchronizes_and_records(tmp_path):
    monitor = LoadBalanceMonitor(cost_model=AffineCost(), verbose=False)
    trainer = pl.Trainer(accelerator="gpu", devices=1, max_epochs=1, logger=CSVLogger(tmp_path, name="run"),
                         log_every_n_steps=2, callbacks=[monitor], enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(TinyModel(), datamodule=TinyData(cost_model=None))
    assert monitor._sync and monitor._device.type == "cuda"
    rows = _read_csv(f"{trainer.logger.log_dir}/{CSV_NAME}")
    assert [int(r["samples"]) for r in rows] == [b for b, *_ in SHAPES]
    assert all(float(r["step_time_ms"]) > 0 for r in rows)
    assert monitor.summary["steps"] == len(SHAPES)


def test_bad_window_is_rejected():
    with pytest.raises(ValueError, match="window"):
        LoadBalanceMonitor(window=1)


@pytest.mark.parametrize("accelerator", [
    pytest.param("cpu", marks=pytest.mark.slow),
    pytest.param("gpu", marks=[pytest.mark.cuda, pytest.mark.skipif(torch.cuda.device_count() < 2,
                                                                     reason="needs 2 GPUs")]),
])
def test_two_process_ddp_gathers_per_rank_rows(tmp_path, accelerator):
    """Rank r trains on known rank-specific (B, S); the gathered CSV and logged statistics must
    match the fp64 formulas on those shapes (tests/callbacks/ddp_monitor_script.py; gloo on CPU, NCCL on GPU)."""
    proc = subprocess.run([sys.executable, str(TESTS / "ddp_monitor_script.py"), str(tmp_path), accelerator],
                          capture_output=True, text=True, timeout=240, cwd=TESTS.parent)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "LoadBalanceMonitor: 6 steps x 2 ranks" in proc.stdout
    table = proc.stdout[proc.stdout.index("LoadBalanceMonitor: 6 steps"):].splitlines()
    for r in (0, 1):  # the summary's per-rank row: rank, mean samples, mean tokens, mean seq_len, ...
        cells = table[2 + r].split()
        assert int(cells[0]) == r
        assert float(cells[1]) == pytest.approx(np.mean([b for b, _ in RANK_SHAPES[r]]), abs=0.01)
        assert float(cells[2]) == pytest.approx(np.mean([b * s for b, s in RANK_SHAPES[r]]), abs=0.1)
    log_dir = tmp_path / "run" / "version_0"

    rows = _read_csv(log_dir / CSV_NAME)
    assert [(int(r["step"]), int(r["rank"])) for r in rows] == [(i, r) for i in range(STEPS) for r in (0, 1)]
    loads = np.zeros((STEPS, 2))
    for row in rows:
        i, r = int(row["step"]), int(row["rank"])
        b, s = RANK_SHAPES[r][i]
        assert (int(row["samples"]), int(row["seq_len"]), int(row["tokens"])) == (b, s, b * s)
        loads[i, r] = b * s ** 1.5
        assert float(row["load"]) == pytest.approx(loads[i, r], rel=1e-5)
    step_ms = np.array([[float(rows[2 * i + r]["step_time_ms"]) for r in (0, 1)] for i in range(STEPS)])

    metrics = [m for m in _read_csv(log_dir / "metrics.csv") if m.get("balance/load_cv")]
    assert [int(m["step"]) for m in metrics] == [3, 5]  # log_every_n_steps=4, then the final flush
    for m, lo, hi in zip(metrics, (0, 4), (4, STEPS)):
        cv = [statistics.pstdev(loads[i]) / statistics.fmean(loads[i]) for i in range(lo, hi)]
        bubble = [1 - statistics.fmean(loads[i]) / max(loads[i]) for i in range(lo, hi)]
        time_cv = [statistics.pstdev(step_ms[i]) / statistics.fmean(step_ms[i]) for i in range(lo, hi)]
        assert float(m["balance/load_cv"]) == pytest.approx(statistics.fmean(cv), rel=1e-6)
        assert float(m["balance/bubble_frac"]) == pytest.approx(statistics.fmean(bubble), rel=1e-6)
        assert float(m["balance/step_time_cv"]) == pytest.approx(statistics.fmean(time_cv), rel=1e-3, abs=1e-6)
        window = step_ms[max(0, hi - 3):hi].mean(axis=1).tolist()
        assert float(m["balance/step_time_cv_temporal"]) == pytest.approx(temporal_cv(window), rel=1e-3, abs=1e-6)
        unpredicted = step_ms[lo:hi].mean(axis=1) - loads[lo:hi].max(axis=1)
        assert float(m["balance/unpredicted_ms"]) == pytest.approx(unpredicted.mean(), rel=1e-4, abs=1e-3)
        for r in (0, 1):
            assert float(m[f"rank{r}/load"]) == pytest.approx(loads[lo:hi, r].mean(), rel=1e-6)
            want_tokens = np.mean([b * s for b, s in RANK_SHAPES[r][lo:hi]])
            assert float(m[f"rank{r}/tokens"]) == pytest.approx(want_tokens)
    assert cli_main(["report", str(log_dir)]) == 0
    assert (log_dir / "imbalance.png").stat().st_size > 10_000

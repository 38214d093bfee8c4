"""CostModelCalibration on CPU with the tiny example DiT: grid, fit, DataModule update, no trace
left on parameters/optimizer/RNG, cache reuse, and an injected out-of-memory point."""
import json
import math
import random

import lightning as L
import numpy as np
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger

from examples.video_dit.module import VideoDiTModule
from lightning_adaptiveload.callbacks.calibration import (CostModelCalibration, calibration_grid, model_fingerprint,
                                                          predicted_peak_bytes, seq_len_grid)
from lightning_adaptiveload.scheduling.cost_model import CostModel

TINY = dict(in_channels=4, dim=32, num_layers=1, num_heads=2, ffn_dim=64, text_dim=16, freq_dim=16)
SHAPES = {16: (1, 8, 8), 48: (3, 8, 8), 64: (1, 16, 16), 96: (2, 16, 12)}  # tokens -> latent (T, H, W)


pytestmark = pytest.mark.usefixtures("one_thread")


class GridDataModule(L.LightningDataModule):
    """The three methods the callback uses, with batches shaped like AdaptiveLoadDataModule's."""

    def __init__(self):
        super().__init__()
        self.cost_model_calls = []

    def bucket_seq_lens(self):
        return np.array(sorted(SHAPES), dtype=np.int64)

    def synthetic_batch(self, seq_len, batch_size):
        g = torch.Generator().manual_seed(seq_len * 1000 + batch_size)
        return {"latents": torch.randn(batch_size, 4, *SHAPES[seq_len], generator=g),
                "text": torch.randn(batch_size, 3, 16, generator=g),
                "seq_len": seq_len, "latent_shape": SHAPES[seq_len], "keys": [f"s{i}" for i in range(batch_size)]}

    def set_cost_model(self, cost_model, m_mem=None):
        self.cost_model_calls.append((cost_model, m_mem))

    def train_dataloader(self):
        return torch.utils.data.DataLoader([self.synthetic_batch(16, 2)] * 2, batch_size=None)


class CountingModule(VideoDiTModule):
    steps = 0

    def training_step(self, batch, batch_idx):
        type(self).steps += 1
        return super().training_step(batch, batch_idx)


class OOMModule(VideoDiTModule):
    """Runs out of memory (simulated) whenever B * S >= 128 tokens."""

    def training_step(self, batch, batch_idx):
        if batch["latents"].shape[0] * batch["seq_len"] >= 128:
            raise torch.OutOfMemoryError("simulated: CUDA out of memory. Tried to allocate 2.00 GiB")
        return super().training_step(batch, batch_idx)


class StateProbe(L.Callback):
    """Placed around the calibration callback: primes the optimizer state before it runs
    (one AdamW step on random gradients), snapshots everything, and compares afterwards."""

    def __init__(self, role, shared):
        self.role, self.shared = role, shared

    def on_fit_start(self, trainer, pl_module):
        opt = trainer.optimizers[0]
        if self.role == "before":
            for p in pl_module.parameters():
                p.grad = torch.randn_like(p)
            opt.step()
            opt.zero_grad(set_to_none=True)
            random.random(), np.random.rand(), torch.rand(1)  # advance every generator
            self.shared["params"] = {n: p.detach().clone() for n, p in pl_module.named_parameters()}
            self.shared["opt_state"] = [{k: v.clone() if torch.is_tensor(v) else v for k, v in st.items()}
                                        for st in opt.state.values()]
            self.shared["rng"] = (random.getstate(), np.random.get_state(), torch.get_rng_state())
            self.shared["training"] = {n: m.training for n, m in pl_module.named_modules()}
            return
        for name, param in pl_module.named_parameters():
            assert torch.equal(param, self.shared["params"][name]), name
            assert param.grad is None, name
        after = [st for st in opt.state.values()]
        assert len(after) == len(self.shared["opt_state"]) > 0
        for st, ref in zip(after, self.shared["opt_state"]):
            for k in ref:
                assert torch.equal(torch.as_tensor(st[k]), torch.as_tensor(ref[k])), k
        py, npy, tor = self.shared["rng"]
        assert random.getstate() == py
        np_after = np.random.get_state()
        assert np_after[0] == npy[0] and np.array_equal(np_after[1], npy[1]) and np_after[2:] == npy[2:]
        assert torch.equal(torch.get_rng_state(), tor)
        assert {n: m.training for n, m in pl_module.named_modules()} == self.shared["training"]
        self.shared["checked"] = True


def _fit(tmp_path, module, callbacks, max_steps=1):
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=max_steps, logger=CSVLogger(tmp_path / "logs"),
                        log_every_n_steps=1, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, default_root_dir=tmp_path, callbacks=callbacks)
    datamodule = GridDataModule()
    trainer.fit(module, datamodule=datamodule)
    return trainer, datamodule


def test_grid_spans_shortest_and_longest_bucket_ordered_by_tokens():
    assert seq_len_grid(np.array([64, 16, 16, 256, 1024, 4096]), 3) == [16, 256, 4096]
    assert seq_len_grid(np.array([7, 7]), 4) == [7]
    grid = calibration_grid([16, 256], [1, 2, 4, 32], max_tokens=1024)
    assert grid == sorted(grid, key=lambda p: (p[0] * p[1], p[1]))
    assert (32, 256) not in grid and (4, 256) in grid and (1, 256) in grid
    with pytest.raises(ValueError, match="bucket_seq_lens"):
        seq_len_grid(np.array([], dtype=np.int64), 3)


def test_predicted_peak_extrapolates_linearly_in_batch_size_per_seq_len():
    points = [{"batch_size": 1, "seq_len": 64, "status": "ok", "peak_bytes": 1000},
              {"batch_size": 2, "seq_len": 64, "status": "ok", "peak_bytes": 1300},
              {"batch_size": 4, "seq_len": 64, "status": "ok", "peak_bytes": 1900},
              {"batch_size": 1, "seq_len": 256, "status": "ok", "peak_bytes": 5000},
              {"batch_size": 8, "seq_len": 64, "status": "oom"}]
    # through (2, 1300) and (4, 1900): 300 bytes per sample
    assert predicted_peak_bytes(points, 8, 64) == pytest.approx(1900 + 300 * 4)
    assert predicted_peak_bytes(points, 2, 256) == 0.0  # one point at S=256: no extrapolation
    assert predicted_peak_bytes(points, 2, 16) == 0.0


def test_calibration_fits_updates_datamodule_and_leaves_no_trace(tmp_path):
    torch.manual_seed(0)
    shared = {}
    calib = CostModelCalibration(num_seq_lens=3, batch_sizes=[1, 2, 4], warmup=1, repeats=2,
                                 cache_path=str(tmp_path / "cache.json"))
    trainer, dm = _fit(tmp_path, VideoDiTModule(**TINY),
                       [StateProbe("before", shared), calib, StateProbe("after", shared)])
    assert shared.get("checked")
    assert len(calib.points) == 9 and all(p["status"] == "ok" for p in calib.points)
    assert all(p["time_ms"] > 0 and p["peak_bytes"] > 0 for p in calib.points)
    # the CPU memory estimate grows with the batch at a fixed S
    by_b = {p["batch_size"]: p["peak_bytes"] for p in calib.points if p["seq_len"] == 96}
    assert by_b[1] < by_b[2] < by_b[4]
    # the DataModule got the fitted model; no point was infeasible, so it keeps its own M_mem
    [(cm, m_mem)] = dm.cost_model_calls
    assert isinstance(cm, CostModel) and cm is calib.cost_model and m_mem is None and cm.p > 0
    # the fit is the cost model's own fit of the recorded measurements
    ok = calib.points
    ref = CostModel.fit([p["batch_size"] for p in ok], [p["seq_len"] for p in ok], [p["time_ms"] for p in ok])
    assert ref.form == cm.form and ref.params == pytest.approx(cm.params, rel=1e-9)
    log_dir = tmp_path / "logs" / "lightning_logs" / "version_0"
    doc = json.loads((log_dir / "calibration.json").read_text())
    assert doc["measurements"] == calib.points and doc["key"]["world_size"] == 1
    assert CostModel.from_json(log_dir / "calibration_cost_model.json").params == pytest.approx(cm.params)
    assert (log_dir / "calibration_fit.png").stat().st_size > 1000
    metrics = (log_dir / "metrics.csv").read_text()
    assert "calibration/p" in metrics and "train/loss" in metrics  # training ran after calibration


def test_cache_reuse_skips_the_benchmark_and_a_changed_model_does_not(tmp_path):
    cache = str(tmp_path / "cache.json")
    kwargs = dict(num_seq_lens=2, batch_sizes=[1, 2, 4], warmup=0, repeats=1, cache_path=cache)
    first = CostModelCalibration(**kwargs)
    CountingModule.steps = 0
    _fit(tmp_path / "a", CountingModule(**TINY), [first])
    measured_steps = CountingModule.steps
    # 6 grid points, 2 to 10 settling steps before the first, 1 training step
    assert not first.from_cache and 6 + 2 + 1 <= measured_steps <= 6 + 10 + 1

    second = CostModelCalibration(**kwargs)
    CountingModule.steps = 0
    _, dm = _fit(tmp_path / "b", CountingModule(**TINY), [second])
    assert second.from_cache and CountingModule.steps == 1  # only the training step
    assert second.points == first.points
    assert dm.cost_model_calls[0][0].params == pytest.approx(first.cost_model.params)

    third = CostModelCalibration(**kwargs)
    _fit(tmp_path / "c", CountingModule(**{**TINY, "dim": 48}), [third])
    assert not third.from_cache


def test_fingerprint_sees_activation_checkpointing_and_instance_forward_patches():
    # Both change the step's time and memory without touching a parameter: a cached calibration of
    # the plain model must not be reused for them.
    torch.manual_seed(0)
    plain = model_fingerprint(VideoDiTModule(**TINY))
    assert model_fingerprint(VideoDiTModule(**TINY)) == plain  # stable, so the cache can hit
    assert model_fingerprint(VideoDiTModule(**TINY, activation_checkpointing=True)) != plain

    def fused_forward(self, *args, **kwargs):  # what module surgery binds on a block instance
        return type(self).forward(self, *args, **kwargs)

    patched = VideoDiTModule(**TINY)
    block = patched.dit.blocks[0]
    block.forward = fused_forward.__get__(block)
    assert model_fingerprint(patched) != plain

    class WithObjectHparams(VideoDiTModule):  # hparams whose str holds an address, or unsortable keys
        def __init__(self, schedule, table):
            super().__init__(**TINY)
            self.save_hyperparameters()

    def key(schedule):
        return model_fingerprint(WithObjectHparams(schedule, {1: "a", "b": 2}))

    assert key(lambda step: 1.0) == key(lambda step: 1.0)


def test_resume_uses_the_checkpointed_calibration_not_a_new_benchmark(tmp_path):
    # The sampler's resume state holds m_mem, m_comp and p: a resumed fit must get the same cost
    # model even when the cache is gone (another root dir, another model's calibration since).
    cache = tmp_path / "cache.json"
    kwargs = dict(num_seq_lens=2, batch_sizes=[1, 2, 4], warmup=0, repeats=1, cache_path=str(cache))
    def trainer(max_steps, callbacks):
        return L.Trainer(accelerator="cpu", devices=1, max_steps=max_steps, logger=False, enable_progress_bar=False,
                         enable_model_summary=False, default_root_dir=tmp_path, callbacks=callbacks)

    first = CostModelCalibration(**kwargs)
    checkpoint = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=1, save_top_k=-1)
    trainer(1, [first, checkpoint]).fit(CountingModule(**TINY), datamodule=GridDataModule())
    cache.unlink()

    resumed = CostModelCalibration(**kwargs)
    CountingModule.steps = 0
    trainer = trainer(2, [resumed])
    dm = GridDataModule()
    trainer.fit(CountingModule(**TINY), datamodule=dm, ckpt_path=str(tmp_path / "ckpt" / "epoch=0-step=1.ckpt"))
    assert CountingModule.steps == 1 and trainer.global_step == 2  # one training step, no benchmark
    assert resumed.points == first.points and resumed.from_cache
    [(cm, _)] = dm.cost_model_calls
    assert cm.form == first.cost_model.form and cm.params == pytest.approx(first.cost_model.params, rel=1e-12)


def test_out_of_memory_point_is_recorded_infeasible_and_bounds_m_mem(tmp_path):
    calib = CostModelCalibration(num_seq_lens=4, batch_sizes=[1, 2, 4], warmup=1, repeats=1,
                                 cache_path=str(tmp_path / "cache.json"))
    _, dm = _fit(tmp_path, OOMModule(**TINY), [calib])
    status = {(p["batch_size"], p["seq_len"]): p["status"] for p in calib.points}
    for (b, s), st in status.items():
        if b * s < 128:
            assert st == "ok", (b, s)
    # (2, 64) is the first point to run out of memory; points dominating it are not run
    assert status[(2, 64)] == "oom" and status[(4, 64)] == "skipped_oom" and status[(2, 96)] == "skipped_oom"
    assert status[(4, 48)] == "oom"
    largest_ok = max(b * s for (b, s), st in status.items() if st == "ok")
    assert calib.measured_m_mem == math.floor(0.9 * largest_ok)
    assert dm.cost_model_calls[0][1] == calib.measured_m_mem


def test_too_few_feasible_points_is_a_clear_error(tmp_path):
    calib = CostModelCalibration(num_seq_lens=1, batch_sizes=[1, 2], warmup=0, repeats=1,
                                 cache_path=str(tmp_path / "cache.json"))
    with pytest.raises(RuntimeError, match="cannot fit the cost model from 2 feasible points"):
        _fit(tmp_path, VideoDiTModule(**TINY), [calib])


def test_any_fit_error_is_handed_to_every_rank_as_a_clear_error(tmp_path, monkeypatch):
    # Rank 0 fits while the others wait in the broadcast of its result: an error of any type must
    # travel through that broadcast, not escape on rank 0 alone (the others would wait forever).
    def failing_fit(*args, **kwargs):
        raise RuntimeError("solver diverged")

    monkeypatch.setattr(CostModel, "fit", failing_fit)
    calib = CostModelCalibration(num_seq_lens=2, batch_sizes=[1, 2, 4], warmup=0, repeats=1,
                                 cache_path=str(tmp_path / "cache.json"))
    with pytest.raises(RuntimeError, match=r"CostModelCalibration: cannot fit .*RuntimeError: solver diverged"):
        _fit(tmp_path, VideoDiTModule(**TINY), [calib])


def test_failing_outputs_on_rank_0_stop_every_rank_with_a_clear_error(tmp_path, monkeypatch):
    # Rank 0 alone writes the files; an error there must be agreed, or the other ranks would train
    # on and wait for rank 0 in their first collective.
    def failing_plot(*args, **kwargs):
        raise OSError("No space left on device")

    monkeypatch.setattr("lightning_adaptiveload.callbacks.calibration.plot_fit", failing_plot)
    calib = CostModelCalibration(num_seq_lens=2, batch_sizes=[1, 2, 4], warmup=0, repeats=1,
                                 cache_path=str(tmp_path / "cache.json"))
    with pytest.raises(RuntimeError, match="rank 0 failed to write .*OSError: No space left on device"):
        _fit(tmp_path, VideoDiTModule(**TINY), [calib])


def test_datamodule_without_the_methods_is_rejected(tmp_path):
    trainer = L.Trainer(accelerator="cpu", max_steps=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, callbacks=[CostModelCalibration()])
    loader = torch.utils.data.DataLoader([GridDataModule().synthetic_batch(16, 1)], batch_size=None)
    with pytest.raises(TypeError, match="synthetic_batch"):
        trainer.fit(VideoDiTModule(**TINY), train_dataloaders=loader)


class ManualOptimizationModule(VideoDiTModule):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)["loss"]
        self.manual_backward(loss)
        self.optimizers().step()
        self.optimizers().zero_grad()


def test_manual_optimization_is_rejected_before_any_step(tmp_path):
    # Its training_step steps the optimizer: benchmarking it would train on synthetic batches.
    torch.manual_seed(0)
    module = ManualOptimizationModule(**TINY)
    before = {n: p.detach().clone() for n, p in module.named_parameters()}
    calib = CostModelCalibration(num_seq_lens=2, batch_sizes=[1, 2, 4], warmup=0, repeats=1,
                                 cache_path=str(tmp_path / "cache.json"))
    with pytest.raises(TypeError, match="automatic optimization"):
        _fit(tmp_path, module, [calib])
    assert all(torch.equal(p, before[n]) for n, p in module.named_parameters())


class NoBatchIdxModule(VideoDiTModule):
    def training_step(self, batch):  # Lightning allows leaving out batch_idx
        return super().training_step(batch, 0)


def test_training_step_without_batch_idx_is_calibrated(tmp_path):
    calib = CostModelCalibration(num_seq_lens=2, batch_sizes=[1, 2, 4], warmup=0, repeats=1,
                                 cache_path=str(tmp_path / "cache.json"))
    trainer, _ = _fit(tmp_path, NoBatchIdxModule(**TINY), [calib])
    assert [p["status"] for p in calib.points] == ["ok"] * 6 and trainer.global_step == 1


def test_time_budget_stops_the_benchmark(tmp_path):
    calib = CostModelCalibration(num_seq_lens=2, batch_sizes=[1, 2, 4], warmup=0, repeats=1, time_budget_s=1e-9,
                                 cache_path=str(tmp_path / "cache.json"))
    CountingModule.steps = 0
    with pytest.raises(RuntimeError, match="from 0 feasible points"):
        _fit(tmp_path, CountingModule(**TINY), [calib])
    assert CountingModule.steps == 0
    assert [p["status"] for p in calib.points] == ["skipped_budget"] * 6


@pytest.mark.parametrize("text", ["{not json", "[]", '{"format": "adaptiveload.calibration", "version": 1}'])
def test_unreadable_or_foreign_cache_is_measured_again(tmp_path, text):
    cache = tmp_path / "cache.json"
    cache.write_text(text)
    calib = CostModelCalibration(num_seq_lens=2, batch_sizes=[1, 2, 4], warmup=0, repeats=1, cache_path=str(cache))
    _fit(tmp_path, VideoDiTModule(**TINY), [calib])
    assert not calib.from_cache and len(calib.points) == 6
    assert json.loads(cache.read_text())["points"] == calib.points  # and the cache is rewritten


class RealOOMModule(VideoDiTModule):
    """Asks the CUDA allocator for more than the device holds whenever B * S >= 128 tokens."""

    def training_step(self, batch, batch_idx):
        if batch["latents"].shape[0] * batch["seq_len"] >= 128:
            total = torch.cuda.get_device_properties(self.device).total_memory
            torch.empty(2 * total, dtype=torch.uint8, device=self.device)
        return super().training_step(batch, batch_idx)


@pytest.mark.cuda
def test_cuda_out_of_memory_is_caught_freed_and_peak_memory_is_recorded(tmp_path):
    calib = CostModelCalibration(num_seq_lens=4, batch_sizes=[1, 2, 4], warmup=1, repeats=2,
                                 cache_path=str(tmp_path / "cache.json"))
    trainer = L.Trainer(accelerator="gpu", devices=1, max_steps=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, default_root_dir=tmp_path, callbacks=[calib])
    trainer.fit(RealOOMModule(**TINY), datamodule=GridDataModule())
    status = {(p["batch_size"], p["seq_len"]): p["status"] for p in calib.points}
    assert status[(2, 64)] == "oom" and status[(4, 48)] == "oom" and status[(1, 96)] == "ok"
    peaks = {p["batch_size"]: p["peak_bytes"] for p in calib.points if p["seq_len"] == 16}
    assert 0 < peaks[1] < peaks[4] < torch.cuda.get_device_properties(0).total_memory
    assert trainer.global_step == 1  # training went on after the out-of-memory points


class AutocastProbe(VideoDiTModule):
    autocast = []

    def training_step(self, batch, batch_idx):
        type(self).autocast.append(torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu"))
        return super().training_step(batch, batch_idx)


def test_calibration_steps_run_under_the_trainers_precision(tmp_path):
    calib = CostModelCalibration(num_seq_lens=2, batch_sizes=[1, 2, 4], warmup=0, repeats=1,
                                 cache_path=str(tmp_path / "cache.json"))
    trainer = L.Trainer(accelerator="cpu", precision="bf16-mixed", max_steps=1, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, default_root_dir=tmp_path,
                        callbacks=[calib])
    AutocastProbe.autocast = []
    trainer.fit(AutocastProbe(**TINY), datamodule=GridDataModule())
    assert len(AutocastProbe.autocast) >= 6 + 2 + 1  # grid, settling, training
    assert all(dtype == torch.bfloat16 for dtype in AutocastProbe.autocast)
    assert calib.points and all(p["status"] == "ok" for p in calib.points)
    assert json.loads((tmp_path / "cache.json").read_text())["key"]["precision"] == "bf16-mixed"

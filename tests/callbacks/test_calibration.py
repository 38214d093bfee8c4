"""CostModelCalibration on CPU with the tiny example DiT: grid, fit, DataModule update, no trace
left on parameters/optimizer/RNG, cache reuse, and an injected out-of-memory point."""
import json
import math
import random
import re
import time

import lightning as L
import numpy as np
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger

from examples.video_dit.module import VideoDiTModule
from lightning_adaptiveload.calibration.compiled import RECOMPILE_SLACK, compiled_submodules, raise_recompile_limit
from lightning_adaptiveload.calibration.grid import (MIN_FIT_POINTS, calibration_grid, predicted_peak_bytes,
                                                     required_points, seq_len_grid)
from lightning_adaptiveload.calibration.loop import Calibration
from lightning_adaptiveload.calibration.record import model_fingerprint
from lightning_adaptiveload.calibration.runner import StepRunner
from lightning_adaptiveload.callbacks.calibration import CostModelCalibration
from lightning_adaptiveload.monitoring.compile_counters import read_dynamo_counts
from lightning_adaptiveload.scheduling.cost_model import CostModel
from lightning_adaptiveload.scheduling.depth_choice import PLAN_MARGIN
from lightning_adaptiveload.scheduling.verification import MeasuredShape

TINY = dict(in_channels=4, dim=32, num_layers=1, num_heads=2, ffn_dim=64, text_dim=16, freq_dim=16)
SHAPES = {16: (1, 8, 8), 48: (3, 8, 8), 64: (1, 16, 16), 96: (2, 16, 12)}  # tokens -> latent (T, H, W)


# Tests of anything but the trust check accept any fit: a launch-bound tiny model on a shared CPU
# can fail the check, which would re-measure and fall back.
TRUST_ANY = dict(max_heldout_error=float("inf"), min_work_correlation=-1.0)  # both checks of the time fit off
# CPU "peaks" (bytes saved for backward) of a tiny model fit the memory model's form loosely: the tests
# of the memory plan's mechanics turn its own trust check off (test_a_distrusted_memory_model_... runs it)
PLAN_ANY = dict(**TRUST_ANY, max_memory_heldout_error=float("inf"))

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

    def set_cost_model(self, cost_model, m_mem=None, policy=None):
        self.cost_model_calls.append((cost_model, m_mem) if policy is None else (cost_model, m_mem, policy))

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
    required = required_points([16, 256], [1, 2, 4, 32], max_tokens=1024)
    # the points the fit needs first: B = 1 at every S, then more B at the shortest S
    assert required == [(1, 16), (1, 256), (2, 16), (4, 16), (32, 16), (2, 256), (4, 256)]
    assert grid[:len(required)] == required
    rest = grid[len(required):]
    assert rest == sorted(rest, key=lambda p: (p[0] * p[1], p[1])) and set(grid) == {
        (b, s) for s in (16, 256) for b in (1, 2, 4, 32) if b * s <= 1024 or b == 1}
    assert (32, 256) not in grid and (4, 256) in grid and (1, 256) in grid
    # required points stop at MIN_FIT_POINTS and respect max_tokens
    many = required_points([8, 64, 512], [1, 2, 4, 8, 16, 32, 64, 128], max_tokens=4096)
    assert len(many) == MIN_FIT_POINTS and many[3:] == [(2, 8), (4, 8), (8, 8), (16, 8)]
    assert required_points([8, 64], [1, 2, 4, 8], max_tokens=16) == [(1, 8), (1, 64), (2, 8)]
    # too few batch sizes at the shortest S: the next S supplies the rest
    assert required_points([16, 96], [1, 2, 4], None) == [(1, 16), (1, 96), (2, 16), (4, 16), (2, 96), (4, 96)]
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
                                 cache_path=str(tmp_path / "cache.json"), **TRUST_ANY)
    trainer, dm = _fit(tmp_path, VideoDiTModule(**TINY),
                       [StateProbe("before", shared), calib, StateProbe("after", shared)])
    assert shared.get("checked")
    assert len(calib.result.points) == 9 and all(p["status"] == "ok" for p in calib.result.points)
    assert all(p["time_ms"] > 0 and p["peak_bytes"] > 0 for p in calib.result.points)
    # the CPU memory estimate grows with the batch at a fixed S
    by_b = {p["batch_size"]: p["peak_bytes"] for p in calib.result.points if p["seq_len"] == 96}
    assert by_b[1] < by_b[2] < by_b[4]
    # the DataModule got the fitted model; no point was infeasible, so it keeps its own M_mem
    [(cm, m_mem)] = dm.cost_model_calls
    assert isinstance(cm, CostModel) and cm is calib.result.cost_model and m_mem is None and cm.p > 0
    # the fit is the cost model's own fit of the recorded measurements
    ok = calib.result.points
    ref = CostModel.fit([p["batch_size"] for p in ok], [p["seq_len"] for p in ok], [p["time_ms"] for p in ok])
    assert ref.form == cm.form and ref.params == pytest.approx(cm.params, rel=1e-9)
    log_dir = tmp_path / "logs" / "lightning_logs" / "version_0"
    doc = json.loads((log_dir / "calibration.json").read_text())
    assert doc["measurements"] == calib.result.points and doc["key"]["world_size"] == 1
    assert CostModel.from_json(log_dir / "calibration_cost_model.json").params == pytest.approx(cm.params)
    assert (log_dir / "calibration_fit.png").stat().st_size > 1000
    metrics = (log_dir / "metrics.csv").read_text()
    assert "calibration/p" in metrics and "train/loss" in metrics  # training ran after calibration


def test_cache_reuse_skips_the_benchmark_and_a_changed_model_does_not(tmp_path):
    cache = str(tmp_path / "cache.json")
    kwargs = dict(num_seq_lens=2, batch_sizes=[1, 2, 4], warmup=0, repeats=1, cache_path=cache, **TRUST_ANY)
    first = CostModelCalibration(**kwargs)
    CountingModule.steps = 0
    _fit(tmp_path / "a", CountingModule(**TINY), [first])
    measured_steps = CountingModule.steps
    # 6 grid points, 2 to 10 settling steps before the first, 1 training step
    assert first.result.source == "measured" and 6 + 2 + 1 <= measured_steps <= 6 + 10 + 1

    second = CostModelCalibration(**kwargs)
    CountingModule.steps = 0
    _, dm = _fit(tmp_path / "b", CountingModule(**TINY), [second])
    assert second.result.source == "cache" and CountingModule.steps == 1  # only the training step
    assert second.result.points == first.result.points
    assert dm.cost_model_calls[0][0].params == pytest.approx(first.result.cost_model.params)

    third = CostModelCalibration(**kwargs)
    _fit(tmp_path / "c", CountingModule(**{**TINY, "dim": 48}), [third])
    assert third.result.source == "measured"


class TextDataModule(GridDataModule):
    """GridDataModule with the text shape attributes AdaptiveLoadDataModule has."""

    def __init__(self, text_len=3, text_dim=16):
        super().__init__()
        self.text_len, self.text_dim = text_len, text_dim


class ThreadProbeModule(VideoDiTModule):
    """Records torch's intra-op thread count at every step."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.threads = []

    def training_step(self, batch, batch_idx):
        self.threads.append(torch.get_num_threads())
        return super().training_step(batch, batch_idx)


def test_the_cache_key_names_the_text_shape_accumulation_torch_and_cpu_threads(tmp_path):
    cache = tmp_path / "cache.json"
    kwargs = dict(num_seq_lens=2, batch_sizes=[1, 2, 4], warmup=0, repeats=1, cache_path=str(cache), verify=False,
                  **TRUST_ANY)

    def source(run, dm, threads=1, **trainer_kwargs):
        calib = CostModelCalibration(**kwargs)
        torch.set_num_threads(threads)  # the one_thread fixture restores the count after the test
        _fit_dm(tmp_path / run, VideoDiTModule(**TINY), [calib], dm, **trainer_kwargs)
        return calib.result.source

    assert source("a", TextDataModule()) == "measured"
    key = json.loads(cache.read_text())["key"]
    assert key["data"] == {"latent_channels": None, "text_len": 3, "text_dim": 16}
    assert key["accumulate_grad_batches"] == 1 and key["torch"] == torch.__version__ and key["cpu_threads"] == 1
    assert source("b", TextDataModule()) == "cache"
    # each change measures again (and, trusted, replaces the cache with its own key)
    assert source("c", TextDataModule(text_len=5)) == "measured"
    assert source("d", TextDataModule(text_len=5, text_dim=8)) == "measured"
    assert source("e", TextDataModule(text_len=5, text_dim=8), accumulate_grad_batches=2) == "measured"
    assert source("f", TextDataModule(text_len=5, text_dim=8), threads=2, accumulate_grad_batches=2) == "measured"
    assert json.loads(cache.read_text())["key"]["cpu_threads"] == 2
    assert source("g", TextDataModule(text_len=5, text_dim=8), threads=2, accumulate_grad_batches=2) == "cache"


def test_cpu_calibration_steps_run_on_one_thread_and_training_on_the_runs_count(tmp_path):
    module = ThreadProbeModule(**TINY)
    calib = CostModelCalibration(num_seq_lens=2, batch_sizes=[1, 2, 4], warmup=0, repeats=1,
                                 cache_path=str(tmp_path / "cache.json"), **TRUST_ANY)
    torch.set_num_threads(2)  # the one_thread fixture restores the count after the test
    _fit_dm(tmp_path, module, [calib], ShapesDataModule(), max_steps=2)
    # every step but training's two ran on one thread (the grid and verification), then the count came back
    assert len(module.threads) > 2 and module.threads[:-2] == [1] * (len(module.threads) - 2)
    assert module.threads[-2:] == [2, 2] and torch.get_num_threads() == 2


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
    kwargs = dict(num_seq_lens=2, batch_sizes=[1, 2, 4], warmup=0, repeats=1, cache_path=str(cache), **TRUST_ANY)
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
    assert resumed.result.points == first.result.points and resumed.result.source == "checkpoint"
    [(cm, _)] = dm.cost_model_calls
    assert cm.form == first.result.cost_model.form and cm.params == pytest.approx(first.result.cost_model.params, rel=1e-12)


def test_out_of_memory_point_is_recorded_infeasible_and_bounds_m_mem(tmp_path):
    calib = CostModelCalibration(num_seq_lens=4, batch_sizes=[1, 2, 4], warmup=1, repeats=1,
                                 cache_path=str(tmp_path / "cache.json"), **TRUST_ANY)
    _, dm = _fit(tmp_path, OOMModule(**TINY), [calib])
    status = {(p["batch_size"], p["seq_len"]): p["status"] for p in calib.result.points}
    for (b, s), st in status.items():
        if b * s < 128:
            assert st == "ok", (b, s)
    # (2, 64) is the first point to run out of memory; points dominating it are not run
    assert status[(2, 64)] == "oom" and status[(4, 64)] == "skipped_oom" and status[(2, 96)] == "skipped_oom"
    assert status[(4, 48)] == "oom"
    largest_ok = max(b * s for (b, s), st in status.items() if st == "ok")
    assert calib.result.m_mem == math.floor(0.9 * largest_ok)
    assert dm.cost_model_calls[0][1] == calib.result.m_mem


def test_too_few_feasible_points_fall_back_to_token_equal(tmp_path):
    calib = CostModelCalibration(num_seq_lens=1, batch_sizes=[1, 2], warmup=0, repeats=1,
                                 cache_path=str(tmp_path / "cache.json"))
    with pytest.warns(UserWarning, match="NOT trusted.*from 2 feasible points.*falls back to the token_equal"):
        trainer, dm = _fit(tmp_path, VideoDiTModule(**TINY), [calib])
    assert not calib.result.trusted and calib.result.cost_model is None and calib.result.source == "measured again"
    assert dm.cost_model_calls == [(None, None, "token_equal")] and trainer.global_step == 1
    assert not (tmp_path / "cache.json").exists()


def test_any_fit_error_is_handed_to_every_rank_and_falls_back(tmp_path, monkeypatch):
    # Rank 0 fits while the others wait in the broadcast of its result: an error of any type must
    # travel through that broadcast as the same verdict, not escape on rank 0 alone.
    def failing_fit(*args, **kwargs):
        raise RuntimeError("solver diverged")

    monkeypatch.setattr(CostModel, "fit", failing_fit)
    calib = CostModelCalibration(num_seq_lens=2, batch_sizes=[1, 2, 4], warmup=0, repeats=1,
                                 cache_path=str(tmp_path / "cache.json"))
    with pytest.warns(UserWarning, match=r"NOT trusted \(cannot fit .*RuntimeError: solver diverged"):
        _, dm = _fit(tmp_path, VideoDiTModule(**TINY), [calib])
    assert calib.result.distrust_reasons and "solver diverged" in calib.result.distrust_reasons[0]
    assert dm.cost_model_calls == [(None, None, "token_equal")]


def test_failing_outputs_on_rank_0_stop_every_rank_with_a_clear_error(tmp_path, monkeypatch):
    # Rank 0 alone writes the files; an error there must be agreed, or the other ranks would train
    # on and wait for rank 0 in their first collective.
    def failing_plot(*args, **kwargs):
        raise OSError("No space left on device")

    monkeypatch.setattr("lightning_adaptiveload.calibration.report.plot_fit", failing_plot)
    calib = CostModelCalibration(num_seq_lens=2, batch_sizes=[1, 2, 4], warmup=0, repeats=1,
                                 cache_path=str(tmp_path / "cache.json"), **TRUST_ANY)
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
                                 cache_path=str(tmp_path / "cache.json"), **TRUST_ANY)
    with pytest.raises(TypeError, match="automatic optimization"):
        _fit(tmp_path, module, [calib])
    assert all(torch.equal(p, before[n]) for n, p in module.named_parameters())


class NoBatchIdxModule(VideoDiTModule):
    def training_step(self, batch):  # Lightning allows leaving out batch_idx
        return super().training_step(batch, 0)


def test_training_step_without_batch_idx_is_calibrated(tmp_path):
    calib = CostModelCalibration(num_seq_lens=2, batch_sizes=[1, 2, 4], warmup=0, repeats=1,
                                 cache_path=str(tmp_path / "cache.json"), **TRUST_ANY)
    trainer, _ = _fit(tmp_path, NoBatchIdxModule(**TINY), [calib])
    assert [p["status"] for p in calib.result.points] == ["ok"] * 6 and trainer.global_step == 1


def test_time_budget_skips_optional_points_but_never_the_required_ones(tmp_path):
    calib = CostModelCalibration(num_seq_lens=3, batch_sizes=[1, 2, 4], warmup=0, repeats=1, time_budget_s=1e-9,
                                 cache_path=str(tmp_path / "cache.json"), **TRUST_ANY)
    _fit(tmp_path, VideoDiTModule(**TINY), [calib])
    # the grid's required points, written out (not by required_points, which the callback calls): B = 1 at
    # S = 16, 64, 96, then B = 2, 4 at the shortest S, then at the next, up to MIN_FIT_POINTS
    required = [(1, 16), (1, 64), (1, 96), (2, 16), (4, 16), (2, 64), (4, 64)]
    status = {(p["batch_size"], p["seq_len"]): p["status"] for p in calib.result.points}
    assert len(status) == 9 and len(required) == MIN_FIT_POINTS
    assert all(status[p] == "ok" for p in required)
    # the budget counts the optional points' own warm time: the first starts with none spent, the rest not
    optional = [(p["batch_size"], p["seq_len"]) for p in calib.result.points if (p["batch_size"], p["seq_len"]) not in required]
    assert [status[p] for p in optional] == ["ok"] + ["skipped_budget"] * (len(optional) - 1)
    assert calib.result.cost_model is not None  # the fit had what it needs


@pytest.mark.parametrize("text", ["{not json", "[]", '{"format": "adaptiveload.calibration", "version": 1}'])
def test_unreadable_or_foreign_cache_is_measured_again(tmp_path, text):
    cache = tmp_path / "cache.json"
    cache.write_text(text)
    calib = CostModelCalibration(num_seq_lens=2, batch_sizes=[1, 2, 4], warmup=0, repeats=1, cache_path=str(cache),
                                 **TRUST_ANY)
    _fit(tmp_path, VideoDiTModule(**TINY), [calib])
    assert calib.result.source == "measured" and len(calib.result.points) == 6
    assert json.loads(cache.read_text())["points"] == calib.result.points  # and the cache is rewritten


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
                                 cache_path=str(tmp_path / "cache.json"), **TRUST_ANY)
    trainer = L.Trainer(accelerator="gpu", devices=1, max_steps=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, default_root_dir=tmp_path, callbacks=[calib])
    trainer.fit(RealOOMModule(**TINY), datamodule=GridDataModule())
    status = {(p["batch_size"], p["seq_len"]): p["status"] for p in calib.result.points}
    assert status[(2, 64)] == "oom" and status[(4, 48)] == "oom" and status[(1, 96)] == "ok"
    peaks = {p["batch_size"]: p["peak_bytes"] for p in calib.result.points if p["seq_len"] == 16}
    assert 0 < peaks[1] < peaks[4] < torch.cuda.get_device_properties(0).total_memory
    assert trainer.global_step == 1  # training went on after the out-of-memory points


@pytest.mark.cuda
def test_cuda_verification_runs_with_the_optimizer_state_and_records_reserved_memory(tmp_path):
    calib = CostModelCalibration(num_seq_lens=2, batch_sizes=[1, 2, 4], warmup=1, repeats=1,
                                 cache_path=str(tmp_path / "cache.json"), **TRUST_ANY)
    trainer = L.Trainer(accelerator="gpu", devices=1, max_steps=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, default_root_dir=tmp_path, callbacks=[calib])
    module = VideoDiTModule(**TINY)
    trainer.fit(module, datamodule=ShapesDataModule())
    state = calib.result.optimizer_state
    param_bytes = sum(p.numel() * p.element_size() for p in module.parameters())
    # AdamW's two moments per parameter, each allocation rounded up to the allocator's 512-byte blocks
    rounded = sum(2 * -(-p.numel() * p.element_size() // 512) * 512 for p in module.parameters())
    assert state.created and state.state_bytes == rounded and state.step_peak_bytes > 4 * param_bytes
    shapes = calib.result.verification.verification.shapes
    assert len(shapes) == len(ShapesDataModule.SCHEDULED) and all(m.fits for m in shapes)
    # every verified step held the optimizer state; the allocator reserved at least what it allocated
    assert all(m.peak_bytes >= 3 * param_bytes and m.reserved_bytes >= m.peak_bytes for m in shapes)
    assert all(m.cold_ms > 0 and m.warm_ms > 0 for m in shapes)


@pytest.mark.cuda
def test_cuda_grid_points_record_both_peaks_and_the_memory_model_is_fitted_on_the_larger(tmp_path):
    torch.manual_seed(0)
    calib = CostModelCalibration(num_seq_lens=3, batch_sizes=[1, 2, 4], warmup=1, repeats=2,
                                 cache_path=str(tmp_path / "cache.json"), **PLAN_ANY)
    trainer = L.Trainer(accelerator="gpu", devices=1, max_steps=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, default_root_dir=tmp_path,
                        callbacks=[PerBucketCheckpointing(block_classes=[DiTBlock]), calib])
    trainer.fit(VideoDiTModule(**TWO_BLOCKS), datamodule=PlanningDataModule())
    ok = [p for p in calib.result.points if p["status"] == "ok"]
    assert {p["checkpointed"] for p in ok} == {2, 1, 0}  # k = L, L // 2 and the low depth (0 fits a tiny model)
    assert all(p["reserved_bytes"] >= p["peak_bytes"] > 0 and p["cold_ms"] > 0 for p in ok)
    held = np.maximum([p["peak_bytes"] for p in ok], [p["reserved_bytes"] for p in ok]).astype(np.float64)
    b, s, k = (np.array([p[key] for p in ok], dtype=np.float64) for key in ("batch_size", "seq_len", "checkpointed"))
    ref = MemoryModel.fit(b, s, k, held, 2)
    memory = calib.result.memory.memory_model
    state = calib.result.memory.optimizer_memory.state_bytes
    assert memory.params["m0"] == pytest.approx(ref.params["m0"] + state, rel=1e-9)
    assert {n: v for n, v in memory.params.items() if n != "m0"} == pytest.approx(
        {n: v for n, v in ref.params.items() if n != "m0"}, rel=1e-9)


class AutocastProbe(VideoDiTModule):
    autocast = []

    def training_step(self, batch, batch_idx):
        type(self).autocast.append(torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu"))
        return super().training_step(batch, batch_idx)


def test_calibration_steps_run_under_the_trainers_precision(tmp_path):
    calib = CostModelCalibration(num_seq_lens=2, batch_sizes=[1, 2, 4], warmup=0, repeats=1,
                                 cache_path=str(tmp_path / "cache.json"), **TRUST_ANY)
    trainer = L.Trainer(accelerator="cpu", precision="bf16-mixed", max_steps=1, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, default_root_dir=tmp_path,
                        callbacks=[calib])
    AutocastProbe.autocast = []
    trainer.fit(AutocastProbe(**TINY), datamodule=GridDataModule())
    assert len(AutocastProbe.autocast) >= 6 + 2 + 1  # grid, settling, training
    assert all(dtype == torch.bfloat16 for dtype in AutocastProbe.autocast)
    assert calib.result.points and all(p["status"] == "ok" for p in calib.result.points)
    assert json.loads((tmp_path / "cache.json").read_text())["key"]["precision"] == "bf16-mixed"


class ShapesDataModule(GridDataModule):
    """GridDataModule that also lists the batch shapes training can schedule."""

    SCHEDULED = [(4, (1, 8, 8), 3), (2, (3, 8, 8), 9), (1, (2, 16, 12), 5), (2, (1, 16, 16), 1)]

    def synthetic_batch(self, seq_len_or_shape, batch_size):
        if isinstance(seq_len_or_shape, tuple):
            seq_len = next(s for s, thw in SHAPES.items() if thw == seq_len_or_shape)
            return super().synthetic_batch(seq_len, batch_size)
        return super().synthetic_batch(seq_len_or_shape, batch_size)

    def scheduled_batch_shapes(self):
        return list(self.SCHEDULED)


def _fit_dm(tmp_path, module, callbacks, datamodule, **trainer_kwargs):
    kwargs = dict(accelerator="cpu", devices=1, max_steps=1, logger=CSVLogger(tmp_path / "logs"), log_every_n_steps=1,
                  enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                  default_root_dir=tmp_path, callbacks=callbacks)
    trainer = L.Trainer(**{**kwargs, **trainer_kwargs})
    trainer.fit(module, datamodule=datamodule)
    return trainer


@pytest.mark.parametrize("kind", ["flat", "falling", "noisy"])
def test_untrustworthy_timings_warn_remeasure_fall_back_and_are_not_cached(tmp_path, monkeypatch, kind):
    """Times that do not grow with the work, or that no form predicts, must not schedule training."""
    rng = np.random.default_rng(3)
    calls = []

    def fake_step(self, batch):
        calls.append(batch["latents"].shape[0])
        tokens = batch["latents"].shape[0] * batch["seq_len"]
        if kind == "flat":
            return 5.0
        if kind == "falling":
            return 1000.0 / tokens
        return float(np.exp(rng.normal(0.0, 1.5)))  # log-normal noise, unrelated to the shape

    monkeypatch.setattr(StepRunner, "step", fake_step)
    calib = CostModelCalibration(num_seq_lens=4, batch_sizes=[1, 2, 4], warmup=0, repeats=2,
                                 cache_path=str(tmp_path / "cache.json"), verify=False)
    dm = GridDataModule()
    with pytest.warns(UserWarning) as record:
        _fit_dm(tmp_path, VideoDiTModule(**TINY), [calib], dm)
    messages = " ".join(str(w.message) for w in record)
    assert "the fit is not trusted" in messages and "measuring again with 6 repeats" in messages
    assert "NOT trusted" in messages and "falls back to the token_equal policy" in messages
    assert not calib.result.trusted and calib.result.source == "measured again" and calib.result.distrust_reasons
    if kind != "noisy":
        assert any("does not grow" in r for r in calib.result.distrust_reasons)
    # first pass: 2 repeats per point; second: 6 (plus settling steps at the first point of each)
    grid_points = len(calib.result.points)
    assert len(calls) >= grid_points * (2 + 6)
    assert dm.cost_model_calls == [(None, None, "token_equal")]
    assert not (tmp_path / "cache.json").exists()
    doc = json.loads((tmp_path / "logs" / "lightning_logs" / "version_0" / "calibration.json").read_text())
    assert doc["trusted"] is False and doc["source"] == "measured again" and doc["distrust_reasons"]


def test_a_fit_trusted_on_the_second_measurement_is_used_and_cached(tmp_path, monkeypatch):
    passes = []

    def fake_step(self, batch):
        b, s = batch["latents"].shape[0], batch["seq_len"]
        if len(passes) == 0:
            return 5.0  # first pass: flat
        return 2.0 + 0.01 * b * s + 1e-4 * b * s * s  # second: a clean linear-quadratic cost

    real_sweep = Calibration._sweep

    def counting_sweep(self, *args, **kwargs):
        out = real_sweep(self, *args, **kwargs)
        passes.append(len(out))
        return out

    monkeypatch.setattr(StepRunner, "step", fake_step)
    monkeypatch.setattr(Calibration, "_sweep", counting_sweep)
    calib = CostModelCalibration(num_seq_lens=4, batch_sizes=[1, 2, 4], warmup=0, repeats=1,
                                 cache_path=str(tmp_path / "cache.json"), verify=False)
    dm = GridDataModule()
    _fit_dm(tmp_path, VideoDiTModule(**TINY), [calib], dm)
    assert len(passes) == 2 and calib.result.trusted and calib.result.source == "measured again"
    [(cm, _)] = dm.cost_model_calls
    assert cm is calib.result.cost_model and cm.quality["heldout_mean_rel_err"] < 0.01
    assert json.loads((tmp_path / "cache.json").read_text())["trusted"] is True


def test_verification_runs_every_scheduled_shape_cold_then_warm_most_tokens_first(tmp_path, monkeypatch):
    seen = []
    real_step = StepRunner.step

    def recording_step(self, batch):
        seen.append((batch["latents"].shape[0], tuple(batch["latents"].shape[2:])))
        return real_step(self, batch)

    monkeypatch.setattr(StepRunner, "step", recording_step)
    calib = CostModelCalibration(num_seq_lens=2, batch_sizes=[1, 2, 4], warmup=0, repeats=1,
                                 cache_path=str(tmp_path / "cache.json"), **TRUST_ANY)
    _fit_dm(tmp_path, VideoDiTModule(**TINY), [calib], ShapesDataModule())
    tokens = {thw: s for s, thw in SHAPES.items()}
    # most tokens B * S first (a shape after every one that can bound it), ties longer S first
    expected = sorted(ShapesDataModule.SCHEDULED, key=lambda x: (-x[0] * tokens[x[1]], -tokens[x[1]]))
    assert [b for b, *_ in expected] == [2, 1, 2, 4]
    outcome = calib.result.verification
    shapes = outcome.verification.shapes
    assert [(m.batch_size, m.latent_shape) for m in shapes] == [(b, thw) for b, thw, _ in expected]
    assert all(m.fits and m.cold_ms > 0 and m.warm_ms > 0 and m.peak_bytes > 0 for m in shapes)
    assert outcome.converged and outcome.rounds == 1 and not outcome.settled and outcome.left_cold == 0
    # two steps per shape (cold, then warm), after the grid, in that order (training steps do not go
    # through the runner)
    assert seen[-2 * len(expected):] == [(b, thw) for b, thw, _ in expected for _ in range(2)]
    doc = json.loads((tmp_path / "logs" / "lightning_logs" / "version_0" / "calibration.json").read_text())
    assert [MeasuredShape.from_dict(m) for m in doc["verification"]["shapes"]] == list(shapes)
    assert doc["verify_seconds"] > 0 and doc["verification"]["converged"] is True


def test_a_shape_over_the_budget_that_cannot_be_planned_again_warns_and_is_never_cached(tmp_path, monkeypatch):
    """A DataModule that lists its shapes but takes no limits (no set_verification): the shape over the
    budget is reported unresolved, loudly, and the record is not cached (the next run would plan the
    same batch again)."""
    biggest = max(b * s for s, thw in SHAPES.items() for b, t, _ in ShapesDataModule.SCHEDULED if t == thw)

    def measure(self, batch_fn, warmup, repeats, settle=False, empty_cache=False):
        out = real_measure(self, batch_fn, warmup, repeats, settle=settle, empty_cache=empty_cache)
        batch = batch_fn()
        if empty_cache and batch["latents"].shape[0] * batch["seq_len"] == biggest:
            out["reserved_bytes"] = 10**15  # far over any budget
        return out

    real_measure = StepRunner.measure
    monkeypatch.setattr(StepRunner, "measure", measure)
    calib = CostModelCalibration(num_seq_lens=2, batch_sizes=[1, 2, 4], warmup=0, repeats=1,
                                 cache_path=str(tmp_path / "cache.json"), **TRUST_ANY)
    with pytest.warns(UserWarning, match="did not fit in verification and ShapesDataModule cannot be planned again"):
        _fit_dm(tmp_path, VideoDiTModule(**TINY), [calib], ShapesDataModule())
    outcome = calib.result.verification
    assert [m.status for m in outcome.verification.shapes if m.batch_size * m.seq_len == biggest][0] == "over_budget"
    assert not outcome.converged and len(outcome.unresolved) == 1
    assert calib.result.trusted and not calib.result.cacheable and not (tmp_path / "cache.json").exists()


def test_verification_off_and_datamodules_without_a_shape_list(tmp_path):
    off = CostModelCalibration(num_seq_lens=2, batch_sizes=[1, 2, 4], warmup=0, repeats=1, verify=False,
                               cache_path=str(tmp_path / "a.json"), **TRUST_ANY)
    _fit_dm(tmp_path / "a", VideoDiTModule(**TINY), [off], ShapesDataModule())
    assert off.result.verification is None and off.result.verify_s < 0.01
    plain = CostModelCalibration(num_seq_lens=2, batch_sizes=[1, 2, 4], warmup=0, repeats=1,
                                 cache_path=str(tmp_path / "b.json"), **TRUST_ANY)
    _fit_dm(tmp_path / "b", VideoDiTModule(**TINY), [plain], GridDataModule())
    assert plain.result.verification is None


def test_cached_calibration_still_verifies_and_a_resume_says_from_checkpoint(tmp_path, caplog):
    kwargs = dict(num_seq_lens=2, batch_sizes=[1, 2, 4], warmup=0, repeats=1, cache_path=str(tmp_path / "c.json"),
                  **TRUST_ANY)
    _fit_dm(tmp_path / "a", VideoDiTModule(**TINY), [CostModelCalibration(**kwargs)], ShapesDataModule())
    cached = CostModelCalibration(**kwargs)
    _fit_dm(tmp_path / "b", VideoDiTModule(**TINY), [cached], ShapesDataModule())
    shapes = cached.result.verification.verification.shapes
    assert cached.result.source == "cache" and [m.status for m in shapes] == ["fits"] * 4

    checkpoint = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=1, save_top_k=-1)
    _fit_dm(tmp_path / "c", VideoDiTModule(**TINY), [CostModelCalibration(**kwargs), checkpoint], ShapesDataModule(),
            enable_checkpointing=True)
    resumed = CostModelCalibration(**kwargs)
    caplog.clear()
    with caplog.at_level("INFO"):
        trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=2, logger=CSVLogger(tmp_path / "d"),
                            enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path / "d",
                            callbacks=[resumed])
        trainer.fit(VideoDiTModule(**TINY), datamodule=ShapesDataModule(),
                    ckpt_path=str(tmp_path / "ckpt" / "epoch=0-step=1.ckpt"))
    assert resumed.result.source == "checkpoint" and "(from checkpoint)" in caplog.text and "(from cache)" not in caplog.text
    doc = json.loads(next((tmp_path / "d").rglob("calibration.json")).read_text())
    assert doc["source"] == "checkpoint" and len(doc["verification"]["shapes"]) == 4


class SlowFirstStepModule(VideoDiTModule):
    """Its process's first training step spins FIRST_STEP_CPU_S of CPU time (the clock calibration reads on
    CPU), as a compiled model's first step traces and compiles."""

    FIRST_STEP_CPU_S = 0.4

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.stepped = False

    def training_step(self, batch, batch_idx):
        if not self.stepped:
            self.stepped = True
            start = time.process_time()
            while time.process_time() - start < self.FIRST_STEP_CPU_S:
                pass
        return super().training_step(batch, batch_idx)


def test_the_processs_first_step_is_counted_by_no_measurement_and_reported_apart(tmp_path, caplog):
    kwargs = dict(num_seq_lens=2, batch_sizes=[1, 2, 4], warmup=0, repeats=1, cache_path=str(tmp_path / "c.json"),
                  **TRUST_ANY)
    slow = SlowFirstStepModule.FIRST_STEP_CPU_S
    first = CostModelCalibration(**kwargs)
    _fit_dm(tmp_path / "a", SlowFirstStepModule(**TINY), [first], ShapesDataModule())
    doc = json.loads(next((tmp_path / "a").rglob("calibration.json")).read_text())
    # measured runs: in calibration, before the first grid point, which does not pay for it
    assert slow <= doc["first_step_seconds"] <= doc["seconds"]
    assert max(p["time_ms"] for p in doc["points"] if p["status"] == "ok") < 1e3 * slow
    assert max(p.get("cold_ms", 0.0) for p in doc["points"]) < 1e3 * slow
    # a cached run measures no grid point: its first step falls in verification, and no shape pays it
    cached = CostModelCalibration(**kwargs)
    with caplog.at_level("INFO"):
        _fit_dm(tmp_path / "b", SlowFirstStepModule(**TINY), [cached], ShapesDataModule())
    doc = json.loads(next((tmp_path / "b").rglob("calibration.json")).read_text())
    assert doc["source"] == "cache" and slow <= doc["first_step_seconds"] <= doc["verify_seconds"]
    assert all(m["cold_ms"] < 1e3 * slow for m in doc["verification"]["shapes"])
    assert f"the process's first (uncounted) step {doc['first_step_seconds']:.1f} s" in caplog.text


def test_compiled_regions_are_found_and_get_recompile_room(tmp_path):
    import torch._dynamo.config as dynamo_config

    module = VideoDiTModule(**TINY)
    assert compiled_submodules(module) == []
    module.dit.blocks[0].compile(backend="eager", dynamic=True)
    assert compiled_submodules(module) == ["dit.blocks.0"]
    # dynamo's own patch() restores its config: pytest's monkeypatch deletes entries of it on undo
    # (pytest 9.2), which breaks every later compile in the process
    with dynamo_config.patch(recompile_limit=8, accumulated_recompile_limit=20):
        assert raise_recompile_limit(30) == (8, 30 + RECOMPILE_SLACK)
        assert dynamo_config.recompile_limit == 38 and dynamo_config.accumulated_recompile_limit == 38
        assert raise_recompile_limit(1) == (38, 38)  # never lowered

    with dynamo_config.patch(recompile_limit=8):
        calib = CostModelCalibration(num_seq_lens=2, batch_sizes=[1, 2, 4], warmup=1, repeats=1,
                                     cache_path=str(tmp_path / "cache.json"), **TRUST_ANY)
        _fit_dm(tmp_path, module, [calib], ShapesDataModule())
    doc = json.loads((tmp_path / "logs" / "lightning_logs" / "version_0" / "calibration.json").read_text())
    # 6 grid points and two shapes per bucket (4 buckets) for each of the verify_rounds (3) re-plans,
    # the first plan and the safest fallback, plus the slack
    assert doc["compiled_regions"] == 1 and doc["recompile_limit"] == 6 + 2 * 4 * (3 + 2) + RECOMPILE_SLACK
    assert all(m["status"] == "fits" for m in doc["verification"]["shapes"])
    assert model_fingerprint(module) != model_fingerprint(VideoDiTModule(**TINY))



def test_a_compiled_models_shape_lines_say_which_guard_failed_when_it_compiled_again(tmp_path, caplog):
    """Blocks compiled as shipped (regional_compile.compile_blocks, dynamic): dynamo specializes a size
    of 1, so the first grid point with B = 2 compiles the blocks again and its calibration line names
    the failed guard (the batch size, expected 1); the B = 1 points before it, at two sequence lengths,
    compile nothing and are not marked, and marked lines number at most dynamo's recompile count."""
    import torch._dynamo
    import torch._dynamo.config as dynamo_config

    from lightning_adaptiveload.regional_compile import compile_blocks

    torch._dynamo.reset()
    module = VideoDiTModule(**TINY)
    compile_blocks(module.dit.blocks, "dynamic", backend="eager")
    with dynamo_config.patch(recompile_limit=8), caplog.at_level("INFO"):
        calib = CostModelCalibration(num_seq_lens=2, batch_sizes=[1, 2, 4], warmup=1, repeats=1,
                                     cache_path=str(tmp_path / "cache.json"), **TRUST_ANY)
        _fit_dm(tmp_path, module, [calib], ShapesDataModule())
    recompiles = read_dynamo_counts()["recompiles"]
    lines = [line for line in caplog.messages if line.startswith(("calibration ", "verify "))]
    marked = [line for line in lines if "; compiled again, guards failed: " in line]
    first_b2 = next(line for line in lines if line.startswith("calibration ") and " B=2 " in line)
    assert first_b2 in marked and re.search(r"size mismatch at index 0\. expected 1, actual 2", first_b2)
    assert all(" B=1 " in line for line in lines[:lines.index(first_b2)] if line.startswith("calibration "))
    assert not any(line in marked for line in lines[:lines.index(first_b2)])
    assert 1 <= len(marked) <= recompiles
    torch._dynamo.reset()


# ---------------------------------------------------------------- per-bucket checkpointing (docs/memory.md)

from lightning_adaptiveload.calibration.grid import predicted_depth_peak_bytes  # noqa: E402
from lightning_adaptiveload.calibration.memory import ASSUMED_STATES, optimizer_memory  # noqa: E402
from lightning_adaptiveload.callbacks.checkpointing import PerBucketCheckpointing  # noqa: E402
from lightning_adaptiveload.scheduling.depth_cost_model import DepthCostModel  # noqa: E402
from lightning_adaptiveload.scheduling.memory_model import MemoryModel  # noqa: E402
from examples.video_dit.model import DiTBlock  # noqa: E402
from lightning_adaptiveload.scheduling.shapes import TokenSpec  # noqa: E402

TWO_BLOCKS = {**TINY, "num_layers": 2}


def _state_bytes_after_a_step(optimizer, params):
    """Bytes of the state tensors torch creates in one real step, 0-d step counters left out."""
    for p in params:
        p.grad = torch.randn_like(p)
    optimizer.step()
    return sum(v.numel() * v.element_size() for st in optimizer.state.values() for v in st.values()
               if torch.is_tensor(v) and v.dim() > 0)


@pytest.mark.parametrize("make", [
    lambda ps: torch.optim.AdamW(ps, lr=1e-3),
    lambda ps: torch.optim.Adam(ps, lr=1e-3, amsgrad=True),
    lambda ps: torch.optim.SGD(ps, lr=0.1),
    lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
    lambda ps: torch.optim.RMSprop(ps, lr=1e-3, momentum=0.9, centered=True),
    lambda ps: torch.optim.RMSprop(ps, lr=1e-3),
    lambda ps: torch.optim.NAdam(ps), lambda ps: torch.optim.RAdam(ps), lambda ps: torch.optim.Adamax(ps),
    lambda ps: torch.optim.Adadelta(ps),
    # two groups with different options and dtypes: states follow each group and each parameter's dtype
    lambda ps: torch.optim.Adam([{"params": ps[:1], "amsgrad": True}, {"params": ps[1:]}], lr=1e-3),
])
def test_predicted_optimizer_state_equals_what_a_real_step_creates(make):
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(7, 5)), torch.nn.Parameter(torch.randn(11, dtype=torch.bfloat16)),
              torch.nn.Parameter(torch.randn(3, 2, 4, dtype=torch.float64))]
    optimizer = make(params)
    predicted = optimizer_memory([optimizer])
    assert "predicted" in predicted.rule
    assert predicted.param_bytes == 7 * 5 * 4 + 11 * 2 + 24 * 8
    after = _state_bytes_after_a_step(optimizer, params)
    assert predicted.state_bytes == after
    measured = optimizer_memory([optimizer])  # the state exists now: its bytes, step counters included
    if after:  # (plain SGD keeps no tensor)
        assert "measured" in measured.rule and after <= measured.state_bytes <= after + 8 * len(params)


def test_state_created_up_front_is_measured_and_an_unknown_optimizer_is_assumed_adam_like():
    params = [torch.nn.Parameter(torch.randn(6, 4))]
    adagrad = torch.optim.Adagrad(params)  # creates its state in __init__
    measured = optimizer_memory([adagrad])
    assert "measured" in measured.rule and measured.state_bytes >= 6 * 4 * 4

    class Custom(torch.optim.Optimizer):
        def __init__(self, ps):
            super().__init__(ps, {})

        def step(self, closure=None):
            pass

    custom = optimizer_memory([Custom(params), torch.optim.SGD(params, lr=0.1)])
    assert custom.state_bytes == ASSUMED_STATES * 6 * 4 * 4 and "Custom: unknown type" in custom.rule
    assert custom.param_bytes == 2 * 6 * 4 * 4
    assert custom.step_bytes == 2 * custom.param_bytes + custom.state_bytes + custom.param_bytes


def test_depth_points_extrapolate_by_their_extra_bytes_per_token():
    points = [{"batch_size": 1, "seq_len": 64, "checkpointed": 4, "status": "ok", "peak_bytes": 1000},
              {"batch_size": 1, "seq_len": 64, "checkpointed": 2, "status": "ok", "peak_bytes": 1640},
              {"batch_size": 1, "seq_len": 256, "checkpointed": 4, "status": "ok", "peak_bytes": 3000},
              {"batch_size": 2, "seq_len": 64, "checkpointed": 4, "status": "ok", "peak_bytes": 1500}]
    # 640 extra bytes over 64 tokens: 10 per token
    assert predicted_depth_peak_bytes(points, 1, 256, 2, 4) == pytest.approx(3000 + 10 * 256)
    assert predicted_depth_peak_bytes(points, 2, 64, 2, 4) == pytest.approx(1500 + 10 * 128)
    assert predicted_depth_peak_bytes(points, 4, 64, 2, 4) == 0.0  # not measured at k = 4 yet
    assert predicted_depth_peak_bytes(points[:1], 1, 64, 2, 4) == 0.0  # no pair yet
    # the B-extrapolation looks at one depth only
    assert predicted_peak_bytes(points, 4, 64, 4) == pytest.approx(1500 + 500 * 2)
    assert predicted_peak_bytes(points, 4, 64, 2) == 0.0


class DepthProbeModule(VideoDiTModule):
    """Records (B, S, blocks checkpointed) of every step, and can run out of memory (simulated) when
    fewer than all blocks are checkpointed at B * S >= `oom_tokens`."""

    oom_tokens = None

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.steps = []

    def training_step(self, batch, batch_idx):
        k = sum(b.__dict__["_adaptiveload_checkpointing"].checkpoint for b in self.dit.blocks)
        tokens = batch["latents"].shape[0] * batch["seq_len"]
        self.steps.append((batch["latents"].shape[0], batch["seq_len"], k))
        if self.oom_tokens is not None and k < len(self.dit.blocks) and tokens >= self.oom_tokens:
            raise torch.OutOfMemoryError("simulated: CUDA out of memory")
        return super().training_step(batch, batch_idx)


class PlanningDataModule(GridDataModule):
    """GridDataModule that takes a memory plan."""

    def set_memory_plan(self, cost_model, memory_model, device_memory_bytes, max_memory_fraction=0.85, plan_margin=0.0):
        self.memory_plan_calls = getattr(self, "memory_plan_calls", [])
        self.memory_plan_calls.append((cost_model, memory_model, device_memory_bytes, max_memory_fraction, plan_margin))


def test_with_per_bucket_checkpointing_points_run_at_two_depths_and_both_models_are_fitted(tmp_path, monkeypatch):
    torch.manual_seed(0)
    monkeypatch.setattr("lightning_adaptiveload.calibration.loop.device_memory_bytes", lambda device: 2**33)
    shared = {}
    calib = CostModelCalibration(num_seq_lens=3, batch_sizes=[1, 2, 4], warmup=0, repeats=1,
                                 cache_path=str(tmp_path / "cache.json"), **PLAN_ANY)
    switch_cb = PerBucketCheckpointing(block_classes=[DiTBlock])
    module = DepthProbeModule(**TWO_BLOCKS)
    dm = PlanningDataModule()
    trainer = _fit_dm(tmp_path, module, [switch_cb, StateProbe("before", shared), calib, StateProbe("after", shared)],
                      dm)
    assert shared.get("checked") and trainer.global_step == 1  # no trace, and training ran
    full = [p for p in calib.result.points if p["checkpointed"] == 2]
    half = [p for p in calib.result.points if p["checkpointed"] == 1]
    assert len(full) == 9 and all(p["status"] == "ok" for p in calib.result.points)
    # the points the fit needs (B = 1 at every S, then B = 2, 4 at the shortest S, then the next), written
    # out rather than built by required_points, which the callback calls
    required = [(1, 16), (1, 64), (1, 96), (2, 16), (4, 16), (2, 64), (4, 64)]
    assert [(p["batch_size"], p["seq_len"]) for p in half] == required  # the points the fit needs, again at k = 1
    # and at the lowest depth predicted to fit, k = 0 on this device (8 GiB, peaks of kilobytes): where the plan
    # picks most buckets' depth, interpolated rather than extrapolated
    low = [p for p in calib.result.points if p["checkpointed"] == 0]
    assert [(p["batch_size"], p["seq_len"]) for p in low] == required
    order = [(p["batch_size"], p["seq_len"], p["checkpointed"]) for p in calib.result.points]
    assert all(order.index((b, s, 2)) + 1 == order.index((b, s, 1)) == order.index((b, s, 0)) - 1 for b, s in required)
    # each point ran at its depth: every step of the grid recorded (B, S, k) of a recorded point
    recorded = {(p["batch_size"], p["seq_len"], p["checkpointed"]) for p in calib.result.points}
    assert set(module.steps[:-1]) == recorded  # (the last step is training's)
    # the cost model is fitted to the full-depth points, the models to all of them
    ref = CostModel.fit(*([p[k] for p in full] for k in ("batch_size", "seq_len", "time_ms")))
    assert calib.result.cost_model.params == pytest.approx(ref.params, rel=1e-9)
    ok = calib.result.points
    b, s, k, t, peak = ([p[key] for p in ok] for key in ("batch_size", "seq_len", "checkpointed", "time_ms",
                                                         "peak_bytes"))
    mem_ref = MemoryModel.fit(b, s, k, peak, 2)
    state = calib.result.memory.optimizer_memory.state_bytes
    # the optimizer's state (AdamW, primed by the probe: measured): 2 fp32 moments per parameter and the
    # 0-d step counters, added to m0
    moments = 2 * sum(p.numel() * 4 for p in module.parameters())
    assert "measured" in calib.result.memory.optimizer_memory.rule
    assert moments <= state <= moments + 4 * len(list(module.parameters()))
    assert calib.result.memory.memory_model.params["m0"] == pytest.approx(mem_ref.params["m0"] + state, rel=1e-9)
    assert {n: v for n, v in calib.result.memory.memory_model.params.items() if n != "m0"} == pytest.approx(
        {n: v for n, v in mem_ref.params.items() if n != "m0"}, rel=1e-9)
    depth_ref = DepthCostModel.fit(b, s, k, t, 2, base=ref)
    assert calib.result.memory.depth_cost_model.recompute_fraction == pytest.approx(depth_ref.recompute_fraction, rel=1e-9)
    # handed to the DataModule with the device memory and the budget fraction; m_mem left to it
    [(cm, m_mem)] = dm.cost_model_calls
    assert cm is calib.result.cost_model and m_mem is None
    [(depth, memory, device, fraction, margin)] = dm.memory_plan_calls
    assert depth is calib.result.memory.depth_cost_model and memory is calib.result.memory.memory_model
    assert device == 2**33 and fraction == 0.85 and margin == PLAN_MARGIN == 0.01 and calib.result.memory_plan_used
    log_dir = tmp_path / "logs" / "lightning_logs" / "version_0"
    doc = json.loads((log_dir / "calibration.json").read_text())
    assert doc["points"] == calib.result.points and doc["measurements"] == full and doc["depths"] == [2, 1]
    assert doc["memory_plan"]["used"] and doc["memory_plan"]["optimizer_memory"]["state_bytes"] == state
    assert MemoryModel.from_json(log_dir / "calibration_memory_model.json").params == pytest.approx(
        calib.result.memory.memory_model.params)
    assert DepthCostModel.from_json(log_dir / "calibration_depth_cost_model.json").recompute_fraction == \
        pytest.approx(calib.result.memory.depth_cost_model.recompute_fraction)
    key = json.loads((tmp_path / "cache.json").read_text())["key"]
    assert key["depths"] == [2, 1] and key["save_attention"] is True
    assert switch_cb.switch.checkpointed == 2  # left at every block
    # a block that recomputes its attention costs other time and memory: measured again, not read from the cache
    again = CostModelCalibration(num_seq_lens=3, batch_sizes=[1, 2, 4], warmup=0, repeats=1,
                                 cache_path=str(tmp_path / "cache.json"), **PLAN_ANY)
    _fit_dm(tmp_path / "again", DepthProbeModule(**TWO_BLOCKS),
            [PerBucketCheckpointing(block_classes=[DiTBlock], save_attention=False), again], PlanningDataModule())
    assert again.result.source == "measured"
    assert json.loads((tmp_path / "cache.json").read_text())["key"]["save_attention"] is False


def test_an_out_of_memory_second_depth_is_recorded_and_does_not_prune_full_depth_points(tmp_path, monkeypatch):
    monkeypatch.setattr(DepthProbeModule, "oom_tokens", 64)
    calib = CostModelCalibration(num_seq_lens=3, batch_sizes=[1, 2, 4], warmup=0, repeats=1,
                                 cache_path=str(tmp_path / "cache.json"), **PLAN_ANY)
    dm = PlanningDataModule()
    _fit_dm(tmp_path, DepthProbeModule(**TWO_BLOCKS), [PerBucketCheckpointing(block_classes=[DiTBlock]), calib], dm)
    status = {(p["batch_size"], p["seq_len"], p["checkpointed"]): p["status"] for p in calib.result.points}
    assert status[(1, 64, 1)] == "oom" and status[(1, 96, 1)] == "skipped_oom"  # dominated at the same depth
    assert status[(4, 16, 1)] == "oom" and status[(2, 16, 1)] == "ok"
    assert all(st == "ok" for (b, s, k), st in status.items() if k == 2)  # every full-depth point ran
    assert calib.result.m_mem is None  # only full-depth points say what fits
    # AdamW before its first step: its two fp32 moments per parameter are predicted
    module_params = sum(p.numel() for p in DepthProbeModule(**TWO_BLOCKS).parameters())
    assert calib.result.memory.optimizer_memory.state_bytes == 2 * 4 * module_params
    assert calib.result.memory.optimizer_memory.rule == "AdamW: predicted from its type"
    assert calib.result.memory.memory_model is not None and dm.memory_plan_calls  # still two depths to fit on


def test_a_memory_fit_that_fails_falls_back_to_every_block_checkpointed(tmp_path, monkeypatch):
    def failing_fit(*args, **kwargs):
        raise RuntimeError("singular")

    monkeypatch.setattr(MemoryModel, "fit", failing_fit)
    calib = CostModelCalibration(num_seq_lens=2, batch_sizes=[1, 2, 4], warmup=0, repeats=1,
                                 cache_path=str(tmp_path / "cache.json"), **PLAN_ANY)
    dm = PlanningDataModule()
    with pytest.warns(UserWarning, match=r"no memory plan \(cannot fit the memory .*singular\)\); every step checkpoints "
                                         r"all 2 blocks"):
        trainer = _fit_dm(tmp_path, DepthProbeModule(**TWO_BLOCKS),
                          [PerBucketCheckpointing(block_classes=[DiTBlock]), calib], dm)
    assert calib.result.trusted and calib.result.memory.memory_model is None and not calib.result.memory_plan_used
    assert not hasattr(dm, "memory_plan_calls") and dm.cost_model_calls == [(calib.result.cost_model, None)]
    assert trainer.global_step == 1
    doc = json.loads((tmp_path / "logs" / "lightning_logs" / "version_0" / "calibration.json").read_text())
    assert doc["memory_plan"]["used"] is False and "singular" in doc["memory_plan"]["distrust_reasons"][0]


def test_a_datamodule_without_set_memory_plan_keeps_every_block_checkpointed(tmp_path):
    calib = CostModelCalibration(num_seq_lens=2, batch_sizes=[1, 2, 4], warmup=0, repeats=1,
                                 cache_path=str(tmp_path / "cache.json"), **PLAN_ANY)
    with pytest.warns(UserWarning, match="GridDataModule has no set_memory_plan"):
        _fit_dm(tmp_path, DepthProbeModule(**TWO_BLOCKS), [PerBucketCheckpointing(block_classes=[DiTBlock]), calib],
                GridDataModule())
    assert calib.result.memory.memory_model is not None and not calib.result.memory_plan_used


class DepthShapesDataModule(ShapesDataModule, PlanningDataModule):
    """Scheduled shapes with their depth (ScheduledShape's fourth field), as under a memory plan."""

    SCHEDULED = [(4, (1, 8, 8), 3, 0), (2, (3, 8, 8), 9, 1), (1, (2, 16, 12), 5, 2), (2, (1, 16, 16), 1, None)]
    spec = TokenSpec()  # patch (1, 2, 2): the token counts of SHAPES


def test_verification_runs_each_shape_at_its_depth_and_records_the_models_predictions(tmp_path):
    module = DepthProbeModule(**TWO_BLOCKS)
    calib = CostModelCalibration(num_seq_lens=2, batch_sizes=[1, 2, 4], warmup=0, repeats=1,
                                 cache_path=str(tmp_path / "cache.json"), **PLAN_ANY)
    _fit_dm(tmp_path, module, [PerBucketCheckpointing(block_classes=[DiTBlock]), calib], DepthShapesDataModule())
    tokens = {thw: s for s, thw in SHAPES.items()}
    # most tokens first, ties fewer blocks checkpointed first (no depth: every block)
    expected = sorted(DepthShapesDataModule.SCHEDULED,
                      key=lambda x: (-x[0] * tokens[x[1]], 2 if x[3] is None else x[3], -tokens[x[1]]))
    shapes = calib.result.verification.verification.shapes
    assert [m.checkpointed for m in shapes] == [k for *_, k in expected] == [None, 1, 2, 0]
    # verification's steps (cold and warm, before the one training step), at each shape's depth; no
    # depth: every block
    assert module.steps[-1 - 2 * len(expected):-1] == [(b, tokens[thw], 2 if k is None else k)
                                                       for b, thw, _, k in expected for _ in range(2)]
    memory = calib.result.memory
    for m, (b, thw, _, k) in zip(shapes, expected):
        depth = 2 if k is None else k
        assert m.predicted_ms == pytest.approx(memory.depth_cost_model.predict(b, tokens[thw], depth))
        assert m.predicted_peak_bytes == pytest.approx(memory.memory_model.predict(b, tokens[thw], depth))


def test_per_bucket_checkpointing_listed_after_calibration_or_reading_another_key_is_refused(tmp_path):
    calib = CostModelCalibration(num_seq_lens=2, batch_sizes=[1, 2], warmup=0, repeats=1,
                                 cache_path=str(tmp_path / "cache.json"))

    class LateBuild(VideoDiTModule):  # built in configure_model: PerBucketCheckpointing wraps in on_fit_start
        def __init__(self):
            super().__init__(**TWO_BLOCKS, build_in_configure_model=True)

    with pytest.raises(ValueError, match="list it before CostModelCalibration"):
        _fit_dm(tmp_path / "a", LateBuild(), [calib, PerBucketCheckpointing(block_classes=[DiTBlock])],
                GridDataModule())
    with pytest.raises(ValueError, match="reads batch\\['depth'\\]"):
        _fit_dm(tmp_path / "b", VideoDiTModule(**TWO_BLOCKS),
                [PerBucketCheckpointing(block_classes=[DiTBlock], batch_key="depth"), calib], GridDataModule())


def test_an_untrusted_cost_model_keeps_every_block_checkpointed_and_says_why(tmp_path, monkeypatch):
    monkeypatch.setattr(StepRunner, "step", lambda self, batch: 5.0)  # flat: never trusted
    calib = CostModelCalibration(num_seq_lens=2, batch_sizes=[1, 2, 4], warmup=0, repeats=1,
                                 cache_path=str(tmp_path / "cache.json"), verify=False)
    dm = PlanningDataModule()
    with pytest.warns(UserWarning, match="falls back to the token_equal policy .* every block checkpointed"):
        _fit_dm(tmp_path, DepthProbeModule(**TWO_BLOCKS), [PerBucketCheckpointing(block_classes=[DiTBlock]), calib],
                dm)
    assert dm.cost_model_calls == [(None, None, "token_equal")] and not hasattr(dm, "memory_plan_calls")
    assert not calib.result.memory_plan_used and calib.result.memory.distrust_reasons[0] == "the cost model is not trusted"


def test_a_given_cost_model_is_used_as_is_and_the_shapes_are_still_verified(tmp_path):
    first = CostModelCalibration(num_seq_lens=2, batch_sizes=[1, 2, 4], warmup=0, repeats=1,
                                 cache_path=str(tmp_path / "a.json"), **PLAN_ANY)
    _fit_dm(tmp_path / "a", VideoDiTModule(**TINY), [first], ShapesDataModule())
    saved = tmp_path / "a" / "logs" / "lightning_logs" / "version_0" / "calibration_cost_model.json"
    CountingModule.steps = 0
    given = CostModelCalibration(cost_model_path=str(saved), m_mem=300, cache_path=str(tmp_path / "b.json"))
    dm = ShapesDataModule()
    _fit_dm(tmp_path / "b", CountingModule(**TINY), [given], dm)
    [(cm, m_mem)] = dm.cost_model_calls
    assert given.result.source == "given" and given.result.trusted and given.result.points == [] and m_mem == 300
    assert cm.params == pytest.approx(first.result.cost_model.params, rel=1e-12) and cm.form == first.result.cost_model.form
    # no benchmark: the runner's uncounted first step, two verification steps per scheduled shape (cold, warm)
    # and the one training step
    assert CountingModule.steps == 1 + 2 * len(ShapesDataModule.SCHEDULED) + 1
    assert not (tmp_path / "b.json").exists()  # nothing measured, nothing cached


def test_points_predicted_over_the_devices_memory_are_not_run(tmp_path, monkeypatch):
    """The grid's memory forecast (calibration.grid.predicted_peak_bytes: linear in B through the two
    largest measured B at that S) against max_memory_fraction of a device patched small: the point
    predicted over it is recorded predicted_oom without a step, the larger one after it skipped_oom."""
    kwargs = dict(num_seq_lens=2, batch_sizes=[1, 2, 4, 8], warmup=0, repeats=1, verify=False, **TRUST_ANY)
    big = CostModelCalibration(cache_path=str(tmp_path / "a.json"), **kwargs)
    _fit(tmp_path / "a", VideoDiTModule(**TINY), [big])
    peak = {p["batch_size"]: p["peak_bytes"] for p in big.result.points if p["seq_len"] == 16}
    forecast_4 = peak[2] + (peak[2] - peak[1]) * (4 - 2)
    assert forecast_4 > peak[2]
    device = (peak[2] + forecast_4) / 2 / 0.85  # the budget falls between B = 2 and the forecast of B = 4
    monkeypatch.setattr("lightning_adaptiveload.calibration.loop.device_memory_bytes", lambda d: device)
    seen = []
    real_step = StepRunner.step
    monkeypatch.setattr(StepRunner, "step", lambda self, batch: seen.append(
        (batch["latents"].shape[0], batch["seq_len"])) or real_step(self, batch))
    small = CostModelCalibration(cache_path=str(tmp_path / "b.json"), **kwargs)
    _fit(tmp_path / "b", VideoDiTModule(**TINY), [small])
    status = {(p["batch_size"], p["seq_len"]): p["status"] for p in small.result.points}
    assert status[(1, 16)] == status[(2, 16)] == "ok"
    assert status[(4, 16)] == "predicted_oom" and status[(8, 16)] == "skipped_oom"
    assert (4, 16) not in seen and (8, 16) not in seen
    assert small.result.m_mem == math.floor(0.9 * max(b * s for (b, s), st in status.items() if st == "ok"))


def test_a_distrusted_memory_model_is_judged_by_its_own_threshold(tmp_path, monkeypatch):
    """The time fit's check is off (max_heldout_error inf); the memory model's own (default 10%) still
    refuses a memory model that predicts its held-out peaks 20% off: no memory plan, every block
    checkpointed."""
    real_fit = MemoryModel.fit

    def loose_fit(*args, **kwargs):
        model = real_fit(*args, **kwargs)
        return MemoryModel(model.form, model.params, model.num_blocks,
                           {**model.quality, "heldout_mean_rel_err": 0.2})

    monkeypatch.setattr(MemoryModel, "fit", loose_fit)
    calib = CostModelCalibration(num_seq_lens=2, batch_sizes=[1, 2, 4], warmup=0, repeats=1, verify=False,
                                 cache_path=str(tmp_path / "cache.json"), **TRUST_ANY)
    assert calib.config.max_memory_heldout_error == 0.1 and calib.config.max_heldout_error == float("inf")
    dm = PlanningDataModule()
    with pytest.warns(UserWarning, match=r"no memory plan \(memory model held-out mean error 20.0% > 10%\)"):
        _fit_dm(tmp_path, DepthProbeModule(**TWO_BLOCKS), [PerBucketCheckpointing(block_classes=[DiTBlock]), calib],
                dm)
    assert calib.result.trusted and not calib.result.memory_plan_used and not hasattr(dm, "memory_plan_calls")


@pytest.mark.parametrize("bad", [-0.01, 1.0, 1.5, float("nan"), "0.01", True])
def test_a_plan_margin_outside_zero_to_one_is_refused_by_name(bad):
    with pytest.raises(ValueError, match="CostModelCalibration: plan_margin"):
        CostModelCalibration(plan_margin=bad)
    assert CostModelCalibration(plan_margin=0.0).config.plan_margin == 0.0

"""A settled plan is cached with its verification, and a later run with the same key checks each of its
shapes once instead of running the rounds again (issue 28, item 6). End to end on CPU: the tiny DiT,
PerBucketCheckpointing, CostModelCalibration and the AdaptiveLoadDataModule with a memory plan; the
longest bucket is made to hold more memory than the budget whenever it keeps some blocks' activations
(a patched measurement of verification's shapes), so one re-plan round is not enough and it settles."""
import json

import lightning as L
import pytest
import torch

from examples.video_dit.model import DiTBlock
from examples.video_dit.module import VideoDiTModule
from lightning_adaptiveload.calibration.loop import _DataModulePlan
from lightning_adaptiveload.calibration.verify import RECHECK_MARGIN
from lightning_adaptiveload.callbacks import CostModelCalibration, PerBucketCheckpointing
from lightning_adaptiveload.data.datamodule import AdaptiveLoadDataModule
from lightning_adaptiveload.scheduling.verification import held_bytes
from tests.helpers.data import C, D_TEXT, L_TEXT, write_dataset

pytestmark = pytest.mark.usefixtures("one_thread")

MODEL = dict(in_channels=C, dim=32, num_layers=3, num_heads=2, ffn_dim=64, text_dim=D_TEXT, freq_dim=16)
LONG = (5, 8, 8)  # the longest latent of tests.helpers.data's dataset
DEVICE = 2**40
BUDGET = 0.85 * DEVICE  # CostModelCalibration's default max_memory_fraction
TRUST_ANY = dict(max_heldout_error=float("inf"), min_work_correlation=-1.0, max_memory_heldout_error=float("inf"))


def _fit(root, tmp, monkeypatch, calls):
    real_measure = _DataModulePlan.measure

    def measure(self, shape, warm=True):
        calls.append((shape.batch_size, tuple(shape.latent_shape), shape.checkpointed, warm))
        out = real_measure(self, shape, warm)
        if tuple(shape.latent_shape) == LONG and shape.checkpointed is not None and shape.checkpointed < 3 \
                and out["status"] == "ok":
            out = {**out, "reserved_bytes": 2**50}  # far over the budget: only k = L fits
        elif tuple(shape.latent_shape) == LONG and out["status"] == "ok":
            out = {**out, "reserved_bytes": 0.95 * BUDGET}  # fits, within RECHECK_MARGIN of the budget
        return out

    monkeypatch.setattr(_DataModulePlan, "measure", measure)
    monkeypatch.setattr("lightning_adaptiveload.calibration.loop.device_memory_bytes", lambda device: DEVICE)
    torch.manual_seed(0)
    dm = AdaptiveLoadDataModule(shards=str(root), index=str(root / "index.jsonl"), policy="balanced", m_mem=40,
                                latent_channels=C, text_len=L_TEXT, text_dim=D_TEXT, num_workers=0, seed=3,
                                memory_planning=True)
    calib = CostModelCalibration(num_seq_lens=3, batch_sizes=[1, 2, 4, 8], warmup=0, repeats=1, verify_rounds=1,
                                 cache_path=str(root / "calibration_cache.json"), **TRUST_ANY)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_epochs=0, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp,
                        use_distributed_sampler=False,
                        callbacks=[PerBucketCheckpointing(block_classes=[DiTBlock]), calib])
    trainer.fit(VideoDiTModule(**MODEL), datamodule=dm)
    return calib.result


def test_a_settled_plan_is_cached_and_a_later_run_checks_each_shape_near_the_budget_once(tmp_path, monkeypatch):
    root = tmp_path / "data"
    write_dataset(root, n=90)
    first_calls, second_calls = [], []
    with pytest.warns(UserWarning, match="settled on their safest measured batch"):
        first = _fit(root, tmp_path / "a", monkeypatch, first_calls)
    outcome = first.verification
    assert first.source == "measured" and outcome.settled and not outcome.unresolved
    assert first.cacheable and (root / "calibration_cache.json").exists()
    long_limits = [limit for s, limit in outcome.verification.limits.items()
                   if any(m.seq_len == s and m.latent_shape == LONG for m in outcome.verification.shapes)]
    assert long_limits and all(limit.pinned is not None and limit.pinned[1] == 3 for limit in long_limits)
    assert any(not m.fits for m in outcome.verification.shapes)  # round 1 found the over-budget shape

    second = _fit(root, tmp_path / "b", monkeypatch, second_calls)
    assert second.source == "cache"
    again = second.verification
    assert again.converged and not again.settled and not again.unresolved
    # every shape the second run measured, it measured once: a cold step (warm=False), and a warm one
    # right after only when the first run never ran it (a partial batch left cold); of the recorded ones
    # that fit, those that held within RECHECK_MARGIN of the budget in the cold step alone, the others
    # not at all (a shape held that far under the budget is taken as recorded)
    keys = [call[:3] for call in second_calls if not call[3]]
    assert len(keys) == len(set(keys)) > 0
    recorded = {(m.batch_size, m.latent_shape, m.checkpointed) for m in outcome.verification.shapes if m.fits}
    near = {(m.batch_size, m.latent_shape, m.checkpointed) for m in outcome.verification.shapes
            if m.fits and held_bytes(m.peak_bytes, m.reserved_bytes) >= (1 - RECHECK_MARGIN) * BUDGET}
    assert near and near < recorded
    warm = [call[:3] for call in second_calls if call[3]]
    assert all(second_calls[i - 1] == (*call[:3], False) for i, call in enumerate(second_calls) if call[3])
    assert set(warm) == set(keys) - recorded and len(warm) == len(set(warm))
    assert recorded & set(keys) == near  # the shapes near the budget were checked, not taken on trust
    now = {(m.batch_size, m.latent_shape, m.checkpointed): m for m in again.verification.shapes}
    assert all(now[key].fits for key in keys)  # nothing the second run measured needed a re-plan
    # nothing planned again: every bucket keeps its choice and its failures (a re-measured shape may
    # move a bucket's activation scale a little; a partial batch run now adds a fit)
    pins = lambda v: {s: (lim.pinned, lim.failed) for s, lim in v.limits.items()}  # noqa: E731
    assert pins(again.verification) == pins(outcome.verification)
    assert len(second_calls) < len(first_calls)


def test_a_run_stopped_in_verification_leaves_its_points_and_the_next_run_verifies_them(tmp_path, monkeypatch):
    """The measured, trusted points are cached before verification starts: a run stopped there (a time
    limit, a preemption) costs the next run its verification only, not the grid again."""
    root = tmp_path / "data"
    write_dataset(root, n=90)

    def stopped(self, shape, warm=True):
        raise RuntimeError("stopped in verification")  # stands for a time limit or a preemption

    with monkeypatch.context() as patch:
        patch.setattr(_DataModulePlan, "measure", stopped)
        with pytest.raises(RuntimeError, match="stopped in verification"):
            _fit(root, tmp_path / "a", patch, [])
    cached = json.loads((root / "calibration_cache.json").read_text())
    measured = [p for p in cached["points"] if p["status"] == "ok"]
    assert cached["source"] == "measured" and cached["trusted"] and cached["verification"] is None
    assert len(measured) >= 3 and all(p["time_ms"] > 0 and p["cold_ms"] > 0 for p in measured)

    calls = []
    with pytest.warns(UserWarning, match="settled on their safest measured batch"):
        second = _fit(root, tmp_path / "b", monkeypatch, calls)
    assert second.source == "cache" and second.points == cached["points"]
    assert calls and second.verification is not None and not second.verification.unresolved
    assert json.loads((root / "calibration_cache.json").read_text())["verification"] is not None

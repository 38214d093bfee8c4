"""AttentionBackends under Lightning on the CPU: each training batch's forward and backward run the kernel
the plan names for its seq_len (profiled aten ops), torch's own choice where the plan names none or there is
no plan yet, the plan set later by calibration or read from JSON, and a batch without seq_len refused."""
from __future__ import annotations

import logging
from collections import Counter

import lightning as L
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.strategies import SingleDeviceStrategy

from lightning_adaptiveload.attention import (AttentionPlan, BackendResult, BucketAttention, backends_run, choose,
                                              record_sdpa_calls)
from lightning_adaptiveload.attention.backends import active_backend
from lightning_adaptiveload.callbacks import AttentionBackends
from lightning_adaptiveload.callbacks.attention import TORCH_CHOICE
from tests.attention.test_choose import wrong_fa3  # noqa: F401 (a fixture: a fast, wrong external backend)


class AttentionModule(L.LightningModule):
    """One attention layer; records which kernel ran in each step's forward and backward."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(8, 3 * 8)
        self.forward_ran, self.backward_ran, self.active = [], [], []

    def training_step(self, batch, batch_idx):
        q, k, v = self.proj(batch["x"]).unflatten(-1, (3, 2, 4)).permute(2, 0, 3, 1, 4)  # (B, h, S, d) views
        ran = {}
        self.forward_ran.append(backends_run(lambda: ran.setdefault("out", F.scaled_dot_product_attention(q, k, v))))
        self.active.append(active_backend())
        return ran["out"].square().mean()

    def backward(self, loss, *args, **kwargs):
        self.backward_ran.append(backends_run(lambda: loss.backward()))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def batches(seq_lens):
    g = torch.Generator().manual_seed(0)
    return [{"x": torch.randn(2, s, 8, generator=g), "seq_len": s} for s in seq_lens]


def plan_of(choices: dict) -> AttentionPlan:
    return AttentionPlan.of([BucketAttention(s, 2, name, "flash", (BackendResult(name, 1.0),) if name else ())
                             for s, name in choices.items()])


def fit(callback, seq_lens, extra_callbacks=()):
    module = AttentionModule()
    trainer = L.Trainer(accelerator="cpu", devices=1, max_epochs=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[callback, *extra_callbacks])
    trainer.fit(module, torch.utils.data.DataLoader(batches(seq_lens), batch_size=None))
    return module


SEQ_LENS = [4, 6, 4, 9, 6]


def test_each_batch_runs_its_buckets_kernel_forward_and_backward():
    callback = AttentionBackends(plan_of({4: "math", 6: "flash", 9: None}), strict=True)
    module = fit(callback, SEQ_LENS)
    expected = [{"math"}, {"flash"}, {"math"}, {"flash"}, {"flash"}]  # 9: torch's own choice (flash on the CPU)
    assert module.forward_ran == expected
    assert module.backward_ran == expected
    assert [a is None for a in module.active] == [False, False, False, True, False]
    assert callback.counts == {"math": 2, "flash": 2, TORCH_CHOICE: 1}
    assert active_backend() is None  # left after the last batch


class SetPlanAtFitStart(L.Callback):
    """What calibration does: hand the plan over once fit has started."""

    def __init__(self, target: AttentionBackends, plan: AttentionPlan):
        self.target, self.plan = target, plan

    def on_fit_start(self, trainer, pl_module):
        self.target.set_plan(self.plan)


def test_plan_set_by_calibration_and_read_from_json(tmp_path):
    callback = AttentionBackends(strict=True)  # no plan yet: torch's own choice
    module = fit(callback, [4, 6], [SetPlanAtFitStart(callback, plan_of({4: "math"}))])
    assert module.forward_ran == [{"math"}, {"flash"}]
    plan_of({6: "math"}).to_json(tmp_path / "attention_plan.json")
    module = fit(AttentionBackends(str(tmp_path / "attention_plan.json"), strict=True), [4, 6])
    assert module.forward_ran == [{"flash"}, {"math"}]


def test_without_a_plan_nothing_changes_and_a_batch_without_seq_len_is_refused():
    module = fit(AttentionBackends(), [4, 6])
    assert module.forward_ran == [{"flash"}, {"flash"}] and module.active == [None, None]
    callback = AttentionBackends(plan_of({4: "math"}))
    with pytest.raises(ValueError, match=r"needs batch\['seq_len'\]"):
        callback.backend_of({"x": torch.zeros(1)})
    with pytest.raises(ValueError, match="must be an AttentionPlan"):
        AttentionBackends(plan={4: "math"})


# -- plan="measure": measured at fit start on the tiny example DiT ------------------------------------------

TINY = dict(in_channels=4, dim=32, num_layers=2, num_heads=2, ffn_dim=64, text_dim=16, freq_dim=16)
TEXT_LEN = 3
LATENTS = {16: (1, 8, 8), 48: (3, 8, 8), 96: (2, 16, 12)}  # tokens (patch 1x2x2) -> latent (T, H, W)


class BucketDataModule(L.LightningDataModule):
    """What plan="measure" reads: a real BucketTable (token-equal batch sizes at m_mem 96 tokens: B = 6, 2, 1)
    and batches shaped like AdaptiveLoadDataModule's."""

    def __init__(self, train_seq_lens=(16, 96, 48, 16)):
        super().__init__()
        self.train_seq_lens = list(train_seq_lens)

    def bucket_table(self):
        from lightning_adaptiveload.scheduling.buckets import BucketTable

        tokens = sorted(LATENTS)
        return BucketTable.build(tokens, [10] * len(tokens), [LATENTS[s] for s in tokens], policy="token_equal",
                                 m_mem=96)

    def synthetic_batch(self, seq_len, batch_size):
        g = torch.Generator().manual_seed(seq_len * 1000 + batch_size)
        return {"latents": torch.randn(batch_size, 4, *LATENTS[seq_len], generator=g),
                "text": torch.randn(batch_size, TEXT_LEN, 16, generator=g), "seq_len": seq_len}

    def train_dataloader(self):
        batch_size = {r["seq_len"]: r["batch_size"] for r in self.bucket_table().rows()}
        return torch.utils.data.DataLoader([self.synthetic_batch(s, batch_size[s]) for s in self.train_seq_lens],
                                           batch_size=None)


def fit_measured(tmp_path, callback, datamodule=None):
    """Fit the tiny DiT in bf16 autocast (the external stand-in takes bf16 only), one epoch."""
    from examples.video_dit.module import VideoDiTModule
    from lightning.pytorch.loggers import CSVLogger

    torch.manual_seed(0)
    module = VideoDiTModule(**TINY)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_epochs=1, precision="bf16-mixed",
                        logger=CSVLogger(tmp_path / "logs"),
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        default_root_dir=tmp_path, callbacks=[callback])
    trainer.fit(module, datamodule=datamodule or BucketDataModule())
    return trainer, module


def direct_calls(module, seq_len, batch_size):
    """The bucket's calls recorded from its own batch (what the template must reproduce)."""
    batch = BucketDataModule().synthetic_batch(seq_len, batch_size)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        return record_sdpa_calls(lambda: module.dit(batch["latents"], torch.rand(batch_size), batch["text"]))


@pytest.fixture
def fake_timing(monkeypatch):
    """choose.time_calls replaced: a random ms per (backend, bucket), fa3 always fastest; every call list it
    was handed, by (backend, seq_len)."""
    rng = np.random.default_rng(7)
    ms = {(name, s): float(rng.uniform(1, 10)) for name in ("flash", "math") for s in LATENTS}
    ms |= {("fa3", s): 0.5 * min(ms["flash", s], ms["math", s]) for s in LATENTS}
    seen = {}

    def time_calls(calls, backend, device="cuda", warmup=2, repeats=5):
        seq_len = calls[0].q_shape[-2]
        seen[backend, seq_len] = list(calls)
        return BackendResult(backend, ms[backend, seq_len])

    monkeypatch.setattr(choose, "time_calls", time_calls)
    return ms, seen


def test_measure_picks_the_fastest_correct_backend_and_writes_the_plan(tmp_path, fake_timing, wrong_fa3):
    ms, seen = fake_timing
    callback = AttentionBackends("measure", backends=["flash", "math", "fa3"], strict=True)
    trainer, module = fit_measured(tmp_path, callback)
    batch_size = {r["seq_len"]: r["batch_size"] for r in BucketDataModule().bucket_table().rows()}
    assert batch_size == {16: 6, 48: 2, 96: 1}
    expected = {s: min(("flash", "math"), key=lambda n: ms[n, s]) for s in LATENTS}  # fa3 is fastest but wrong
    plan = callback.plan
    assert {s: plan.backend_for(s) for s in LATENTS} == expected
    for s, bucket in plan.buckets.items():
        assert bucket.batch_size == batch_size[s]
        assert {r.backend: r.ms for r in bucket.results} == {n: ms[n, s] for n in ("flash", "math", "fa3")}
        assert "relative error over tolerance" in bucket.result("fa3").error
        # the calls timed are those of the bucket's own batch (2 blocks: each call twice per forward)
        direct = direct_calls(module, s, batch_size[s])
        assert [c.count for c in direct] == [TINY["num_layers"]] * 2
        for name in ("flash", "math", "fa3"):
            assert seen[name, s] == direct
    written = AttentionPlan.from_json(tmp_path / "logs" / "lightning_logs" / "version_0" / "attention_plan.json")
    assert written.to_dict() == plan.to_dict()
    assert callback.counts == Counter(expected[s] for s in BucketDataModule().train_seq_lens)


def test_measure_on_the_cpu_says_there_is_nothing_to_choose(tmp_path, fake_timing, caplog):
    _, seen = fake_timing
    callback = AttentionBackends("measure")
    with caplog.at_level(logging.INFO):
        fit_measured(tmp_path, callback)
    assert "nothing to choose on cpu (candidate backends: ['flash'])" in caplog.text
    assert callback.plan is None and not seen
    assert callback.counts == {TORCH_CHOICE: len(BucketDataModule().train_seq_lens)}
    assert not list(tmp_path.rglob("attention_plan.json"))


def test_measure_uses_rank_zeros_plan(tmp_path, fake_timing, monkeypatch):
    """On another rank nothing is timed or written: the plan is what rank 0 broadcast."""
    _, seen = fake_timing
    rank_zero = plan_of({16: "math", 48: "flash", 96: "math"})
    broadcasts = []

    def broadcast(self, obj, src=0):
        broadcasts.append(obj)
        return obj if not isinstance(obj, tuple) else (rank_zero.to_dict(), None)

    monkeypatch.setattr(L.Trainer, "is_global_zero", property(lambda self: False))
    monkeypatch.setattr(SingleDeviceStrategy, "broadcast", broadcast)
    callback = AttentionBackends("measure", backends=["flash", "math"], strict=True)
    fit_measured(tmp_path, callback)
    assert (None, None) in broadcasts and not seen
    assert callback.plan.to_dict() == rank_zero.to_dict()
    assert not list(tmp_path.rglob("attention_plan.json"))
    assert callback.counts == {"math": 3, "flash": 1}


def test_measure_errors(tmp_path, monkeypatch):
    class NoBuckets(L.LightningDataModule):
        def train_dataloader(self):
            return torch.utils.data.DataLoader([{"x": torch.zeros(1)}], batch_size=None)

    with pytest.raises(TypeError, match=r"needs a datamodule with bucket_table\(\) and synthetic_batch\(\)"):
        fit_measured(tmp_path, AttentionBackends("measure", backends=["flash", "math"]), NoBuckets())

    def failing(*args, **kwargs):
        raise RuntimeError("simulated kernel failure")

    monkeypatch.setattr(choose, "time_calls", failing)
    with pytest.raises(RuntimeError, match="rank 0 failed to measure the backends: RuntimeError: simulated"):
        fit_measured(tmp_path, AttentionBackends("measure", backends=["flash", "math"]))
    with pytest.raises(ValueError, match="unknown attention backend 'flsh'"):
        AttentionBackends("measure", backends=["flsh"])


@pytest.mark.cuda
def test_measure_on_a_gpu_chooses_among_torchs_kernels(tmp_path):
    """The real thing on one GPU (bf16): every bucket measured with flash, efficient and cudnn, each chosen
    backend the fastest of those that ran within tolerance, the plan applied to the training batches."""
    from examples.video_dit.module import VideoDiTModule

    torch.manual_seed(0)
    callback = AttentionBackends("measure", backends=["flash", "efficient", "cudnn"], repeats=3)
    trainer = L.Trainer(accelerator="gpu", devices=1, max_epochs=1, precision="bf16-mixed", logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        default_root_dir=tmp_path, callbacks=[callback])
    trainer.fit(VideoDiTModule(**TINY), datamodule=BucketDataModule())
    plan = callback.plan
    assert sorted(plan.buckets) == sorted(LATENTS)
    for bucket in plan.buckets.values():
        good = [r for r in bucket.results if r.usable and r.checked]
        assert good, bucket
        assert bucket.backend == min(good, key=lambda r: r.ms).backend
    assert AttentionPlan.from_json(tmp_path / "attention_plan.json").to_dict() == plan.to_dict()
    assert sum(callback.counts.values()) == len(BucketDataModule().train_seq_lens)

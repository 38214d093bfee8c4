"""AttentionBackends under Lightning on the CPU: each training batch's forward and backward run the kernel
the plan names for its seq_len (profiled aten ops), torch's own choice where the plan names none or there is
no plan yet, the plan set later by calibration or read from JSON, and a batch without seq_len refused."""
from __future__ import annotations

import lightning as L
import pytest
import torch
import torch.nn.functional as F

from lightning_adaptiveload.attention import AttentionPlan, BackendResult, BucketAttention, backends_run
from lightning_adaptiveload.attention.backends import active_backend
from lightning_adaptiveload.callbacks import AttentionBackends
from lightning_adaptiveload.callbacks.attention import TORCH_CHOICE


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

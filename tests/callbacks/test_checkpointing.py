"""PerBucketCheckpointing on a LightningModule written without this package (tests/callbacks/checkpointing_module.py):
per-step depths from the batch, numerics equal to training without checkpointing, taking over the strategy's
activation_checkpointing_policy, models built in configure_model, refusal of later forward patches, 2-process
DDP with a different depth per rank, and (CUDA) Lightning FSDP."""
from __future__ import annotations

import json
import subprocess
import sys
import types
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.strategies import DDPStrategy, FSDPStrategy

from lightning_adaptiveload.callbacks import PerBucketCheckpointing
from lightning_adaptiveload.callbacks.checkpointing import take_over_strategy_checkpointing
from tests.callbacks.checkpointing_module import DEPTH, CallRecorder, ToyModule, batches
from tests.checkpointing.toy import ToyBlock

TESTS = Path(__file__).resolve().parent
DEPTHS = [0, 3, None, DEPTH, 1, 2]


def fit(callbacks: list, depths=DEPTHS, module: ToyModule | None = None) -> tuple[ToyModule, L.Trainer]:
    L.seed_everything(0)
    module = module or ToyModule()
    trainer = L.Trainer(accelerator="cpu", devices=1, precision="64-true", max_epochs=1, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=callbacks)
    trainer.fit(module, torch.utils.data.DataLoader(batches(depths), batch_size=None))
    return module, trainer


def test_depth_per_step_from_the_batch_and_numerics_equal_to_no_checkpointing():
    recorder = CallRecorder()
    callback = PerBucketCheckpointing(block_classes=[ToyBlock])
    switched, _ = fit([callback, recorder])
    plain, _ = fit([])
    expected = [[2] * (DEPTH if k is None else k) + [1] * (DEPTH - (DEPTH if k is None else k)) for k in DEPTHS]
    assert recorder.calls == expected
    assert switched.losses == plain.losses
    for (name, a), b in zip(switched.state_dict().items(), plain.state_dict().values()):
        assert torch.equal(a, b), name
    assert list(switched.state_dict()) == list(plain.state_dict())
    assert callback.switch.checkpointed == DEPTH  # back to the safe default after fit


def test_block_classes_by_import_path_and_model_built_in_configure_model():
    recorder = CallRecorder()
    callback = PerBucketCheckpointing(block_classes="tests.checkpointing.toy.ToyBlock")
    fit([callback, recorder], depths=[1, 2], module=ToyModule(build_in_configure_model=True))
    assert callback.switch.num_blocks == DEPTH
    assert recorder.calls == [[2, 1, 1, 1], [2, 2, 1, 1]]


def test_a_later_patch_of_the_block_forward_is_refused():
    class LaterPatch(L.Callback):
        def setup(self, trainer, pl_module, stage):
            block = pl_module.net.blocks[1]
            block.forward = types.MethodType(ToyBlock.forward, block)

    with pytest.raises(ValueError, match="block 1 .*replaced"):
        fit([PerBucketCheckpointing(block_classes=[ToyBlock]), LaterPatch()])


def test_bad_depth_in_a_batch_stops_the_fit():
    with pytest.raises(ValueError, match="ac_blocks"):
        fit([PerBucketCheckpointing(block_classes=[ToyBlock])], depths=[1, DEPTH + 1])


def test_without_block_classes_or_strategy_policy_setup_explains():
    with pytest.raises(ValueError, match="needs block_classes"):
        fit([PerBucketCheckpointing()])
    with pytest.raises(ValueError, match="no block"):
        fit([PerBucketCheckpointing(block_classes=[torch.nn.Conv3d])])


def test_takes_over_the_fsdp_strategy_policy():
    strategy = FSDPStrategy(auto_wrap_policy={ToyBlock}, activation_checkpointing_policy={ToyBlock})
    select = take_over_strategy_checkpointing(strategy, None)
    assert strategy._activation_checkpointing_kwargs == {}  # the strategy will not wrap the blocks again
    assert select(ToyBlock(4)) and not select(torch.nn.Linear(2, 2))
    assert strategy.kwargs["auto_wrap_policy"] is not None  # sharding policy untouched

    same = FSDPStrategy(activation_checkpointing_policy={ToyBlock})
    assert take_over_strategy_checkpointing(same, (ToyBlock,)) is not None
    with pytest.raises(ValueError, match="name different blocks"):
        take_over_strategy_checkpointing(FSDPStrategy(activation_checkpointing_policy={ToyBlock}), (torch.nn.Linear,))
    with pytest.warns(DeprecationWarning):  # Lightning deprecates activation_checkpointing=
        legacy = FSDPStrategy(activation_checkpointing=ToyBlock)
    assert take_over_strategy_checkpointing(legacy, None)(ToyBlock(4))
    custom = FSDPStrategy(activation_checkpointing_policy=lambda module, recurse, nonwrapped_numel: True)
    with pytest.raises(ValueError, match="cannot read"):
        take_over_strategy_checkpointing(custom, None)
    assert take_over_strategy_checkpointing(DDPStrategy(), None) is None
    assert take_over_strategy_checkpointing(FSDPStrategy(), None) is None


@pytest.mark.slow
def test_ddp_two_processes_with_a_different_depth_per_rank(tmp_path):
    proc = subprocess.run([sys.executable, str(TESTS / "checkpointing_ddp_script.py"), str(tmp_path)],
                          capture_output=True, text=True, timeout=400, cwd=TESTS.parents[1])
    assert proc.returncode == 0, proc.stderr[-6000:]
    from tests.callbacks.checkpointing_ddp_script import RANK_DEPTHS
    runs = {(fit_, r): json.loads((tmp_path / f"{fit_}_rank{r}.json").read_text())
            for fit_ in ("switched", "plain") for r in (0, 1)}
    for r in (0, 1):
        assert runs[("switched", r)]["calls"] == [[2] * k + [1] * (DEPTH - k) for k in RANK_DEPTHS[r]]
        assert runs[("switched", r)]["losses"] == runs[("plain", r)]["losses"]
        assert runs[("switched", r)]["params"] == runs[("plain", r)]["params"]
    assert runs[("switched", 0)]["params"] == runs[("switched", 1)]["params"]


@pytest.mark.cuda
def test_lightning_fsdp_takes_over_its_policy_and_trains_like_no_checkpointing():
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

    def run(callbacks):
        L.seed_everything(0)
        module = ToyModule()
        strategy = FSDPStrategy(auto_wrap_policy={ToyBlock}, activation_checkpointing_policy={ToyBlock})
        # use_distributed_sampler=False: Lightning's DistributedSampler would shuffle the batches away
        # from `DEPTHS` (the cause of this test's failure on the H200, not the switch)
        trainer = L.Trainer(accelerator="cuda", devices=1, strategy=strategy, precision="32-true", max_epochs=1,
                            logger=False, enable_checkpointing=False, enable_progress_bar=False,
                            enable_model_summary=False, use_distributed_sampler=False, callbacks=callbacks)
        trainer.fit(module, torch.utils.data.DataLoader(batches(DEPTHS, dtype=torch.float32), batch_size=None))
        return module, trainer

    recorder = CallRecorder()
    switched, trainer = run([PerBucketCheckpointing(), recorder])
    assert not any(isinstance(m, CheckpointWrapper) for m in trainer.strategy.model.modules())
    assert recorder.calls == [[2] * (DEPTH if k is None else k) + [1] * (DEPTH - (DEPTH if k is None else k))
                              for k in DEPTHS]
    plain, _ = run([])  # the strategy's own static checkpointing of every block
    assert switched.losses == pytest.approx(plain.losses, rel=1e-5)

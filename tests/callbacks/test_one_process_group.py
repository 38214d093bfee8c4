"""Every callback in a distributed run of one process (gloo, world size 1): the setting of a user
who develops on one GPU with the cluster's config, where collectives run on a group of one and
all_gather returns the world axis (the monitor's crash of issue 15). The monitor's own such run is
in test_monitor.py; multi-process runs are in test_ddp_e2e.py and test_checkpointing.py."""
import lightning as L
import pytest
import torch
from lightning.pytorch.strategies import DDPStrategy

from examples.video_dit.module import VideoDiTModule
from examples.video_dit.surgery import VIDEO_DIT_PATTERNS
from lightning_adaptiveload.callbacks import CostModelCalibration, FusedAdaLNSurgery, PerBucketCheckpointing
from tests.callbacks.checkpointing_module import DEPTH, CallRecorder, ToyModule, batches
from tests.callbacks.test_calibration import TINY, TRUST_ANY, ShapesDataModule

pytestmark = pytest.mark.usefixtures("one_thread")


def _trainer(tmp_path, callbacks, max_steps=1):
    return L.Trainer(accelerator="cpu", devices=1, strategy=DDPStrategy(process_group_backend="gloo"),
                     max_steps=max_steps, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                     enable_model_summary=False, default_root_dir=tmp_path, use_distributed_sampler=False,
                     callbacks=callbacks)


def test_calibration_and_surgery_in_a_group_of_one(tmp_path):
    calibration = CostModelCalibration(num_seq_lens=2, batch_sizes=[1, 2, 4], warmup=0, repeats=1,
                                       cache_path=str(tmp_path / "cache.json"), **TRUST_ANY)
    surgery = FusedAdaLNSurgery(extra_patterns=VIDEO_DIT_PATTERNS, idioms=False)
    trainer = _trainer(tmp_path, [surgery, calibration])
    datamodule = ShapesDataModule()
    trainer.fit(VideoDiTModule(**TINY), datamodule=datamodule)
    assert trainer.world_size == 1 and torch.distributed.is_initialized()
    assert surgery.report.num_replaced == 2  # one block and the head
    assert calibration.result.trusted and len(calibration.result.points) == 6
    shapes = calibration.result.verification.verification.shapes
    assert [m.status for m in shapes] == ["fits"] * len(ShapesDataModule.SCHEDULED)
    [(cost_model, _)] = datamodule.cost_model_calls
    assert cost_model is calibration.result.cost_model and trainer.global_step == 1


def test_per_bucket_checkpointing_in_a_group_of_one(tmp_path):
    depths = [0, 3, None, DEPTH, 1]
    recorder = CallRecorder()
    trainer = L.Trainer(accelerator="cpu", devices=1, strategy=DDPStrategy(process_group_backend="gloo"),
                        max_epochs=1, precision="64-true", logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path,
                        use_distributed_sampler=False,  # keep the batches in the order of `depths`
                        callbacks=[PerBucketCheckpointing(block_classes="tests.checkpointing.toy.ToyBlock"), recorder])
    trainer.fit(ToyModule(), torch.utils.data.DataLoader(batches(depths), batch_size=None))
    # the first k blocks run twice (recomputed in backward), the rest once; None: every block
    assert recorder.calls == [[2] * (DEPTH if k is None else k) + [1] * (DEPTH - (DEPTH if k is None else k))
                              for k in depths]

"""The suite added to a LightningModule not written for it (examples/existing_module.py)."""
import copy
import csv

import pytest
import torch
from lightning.pytorch.loggers import CSVLogger

from examples.existing_module import AdaptiveLoadDenoiser, ConvVideoDenoiser, fit


pytestmark = pytest.mark.usefixtures("one_thread")


def test_adapted_step_on_a_batch_dict_equals_the_original_step_on_its_tuple():
    torch.manual_seed(0)
    original = ConvVideoDenoiser()
    adapted = AdaptiveLoadDenoiser()
    adapted.load_state_dict(copy.deepcopy(original.state_dict()))
    for module in (original, adapted):
        module.log = lambda *args, **kwargs: None  # no Trainer attached
    video, text = torch.randn(3, 4, 2, 8, 8), torch.randn(3, 8, 32)
    torch.manual_seed(1)
    expected = original.training_step((video, text), 0)
    torch.manual_seed(1)
    got = adapted.training_step({"latents": video, "text": text, "seq_len": 32}, 0)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)  # one process: no rescaling


def test_existing_module_trains_with_calibration_and_balance_monitor(tmp_path):
    # any fit is trusted: this checks the wiring; the trust check (which a launch-bound toy model on
    # a shared CPU can fail, falling back to token_equal) is tested in tests/callbacks/test_calibration.py
    trainer = fit(str(tmp_path / "shards"), str(tmp_path / "index.jsonl"), max_steps=3, root_dir=str(tmp_path),
                  calibration=dict(max_heldout_error=float("inf"), min_work_correlation=-1.0),
                  accelerator="cpu", devices=1, logger=CSVLogger(tmp_path), log_every_n_steps=1,
                  enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    datamodule = trainer.datamodule
    calibration = next(cb for cb in trainer.callbacks if type(cb).__name__ == "CostModelCalibration")
    assert datamodule.cost_model is calibration.result.cost_model and calibration.result.cost_model.p > 0
    assert trainer.global_step == 3
    with open(f"{trainer.log_dir}/metrics.csv") as f:
        assert sum(1 for row in csv.DictReader(f) if row.get("loss")) == 3

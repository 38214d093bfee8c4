"""Planning with measured memory end to end on CPU: the tiny example DiT with PerBucketCheckpointing,
CostModelCalibration and the AdaptiveLoadDataModule (memory_planning=True). Under a small (patched)
device memory the buckets get the best (B, k) for the fitted models (a brute-force search over every
B and k, tests/helpers/depth_brute_force.py), every training batch carries its bucket's k and runs at
it, and the samples longer than m_mem, which fit at B = 1 with every block checkpointed, are trained
rather than dropped.

CPU "peaks" are the bytes autograd saves for backward (calibration/runner.py): the numbers stand
for memory only in the sense the plan needs here, growing with B, S and the un-checkpointed blocks."""
import lightning as L
import numpy as np
import pytest
import torch

from examples.video_dit.model import DiTBlock
from examples.video_dit.module import VideoDiTModule
from lightning_adaptiveload.callbacks import CostModelCalibration, PerBucketCheckpointing
from lightning_adaptiveload.data.datamodule import AdaptiveLoadDataModule
from lightning_adaptiveload.scheduling.depth_choice import CHECKPOINTED_BATCH_KEY
from tests.helpers.data import C, D_TEXT, L_TEXT, tokens_ref, write_dataset
from tests.helpers.depth_brute_force import best_batch_and_depth

pytestmark = pytest.mark.usefixtures("one_thread")

MODEL = dict(in_channels=C, dim=32, num_layers=3, num_heads=2, ffn_dim=64, text_dim=D_TEXT, freq_dim=16)
M_MEM = 40  # tokens: the (5, 8, 8) latents (80 tokens) are longer
LONG = (5, 8, 8)
FRACTION = 0.85
TRUST_ANY = dict(max_heldout_error=float("inf"), min_work_correlation=-1.0, max_memory_heldout_error=float("inf"))


class RecordingModule(VideoDiTModule):
    """Records every training batch: latent shape, batch size, keys, its "ac_blocks" and how many blocks
    actually ran checkpointed."""

    def __init__(self):
        super().__init__(**MODEL)
        self.batches = []

    def training_step(self, batch, batch_idx):
        if not batch["keys"][0].startswith("synthetic"):  # not calibration's steps
            ran = sum(b.__dict__["_adaptiveload_checkpointing"].checkpoint for b in self.dit.blocks)
            self.batches.append((tuple(batch["latent_shape"]), len(batch["keys"]), list(batch["keys"]),
                                 batch.get(CHECKPOINTED_BATCH_KEY), ran))
        return super().training_step(batch, batch_idx)


def datamodule(root, **kw):
    args = dict(shards=str(root), index=str(root / "index.jsonl"), policy="balanced", m_mem=M_MEM, latent_channels=C,
                text_len=L_TEXT, text_dim=D_TEXT, num_workers=0, seed=3)
    return AdaptiveLoadDataModule(**{**args, **kw})


def fit(root, tmp, device_memory, monkeypatch, max_epochs=1):
    monkeypatch.setattr("lightning_adaptiveload.calibration.loop.device_memory_bytes", lambda device: device_memory)
    torch.manual_seed(0)
    module, dm = RecordingModule(), datamodule(root, memory_planning=True)
    calib = CostModelCalibration(num_seq_lens=3, batch_sizes=[1, 2, 4, 8], warmup=0, repeats=1,
                                 cache_path=str(root / "calibration_cache.json"), max_memory_fraction=FRACTION,
                                 **TRUST_ANY)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_epochs=max_epochs, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp,
                        use_distributed_sampler=False,
                        callbacks=[PerBucketCheckpointing(block_classes=[DiTBlock]), calib])
    trainer.fit(module, datamodule=dm)
    return module, dm, calib, trainer


def test_buckets_get_the_plans_batch_and_depth_and_no_sample_that_fits_is_left_out(tmp_path, monkeypatch):
    root = tmp_path / "data"
    written = write_dataset(root, n=90)
    long_keys = {k for k, (latent, _) in written.items() if latent.shape[1:] == LONG}
    assert long_keys and tokens_ref(*LONG) > M_MEM
    # without memory planning the long samples are dropped at setup, for the token budget
    plain = datamodule(root)
    plain.setup("fit")
    assert plain.counters()["skipped/over_max_seq_len"] == len(long_keys)

    # 1) calibrate on the machine's memory, to learn the models (cached)
    _, _, first, _ = fit(root, tmp_path / "a", 2**40, monkeypatch, max_epochs=0)
    assert first.result.memory_plan_used and first.result.source == "measured"
    memory, depth = first.result.memory.memory_model, first.result.memory.depth_cost_model
    L_ = memory.num_blocks
    assert L_ == 3
    # 2) a device whose budget fits one long sample with every block checkpointed, and not with none
    long_full, long_none = memory.predict(1, tokens_ref(*LONG), L_), memory.predict(1, tokens_ref(*LONG), 0)
    assert long_none > long_full
    # a quarter of the way from one to the other: not the midpoint, which (the model being linear in the live
    # blocks) is exactly the k = 1 peak of L = 3, a tie that float rounding decides either way
    device = (0.75 * long_full + 0.25 * long_none) / FRACTION
    module, dm, calib, trainer = fit(root, tmp_path / "b", device, monkeypatch)
    assert calib.result.source == "cache" and calib.result.memory_plan_used
    assert calib.result.memory.memory_model.params == pytest.approx(memory.params, rel=1e-9)

    # the bucket table is the best (B, k) for the fitted models on this device, token cap m_mem: by
    # brute force, not by choose_batch_and_depth (which built the table)
    table = dm.bucket_table()
    ref = [best_batch_and_depth(int(s), memory, depth, FRACTION * device, M_MEM) for s in table.seq_len]
    assert None not in ref and table.batch_size.tolist() == [b for b, _ in ref]
    assert table.checkpointed.tolist() == [k for _, k in ref]
    np.testing.assert_allclose(table.peak_bytes, [memory.predict(b, int(s), k) for s, (b, k) in zip(table.seq_len, ref)],
                               rtol=1e-12)
    assert np.all(table.peak_bytes <= FRACTION * device)
    row = {r["latent_shape"]: r for r in table.rows()}
    assert row[LONG]["batch_size"] == 1 and 0 < row[LONG]["checkpointed"] <= L_
    assert len(set(table.checkpointed.tolist())) > 1  # the buckets differ in depth on this device
    assert "memory plan: peak <=" in table.format()

    # training: every batch carries its bucket's k, runs at it, has its bucket's B
    assert module.batches and trainer.global_step == len(module.batches)
    for thw, size, _, k, ran in module.batches:
        assert k == row[thw]["checkpointed"] and isinstance(k, int) and ran == k
        assert size <= row[thw]["batch_size"]  # a bucket's last batch may be smaller (drop_last=False for balanced)
    sizes = [size for thw, size, *_ in module.batches if thw == LONG]
    assert sizes and set(sizes) == {1}
    trained = {key for _, _, keys, _, _ in module.batches for key in keys}
    assert long_keys <= trained  # longer than m_mem, fit at B = 1: trained, not dropped
    assert dm.counters()["dropped_oversize"] == 0 and "skipped/over_max_seq_len" not in dm.counters()
    assert dm.counters()["dropped_partial_batch"] == 0 and dm.counters()["dropped_step_remainder"] == 0
    # verification ran each scheduled shape at its depth, it fitted, and the model predicted its peak
    shapes = calib.result.verification.verification.shapes
    assert {(m.latent_shape, m.checkpointed) for m in shapes} == {(thw, r["checkpointed"]) for thw, r in row.items()}
    assert all(m.fits and m.predicted_peak_bytes is not None for m in shapes)


def test_until_a_plan_is_set_samples_over_m_mem_are_left_out_counted(tmp_path):
    root = tmp_path / "data"
    written = write_dataset(root, n=60)
    long_keys = {k for k, (latent, _) in written.items() if latent.shape[1:] == LONG}
    dm = datamodule(root, memory_planning=True, policy="token_equal")
    dm.setup("fit")
    assert "skipped/over_max_seq_len" not in dm.counters()  # admitted at setup
    loader = dm.build_train_loader(1, 0)
    keys = [k for batch in loader for k in batch["keys"]]
    assert not long_keys & set(keys) and CHECKPOINTED_BATCH_KEY not in next(iter(loader))
    assert loader.batch_sampler.stats["dropped_oversize"] == len(long_keys)
    assert dm.bucket_table().max_seq_len == M_MEM
    with pytest.raises(ValueError, match="oversize='resize'.*memory_planning"):
        datamodule(root, memory_planning=True, oversize="resize")

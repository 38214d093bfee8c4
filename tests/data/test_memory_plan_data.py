"""AdaptiveLoadDataModule under a memory plan, both sources: the bucket table is the plan's (B, k), every
batch carries its bucket's k as "ac_blocks", samples longer than m_mem are trained where they fit the
device and left out, counted, where they do not; scheduled_batch_shapes carries k."""
import logging

import numpy as np
import pytest

from lightning_adaptiveload.scheduling.buckets import ScheduledShape
from lightning_adaptiveload.scheduling.cost_model import CostModel
from lightning_adaptiveload.scheduling.depth_cost_model import DepthCostModel
from lightning_adaptiveload.scheduling.depth_choice import CHECKPOINTED_BATCH_KEY
from lightning_adaptiveload.scheduling.memory_model import MemoryModel
from tests.data.test_webdataset_stream import stream_dm
from tests.helpers.depth_brute_force import best_batch_and_depth
from tests.helpers.data import indexed_datamodule, tokens_ref, write_dataset

L_BLOCKS = 3
LONG = (5, 8, 8)  # 80 tokens, longer than M_MEM
M_MEM = 40
# bytes: 1000 fixed, 10 per sample, 1 per token, and 2 per token for each live block (max(L - k, 1))
MEMORY = MemoryModel("linear", {"m0": 1000.0, "c": 10.0, "a": 1.0, "c_k": 0.0, "b": 2.0}, num_blocks=L_BLOCKS)
TIME = DepthCostModel(CostModel("linear_quadratic", {"a": 5.0, "c1": 0.1, "c2": 1e-3}, p=1.2, quality={}),
                      num_blocks=L_BLOCKS, recompute_fraction=0.25)
FITS_LONG = 1300 / 0.85   # peak(1, 80, k) = 1250 <= 1300 at k = L and k = 2 (one live block; k = 1: 1410)
NOT_LONG = 1200 / 0.85    # below 1250: it fits nowhere; samples up to M_MEM (peak <= 1130) still fit


def check_batches(batches, table, written=None):
    row = {r["latent_shape"]: r for r in table.rows()}
    for b in batches:
        thw = tuple(b["latent_shape"])
        assert b[CHECKPOINTED_BATCH_KEY] == row[thw]["checkpointed"] and type(b[CHECKPOINTED_BATCH_KEY]) is int
        assert len(b["keys"]) <= row[thw]["batch_size"]
    return {k for b in batches for k in b["keys"]}


def test_map_style_batches_follow_the_plan_and_long_samples_fit_or_are_counted(tmp_path, caplog):
    written = write_dataset(tmp_path, n=90)
    long_keys = {k for k, (latent, _) in written.items() if latent.shape[1:] == LONG}
    dm = indexed_datamodule(tmp_path, policy="balanced", m_mem=M_MEM, memory_planning=True)
    dm.set_memory_plan(TIME, MEMORY, FITS_LONG, 0.85)
    assert dm.cost_model is TIME.base
    table = dm.bucket_table()
    # every bucket's best (B, k) by brute force over B <= max(1, M_MEM // S) and every k
    ref = [best_batch_and_depth(int(s), MEMORY, TIME, 0.85 * FITS_LONG, M_MEM) for s in table.seq_len]
    assert table.batch_size.tolist() == [b for b, _ in ref] and table.checkpointed.tolist() == [k for _, k in ref]
    assert {r["latent_shape"]: r["checkpointed"] for r in table.rows()}[LONG] == 2
    loader = dm.build_train_loader(1, 0)
    trained = check_batches(list(loader), table)
    assert long_keys <= trained and loader.batch_sampler.stats["dropped_oversize"] == 0
    # the warm-up list: every scheduled (B, shape) with its bucket's k
    shapes = dm.scheduled_batch_shapes()
    depth = {r["latent_shape"]: r["checkpointed"] for r in table.rows()}
    assert shapes and all(isinstance(s, ScheduledShape) and s.checkpointed == depth[s.latent_shape] for s in shapes)
    # what the monitor prices batches by: the time at each bucket's k, as the plan does (k = 2 for LONG, not L)
    price = dm.step_cost_model()
    for r in table.rows():
        assert price.predict(r["batch_size"], r["seq_len"]) == pytest.approx(
            float(TIME.predict(r["batch_size"], r["seq_len"], r["checkpointed"])), rel=1e-12)
    long_row = {r["latent_shape"]: r for r in table.rows()}[LONG]
    assert price.predict(1, long_row["seq_len"]) < TIME.base.predict(1, long_row["seq_len"])

    with caplog.at_level(logging.WARNING):
        dm.set_memory_plan(TIME, MEMORY, NOT_LONG, 0.85)
    assert f"{len(long_keys)} admitted samples are longer than" in caplog.text
    loader = dm.build_train_loader(1, 0)
    trained = check_batches(list(loader), dm.bucket_table())
    assert not long_keys & trained and loader.batch_sampler.stats["dropped_oversize"] == len(long_keys)
    # the longest sample that fits 0.85 * NOT_LONG = 1200 bytes at B = 1, k = L, by the formula above:
    # 1000 + 10 + S + 2 * S * 1 <= 1200, so S <= 63 (not MemoryModel.max_seq_len, which the plan calls)
    assert dm.bucket_table().max_seq_len == 63 == MEMORY.max_seq_len(1200) < tokens_ref(*LONG)

    dm.set_cost_model(TIME.base)  # a new cost model drops the plan: no depth in the batches
    assert dm.memory_plan is None and CHECKPOINTED_BATCH_KEY not in next(iter(dm.build_train_loader(1, 0)))
    with pytest.raises(ValueError, match="needs a DepthCostModel"):
        dm.set_memory_plan(TIME.base, MEMORY, FITS_LONG)
    with pytest.raises(ValueError, match="max_memory_fraction"):
        dm.set_memory_plan(TIME, MEMORY, FITS_LONG, 1.5)


def test_a_plan_that_fits_no_sample_is_a_clear_error(tmp_path):
    write_dataset(tmp_path, n=30)
    dm = indexed_datamodule(tmp_path, policy="balanced", m_mem=M_MEM, memory_planning=True)
    dm.set_memory_plan(TIME, MEMORY, 900.0, 0.85)
    with pytest.raises(ValueError, match="no sample fits the device"):
        dm.build_train_loader(1, 0)


@pytest.mark.parametrize("device, long_trained", [(FITS_LONG, True), (NOT_LONG, False)])
def test_streaming_batches_carry_their_depth_and_unfit_samples_are_skipped(tmp_path, device, long_trained):
    written = write_dataset(tmp_path, n=90, shards=3)
    long_keys = {k for k, (latent, _) in written.items() if latent.shape[1:] == LONG}
    dm = stream_dm(tmp_path, m_mem=M_MEM, m_comp=None, p=None, memory_planning=True, steps_per_epoch=30)
    dm.set_memory_plan(TIME, MEMORY, device, 0.85)
    batches = [dm.on_before_batch_transfer(b, 0) for b in dm.build_train_loader(1, 0)]
    assert len(batches) == 30
    trained = check_batches(batches, dm.bucket_table())
    assert bool(long_keys & trained) == long_trained
    assert (dm.skipped["over_max_seq_len"] > 0) == (not long_trained)
    shapes = dm.scheduled_batch_shapes()
    depth = {r["latent_shape"]: r["checkpointed"] for r in dm.bucket_table().rows()}
    assert all(s.checkpointed == depth[s.latent_shape] for s in shapes)


def test_without_the_flag_a_plan_still_sets_depths_but_setup_kept_its_bound(tmp_path):
    written = write_dataset(tmp_path, n=60)
    dm = indexed_datamodule(tmp_path, policy="balanced", m_mem=M_MEM)
    assert dm.counters()["skipped/over_max_seq_len"] == sum(v[0].shape[1:] == LONG for v in written.values())
    dm.set_memory_plan(TIME, MEMORY, FITS_LONG, 0.85)
    table = dm.bucket_table()
    assert tokens_ref(*LONG) not in table.seq_len.tolist()
    check_batches(list(dm.build_train_loader(1, 0)), table)
    assert np.all(table.peak_bytes <= 0.85 * FITS_LONG)

"""AdaptiveLoadDataModule, streaming path: equal batch counts per rank and worker, explicit shard
split, data equal to what was written, corrupt input skipped and counted, resume, setup errors."""
import tarfile

import numpy as np
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_adaptiveload.data.datamodule import AdaptiveLoadDataModule
from lightning_adaptiveload.data.shards import encode_sample, write_shard
from lightning_adaptiveload.data.webdataset_stream import sample_nbytes, shard_order
from tests.helpers.data import C, D_TEXT, L_TEXT, KeyRecorder, corrupt_cases, tokens_ref, trainer, write_dataset


def stream_dm(root, **kw):
    args = dict(shards=str(root), policy="balanced", m_mem=128, p=1.5, m_comp=400.0, latent_channels=C,
                text_len=L_TEXT, text_dim=D_TEXT, num_workers=0, seed=5, steps_per_epoch=7, shuffle_buffer=8)
    args.update(kw)
    dm = AdaptiveLoadDataModule(**args)
    dm.setup("fit")
    return dm


def rank_batches(dm, world, rank):
    return [dm.on_before_batch_transfer(b, 0) for b in dm.build_train_loader(world, rank)]


def test_shard_order_splits_disjointly_and_resamples_when_short():
    shards = [f"s{i}" for i in range(12)]
    owned = {}
    for rank in range(3):
        for worker in range(2):
            order = shard_order(shards, rank=rank, world_size=3, worker=worker, num_workers=2, seed=1, epoch=0)
            first = [next(order) for _ in range(6)]  # three passes over its two shards
            owned[(rank, worker)] = set(first)
            assert len(owned[(rank, worker)]) == 2 and sorted(first[:2]) == sorted(first[2:4])
    assert set().union(*owned.values()) == set(shards)  # disjoint cover: 6 readers x 2 shards
    few = shard_order(shards[:2], rank=2, world_size=3, worker=1, num_workers=2, seed=1, epoch=0)
    assert set(next(few) for _ in range(50)) == {"s0", "s1"}  # resampled, never runs dry


@pytest.mark.parametrize("num_workers", [0, 2])
def test_equal_batch_counts_across_ranks_and_workers(tmp_path, num_workers):
    written = write_dataset(tmp_path, n=90, shards=6)
    dm = stream_dm(tmp_path, num_workers=num_workers)
    per_rank = {}
    for rank in range(3):
        batches = rank_batches(dm, 3, rank)
        assert len(batches) == 7 == len(dm.build_train_loader(3, rank))
        keys = [k for b in batches for k in b["keys"]]
        per_rank[rank] = keys
        for b in batches:
            t, h, w = b["latent_shape"]
            assert b["latents"].shape == (len(b["keys"]), C, t, h, w) and b["seq_len"] == tokens_ref(t, h, w)
            for i, key in enumerate(b["keys"]):
                np.testing.assert_array_equal(b["latents"][i].numpy(), written[key][0])
    # 6 shards >= 3 ranks x readers: each rank reads only its own shards (15 keys per shard)
    readers = 3 * max(1, num_workers)
    if readers <= 6:
        for rank, keys in per_rank.items():
            own = {s for w in range(max(1, num_workers)) for s in range((rank * max(1, num_workers) + w), 6, readers)}
            assert {int(k[1:]) // 15 for k in keys} <= own
    assert dict(dm.skipped) == {}


def test_stream_corruption_skipped_counted_and_logged(tmp_path, caplog):
    rng = np.random.default_rng(7)
    cases = corrupt_cases(rng)
    write_dataset(tmp_path, n=40, shards=2)
    bad_items = [(f"bad{i:03d}", files) for i, (_, files, _) in enumerate(cases)]
    write_shard(tmp_path / "shard-0002.tar", bad_items)
    # a truncated shard: 5 good samples, cut inside the data of the fourth one's latent
    items = [(f"t{i:04d}", encode_sample(f"t{i:04d}", rng.standard_normal((C, 1, 4, 4)).astype(np.float32)))
             for i in range(5)]
    write_shard(tmp_path / "shard-0003.tar", items)
    data = (tmp_path / "shard-0003.tar").read_bytes()
    latent = [i for i in tarfile.open(tmp_path / "shard-0003.tar") if i.name == "t0003.latent.npy"][0]
    (tmp_path / "shard-0003.tar").write_bytes(data[: latent.offset_data + 100])
    # an oversize sample (max_seq_len 60 < 5*4*4 = 80 tokens of (5, 8, 8))
    dm = stream_dm(tmp_path, max_seq_len=60, m_mem=128, steps_per_epoch=25)
    with caplog.at_level("WARNING"):
        batches = rank_batches(dm, 1, 0)
    assert len(batches) == 25
    expected = {r for n, _, r in cases}
    assert expected | {"read_error", "over_max_seq_len"} <= set(dm.skipped)
    assert "skipped" in caplog.text and "the train stream" in caplog.text
    assert all(not k.startswith("bad") for b in batches for k in b["keys"])


def test_streaming_setup_errors(tmp_path):
    write_shard(tmp_path / "bad.tar", [("x", {"json": b"{}"})])
    with pytest.raises(ValueError, match="no valid sample"):
        stream_dm(tmp_path)
    write_dataset(tmp_path / "ok", n=10, shards=1)
    with pytest.raises(ValueError, match="steps_per_epoch"):
        stream_dm(tmp_path / "ok", steps_per_epoch=None)


def test_streaming_uses_shapes_mix_for_bucket_table(tmp_path):
    write_dataset(tmp_path, n=20, shards=2)
    mix = tmp_path / "mix.jsonl"
    mix.write_text('{"latent_t": 1, "latent_h": 4, "latent_w": 8, "count": 5}\n'
                   '{"latent_t": 1, "latent_h": 8, "latent_w": 4, "count": 3}\n'
                   '{"latent_t": 9, "latent_h": 64, "latent_w": 64, "count": 1}\n')
    dm = stream_dm(tmp_path, shapes=str(mix), max_seq_len=100, oversize="resize")
    table = dm.bucket_table().rows()
    assert [(r["seq_len"], r["latent_shape"], r["samples"]) for r in table[:2]] == [(8, (1, 4, 8), 5),
                                                                                  (9, (1, 8, 4), 3)]
    assert table[2]["seq_len"] <= 100 and tokens_ref(*table[2]["latent_shape"]) == table[2]["seq_len"]
    # shapes the mix does not list still stream, in their own buckets
    batches = rank_batches(dm, 2, 1)
    assert len(batches) == 7 and all(b["latents"].shape[2:] == b["latent_shape"] for b in batches)


def test_streaming_resume_keeps_epoch_length(tmp_path):
    write_dataset(tmp_path / "data", n=60, shards=3)
    first = KeyRecorder()
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=3, save_top_k=-1)
    trainer(tmp_path / "a", max_steps=3, callbacks=[ckpt]).fit(first, stream_dm(tmp_path / "data", steps_per_epoch=8))
    path = next((tmp_path / "ckpt").glob("*step=3.ckpt"))
    state = torch.load(path, weights_only=False)["loops"]["fit_loop"]["state_dict"]["combined_loader"][0]
    assert state == {"streaming": True, "epoch": 0, "steps_done": 3, "steps_per_epoch": 8}
    second = KeyRecorder()
    trainer(tmp_path / "b", max_epochs=2).fit(second, stream_dm(tmp_path / "data", steps_per_epoch=8), ckpt_path=path)
    assert len(second.keys) == 5 + 8  # the rest of epoch 0, then a full epoch 1


def test_synthetic_batch_structure_equals_streamed_batch(tmp_path):
    write_dataset(tmp_path, n=30, shards=2)
    dm = stream_dm(tmp_path)
    real = rank_batches(dm, 1, 0)[0]
    synth = dm.synthetic_batch(real["latent_shape"], 2)
    assert synth.keys() == real.keys()
    assert {k: type(v) for k, v in synth.items()} == {k: type(v) for k, v in real.items()}
    assert synth["latents"].shape[1:] == real["latents"].shape[1:] and synth["text"].shape[1:] == real["text"].shape[1:]
    assert synth["seq_len"] == real["seq_len"]


def test_dry_stream_raises_instead_of_hanging(tmp_path):
    # tiny shards and a shuffle buffer larger than the data: no false alarm
    write_dataset(tmp_path / "tiny", n=8, shards=8)
    assert len(rank_batches(stream_dm(tmp_path / "tiny", shuffle_buffer=256), 1, 0)) == 7
    # rank 1 owns only a shard of bad samples (setup's probe finds shard 0 fine): a clear error
    write_dataset(tmp_path / "half", n=10, shards=1)
    write_shard(tmp_path / "half" / "shard-0001.tar", [(f"b{i}", {"json": b"{"}) for i in range(5)])
    dm = stream_dm(tmp_path / "half")
    assert len(rank_batches(dm, 2, 0)) == 7
    with pytest.raises(RuntimeError, match="no valid sample in .* shard reads on rank 1"):
        rank_batches(dm, 2, 1)


def test_uneven_shard_split_warns(tmp_path, caplog):
    write_dataset(tmp_path, n=30, shards=6)
    dm = stream_dm(tmp_path, num_workers=0)
    with caplog.at_level("WARNING"):
        dm.build_train_loader(3, 0)  # 6 shards over 3 readers: even
    assert "readers" not in caplog.text
    with caplog.at_level("WARNING"):
        dm.build_train_loader(4, 0)  # 2 readers own 1 shard, 2 own 2: the single shards are read twice as often
    assert "6 shards over 4 readers (ranks x workers): 2 readers stream 1 shards and read each 100% more often" \
        in caplog.text


def test_sample_nbytes_counts_tensors_arrays_and_bytes():
    sample = {"seq_len": 100, "latent": torch.zeros(4, 8, dtype=torch.float16), "raw": b"abc",
              "arr": np.zeros(5, dtype=np.float32), "key": "x", "view": torch.zeros(10, 10)[:, 0]}
    assert sample_nbytes(sample) == 4 * 8 * 2 + 3 + 5 * 4 + 10 * 4


def test_streaming_counters_drop_nothing(tmp_path):
    write_dataset(tmp_path, n=30, shards=2)
    dm = stream_dm(tmp_path, max_seq_len=60)  # (5, 8, 8) samples have 80 tokens: skipped when decoded
    assert dm.counters() == {"dropped_oversize": 0, "dropped_partial_batch": 0, "dropped_step_remainder": 0}
    rank_batches(dm, 1, 0)
    counters = dm.counters()
    assert counters["skipped/over_max_seq_len"] == dm.skipped["over_max_seq_len"] > 0
    assert {k: v for k, v in counters.items() if k.startswith("dropped")} == dict.fromkeys(
        ("dropped_oversize", "dropped_partial_batch", "dropped_step_remainder"), 0)

"""AdaptiveLoadDataModule, map-style path: batches equal the written arrays, skip accounting,
synthetic_batch structure, scheduling keys, setup errors, mid-epoch resume through checkpoints."""
import math

import numpy as np
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_adaptiveload.data.datamodule import AdaptiveLoadDataModule
from lightning_adaptiveload.data.shards import write_shard
from lightning_adaptiveload.scheduling.buckets import schedule_keys
from lightning_adaptiveload.scheduling.shapes import TokenSpec
from tests.helpers.data import (C, D_TEXT, L_TEXT, SHAPES, KeyRecorder, indexed_datamodule, tokens_ref, trainer,
                                write_dataset, write_index_lines)


def epoch_batches(dm, epoch=0):
    loader = dm.train_dataloader()
    loader.batch_sampler.set_epoch(epoch)
    return [dm.on_before_batch_transfer(b, 0) for b in loader]


@pytest.mark.parametrize("policy,num_workers", [("token_equal", 0), ("balanced", 0), ("token_equal", 2)])
def test_map_style_batches_equal_written_arrays(tmp_path, policy, num_workers):
    written = write_dataset(tmp_path, n=60)
    dm = indexed_datamodule(tmp_path, policy=policy, p=1.5, m_comp=500.0, num_workers=num_workers)
    batches = epoch_batches(dm)
    seen = []
    for b in batches:
        t, h, w = b["latent_shape"]
        assert b["latents"].shape == (len(b["keys"]), C, t, h, w) and b["latents"].dtype == torch.float32
        assert b["text"].shape == (len(b["keys"]), L_TEXT, D_TEXT)
        assert b["seq_len"] == tokens_ref(t, h, w)
        assert len(b["keys"]) * b["seq_len"] <= 128 or len(b["keys"]) == 1  # memory budget B*S <= m_mem
        for i, key in enumerate(b["keys"]):
            latent, text = written[key]
            np.testing.assert_array_equal(b["latents"][i].numpy(), latent)
            if text is not None:
                np.testing.assert_array_equal(b["text"][i].numpy(), text)
            else:
                assert b["text"][i].std() > 0.5  # stand-in embedding, never zeros
        seen += b["keys"]
    assert len(seen) == len(set(seen))
    assert len(seen) == dm.train_dataloader().batch_sampler.stats["samples_scheduled"]
    assert dict(dm.skipped) == {}


def test_mixed_shape_collision_batches_are_single_shape(tmp_path):
    write_dataset(tmp_path, n=90)
    dm = indexed_datamodule(tmp_path, m_mem=200)
    table = dm.bucket_table().rows()
    assert [r["latent_shape"] for r in table if tokens_ref(*r["latent_shape"]) == 8] == [(1, 4, 8), (1, 8, 4)]
    assert sorted(r["seq_len"] for r in table) == list(dm.bucket_seq_lens())
    for b in epoch_batches(dm):
        assert b["latents"].shape[2:] == b["latent_shape"]


def test_config_checks_at_setup_are_counted(tmp_path, caplog):
    written = write_dataset(tmp_path, n=40)
    tokens = {k: tokens_ref(*lat.shape[1:]) for k, (lat, _) in written.items()}
    assert dict(indexed_datamodule(tmp_path, max_seq_len=100).skipped) == {}  # longest is (5, 8, 8) = 80 tokens
    with caplog.at_level("WARNING"):
        dm = indexed_datamodule(tmp_path, max_seq_len=30, m_mem=64)
    assert dm.skipped == {"over_max_seq_len": sum(t > 30 for t in tokens.values())} and "over_max_seq_len" in caplog.text
    assert sum(r["samples"] for r in dm.bucket_table().rows()) == sum(t <= 30 for t in tokens.values())
    assert {r["latent_shape"] for r in dm.bucket_table().rows()} == {s for s in SHAPES if tokens_ref(*s) <= 30}
    dm = indexed_datamodule(tmp_path, text_dim=7)  # samples with an 8-wide text embedding no longer fit
    assert dm.skipped == {"bad_text": sum(t is not None for _, t in written.values())}
    resized = indexed_datamodule(tmp_path, max_seq_len=30, oversize="resize")
    assert "over_max_seq_len" not in resized.skipped
    seen = 0
    for b in epoch_batches(resized):
        assert b["seq_len"] <= 30 and b["latents"].shape[2:] == b["latent_shape"]
        seen += sum(tokens[k] > 30 for k in b["keys"])
    assert seen > 0  # oversized samples were trained on, resized


def test_runtime_read_failure_skipped_and_counted(tmp_path, caplog):
    write_dataset(tmp_path, n=40, shards=2)
    dm = indexed_datamodule(tmp_path, m_mem=400)
    # corrupt the latent bytes of one scheduled sample (in a batch of >= 2) after indexing
    batch = next(b for b in dm.train_dataloader().batch_sampler if len(b) >= 2)
    row = dm.source.dataset.index[batch[0]]
    offset, size, _ = row["members"]["latent.npy"]
    with open(row["shard"], "r+b") as f:
        f.seek(offset)
        f.write(b"\0" * 16)
    with caplog.at_level("WARNING"):
        batches = epoch_batches(dm)
    keys = [k for b in batches for k in b["keys"]]
    assert row["key"] not in keys and dm.skipped == {"bad_latent": 1}
    assert "bad_latent=1" in caplog.text
    # a batch whose every sample fails cannot be filled: a clear error, not an empty batch
    for i in batch:
        offset, _, _ = dm.source.dataset.index[i]["members"]["latent.npy"]
        with open(dm.source.dataset.index[i]["shard"], "r+b") as f:
            f.seek(offset)
            f.write(b"\0" * 16)
    with pytest.raises(RuntimeError, match="every sample of a batch failed"):
        epoch_batches(dm)


def test_synthetic_batch_structure_equals_real_batch(tmp_path):
    write_dataset(tmp_path, n=40)
    dm = indexed_datamodule(tmp_path, m_mem=200)
    real = epoch_batches(dm)[0]
    synth = dm.synthetic_batch(real["latent_shape"], 3)
    assert synth.keys() == real.keys()
    for k in real:
        assert type(synth[k]) is type(real[k]), k
    for k in ("latents", "text"):
        assert synth[k].dtype == real[k].dtype and synth[k].shape[1:] == real[k].shape[1:] and len(synth[k]) == 3
        assert synth[k].std() > 0.5
    assert synth["latent_shape"] == real["latent_shape"] and synth["seq_len"] == real["seq_len"]
    # every scheduled count maps to its bucket's shape; an unknown count to a shape with that many tokens
    for row in dm.bucket_table().rows():
        assert dm.synthetic_batch(row["seq_len"], 1)["latent_shape"] == row["latent_shape"]
    b = dm.synthetic_batch(1000, 2)
    assert tokens_ref(*b["latent_shape"]) == 1000 == b["seq_len"] and b["latents"].shape[2:] == b["latent_shape"]


def test_set_cost_model_rebuilds_bucket_table(tmp_path):
    from lightning_adaptiveload.scheduling.cost_model import CostModel
    write_dataset(tmp_path, n=40)
    dm = indexed_datamodule(tmp_path, policy="dual_constraint", m_mem=256)
    rng = np.random.default_rng(0)
    b = rng.integers(1, 16, size=40)
    s = rng.integers(4, 100, size=40)
    model = CostModel.fit(b, s, 1.0 + 0.01 * b * s ** 1.5, form="power")
    dm.set_cost_model(model, m_mem=128)
    table = dm.bucket_table().rows()
    m_comp = model.m_comp(128, int(dm.bucket_seq_lens()[-1]))
    for row in table:
        s_ = row["seq_len"]
        assert row["batch_size"] == max(1, min(128 // s_, math.floor(m_comp / s_ ** model.p)))
    sampler = dm.train_dataloader().batch_sampler
    assert sampler.cost_model is model and sampler.m_mem == 128


def test_set_cost_model_warns_when_m_mem_drops_below_buckets(tmp_path, caplog):
    write_dataset(tmp_path, n=40)
    dm = indexed_datamodule(tmp_path, m_mem=256)
    with caplog.at_level("WARNING"):
        dm.set_cost_model(None, m_mem=64)  # (5, 8, 8) = 80 tokens > 64
    assert "m_mem is now 64 tokens but buckets up to 80" in caplog.text


def test_setup_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="missing or unreadable"):
        indexed_datamodule(tmp_path, shards=str(tmp_path / "nope-{0..3}.tar"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="holds no .tar"):
        indexed_datamodule(tmp_path / "empty")
    write_dataset(tmp_path / "d", n=10)
    (tmp_path / "d" / "empty.jsonl").write_text("\n")
    with pytest.raises(ValueError, match="lists no samples"):
        indexed_datamodule(tmp_path / "d", index=str(tmp_path / "d" / "empty.jsonl"))
    with pytest.raises(ValueError, match="outside `shards`"):
        indexed_datamodule(tmp_path / "d", shards=str(tmp_path / "d" / "shard-0000.tar"))
    with pytest.raises(ValueError, match="fits this configuration"):
        indexed_datamodule(tmp_path / "d", latent_channels=3)
    with pytest.raises(ValueError, match="policy"):
        AdaptiveLoadDataModule(shards="x", policy="fastest")
    with pytest.raises(ValueError, match="m_mem"):
        AdaptiveLoadDataModule(shards="x", m_mem=0)
    for bad in (0, "long", 2.5):  # "long" was a bare int() error, 0 an error only at setup
        with pytest.raises(ValueError, match=r"max_seq_len \(tokens\) must be an integer >= 1"):
            AdaptiveLoadDataModule(shards="x", max_seq_len=bad)


def test_prepare_data_synthesizes_shards_and_index(tmp_path):
    mix = tmp_path / "mix.jsonl"
    mix.write_text('{"latent_t": 1, "latent_h": 4, "latent_w": 4, "count": 2}\n{"latent_t": 3, "latent_h": 6, "latent_w": 6}\n')
    dm = AdaptiveLoadDataModule(shards=str(tmp_path / "shards"), index=str(tmp_path / "index.jsonl"), policy="token_equal",
                                m_mem=64, latent_channels=C, text_len=L_TEXT, text_dim=D_TEXT, num_workers=0,
                                synthesize=30, synthesize_shapes=str(mix))
    dm.prepare_data()
    dm.setup("fit")
    assert {r["latent_shape"] for r in dm.bucket_table().rows()} == {(1, 4, 4), (3, 6, 6)}
    assert sum(r["samples"] for r in dm.bucket_table().rows()) == 30
    mtime = (tmp_path / "index.jsonl").stat().st_mtime_ns
    dm.prepare_data()  # second run: nothing rewritten
    assert (tmp_path / "index.jsonl").stat().st_mtime_ns == mtime
    with pytest.raises(ValueError, match="one folder"):
        AdaptiveLoadDataModule(shards=str(tmp_path / "s-{0..3}.tar"), synthesize=10).prepare_data()


@pytest.mark.parametrize("num_workers", [0, 2])
def test_mid_epoch_resume_sees_each_sample_once(tmp_path, num_workers):
    write_dataset(tmp_path / "data", n=80)
    dm_args = dict(num_workers=num_workers)
    full = KeyRecorder()
    trainer(tmp_path / "full", max_epochs=1).fit(full, indexed_datamodule(tmp_path / "data", **dm_args))
    epoch_keys = [k for ks in full.keys for k in ks]
    steps = len(full.keys)
    assert steps >= 8 and len(epoch_keys) == len(set(epoch_keys))

    stop = steps // 2 - 1
    first = KeyRecorder()
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=stop, save_top_k=-1)
    trainer(tmp_path / "a", max_steps=stop, callbacks=[ckpt]).fit(first,
                                                                  indexed_datamodule(tmp_path / "data", **dm_args))
    assert len(first.keys) == stop
    path = next((tmp_path / "ckpt").glob(f"*step={stop}.ckpt"))
    assert torch.load(path, weights_only=False)["loops"]["fit_loop"]["state_dict"]["combined_loader"]

    second = KeyRecorder()
    trainer(tmp_path / "b", max_epochs=1).fit(second, indexed_datamodule(tmp_path / "data", **dm_args), ckpt_path=path)
    resumed = [k for ks in first.keys + second.keys for k in ks]
    assert len(first.keys) + len(second.keys) == steps
    assert len(resumed) == len(set(resumed))  # nothing repeated
    assert sorted(resumed) == sorted(epoch_keys)  # nothing skipped: exactly the uninterrupted epoch


def test_epochs_reshuffle_and_trainer_sets_epoch(tmp_path):
    write_dataset(tmp_path / "data", n=60)
    model = KeyRecorder()
    trainer(tmp_path, max_epochs=2).fit(model, indexed_datamodule(tmp_path / "data"))
    half = len(model.keys) // 2
    e0, e1 = model.keys[:half], model.keys[half:]
    assert e0 != e1  # set_epoch reached the sampler: a new order
    dm = indexed_datamodule(tmp_path / "data")
    assert [b["keys"] for b in epoch_batches(dm, epoch=1)] == e1


def test_setup_checks_equal_per_sample_reference(tmp_path):
    """setup() checks each distinct (C, T, H, W, D_text) once; the result must equal check_config
    called on every index line (kept samples, their order, skip counts, scheduled tokens)."""
    from collections import Counter
    from lightning_adaptiveload.data.shards import BadSample, check_config

    rng = np.random.default_rng(21)
    for name in ("a.tar", "b.tar"):
        write_shard(tmp_path / name, [])
    lines = [{"key": f"k{i}", "shard": ["a.tar", "b.tar"][i % 2], "members": {"json": [512, 9]},
              "latent_shape": [int(rng.integers(1, 4)), *(int(v) for v in rng.choice([1, 4, 6, 8], 2))],
              "channels": int(rng.choice([C, C, C, 3])),
              "text_shape": None if rng.random() < 0.5 else [L_TEXT, int(rng.choice([D_TEXT, D_TEXT, 7]))]}
             for i in range(300)]
    write_index_lines(tmp_path / "index.jsonl", lines)
    dm = indexed_datamodule(tmp_path, max_seq_len=30, oversize="resize")
    kept, thw, tokens, skipped = [], [], [], Counter()
    for line in lines:
        try:
            shape, seq_len = check_config(line["key"], line["channels"], tuple(line["latent_shape"]),
                                          line["text_shape"] and line["text_shape"][1], spec=TokenSpec(),
                                          latent_channels=C, text_dim=D_TEXT, max_seq_len=30, oversize="resize")
        except BadSample as e:
            skipped[e.reason] += 1
            continue
        kept.append(line["key"])
        thw.append(shape)
        tokens.append(seq_len)
    assert set(skipped) == {"bad_shape", "bad_text"} and dm.skipped == skipped
    assert [row["key"] for row in dm.source.dataset.index] == kept
    np.testing.assert_array_equal(dm.source.sample_keys(), schedule_keys(np.array(thw), np.array(tokens)))
    samples = {r["seq_len"]: r["samples"] for r in dm.bucket_table().rows()}
    assert samples == dict(Counter(dm.source.sample_keys().tolist()))


def test_collate_keeps_the_majority_shape_on_a_collision():
    """A streaming bucket of two unplanned equal-token shapes: the minority is skipped, not whichever
    shape happened to come first; kept latents equal the decoded ones."""
    from lightning_adaptiveload.data.collate import collate_samples

    rng = np.random.default_rng(5)
    shapes = [(1, 4, 8), (1, 8, 4), (1, 8, 4), (1, 8, 4), (1, 4, 8), (1, 8, 4)]
    samples = [{"key": f"k{i}", "latent": torch.from_numpy(rng.standard_normal((C, *s)).astype(np.float16)),
                "text": None, "text_seed": f"k{i}", "latent_shape": s, "seq_len": 8} for i, s in enumerate(shapes)]
    samples.insert(2, {"key": "bad", "skip": "bad_json", "detail": "x"})
    batch = collate_samples(samples, text_len=L_TEXT, text_dim=D_TEXT)
    kept = [s for s in samples if s.get("latent_shape") == (1, 8, 4)]
    assert batch["keys"] == [s["key"] for s in kept] and batch["latent_shape"] == (1, 8, 4)
    assert batch["skipped"] == {"bad_json": 1, "shape_collision": 2}
    torch.testing.assert_close(batch["latents"], torch.stack([s["latent"].float() for s in kept]), rtol=0, atol=0)


def test_spawned_workers_read_correct_samples(tmp_path):
    """A worker started by spawn gets a pickled dataset: it must open shards itself, not reuse
    descriptor numbers of the parent (which name other files there)."""
    written = write_dataset(tmp_path, n=30, shards=3)
    dm = indexed_datamodule(tmp_path, m_mem=200, num_workers=2)
    for i in range(len(dm.source.dataset)):  # the main process opens every shard
        dm.source.dataset[i]
    loader = torch.utils.data.DataLoader(dm.source.dataset, batch_size=None, num_workers=1,
                                         multiprocessing_context="spawn")
    seen = {}
    for sample in loader:
        seen[sample["key"]] = sample["latent"]
    assert len(seen) == 30
    for key, latent in seen.items():
        np.testing.assert_array_equal(latent.float().numpy(), written[key][0])


def test_shards_and_index_through_a_symlinked_folder(tmp_path):
    """Clusters often reach data through symlinks: the index resolves its folder, `shards` is
    given as the link; both name the same shards (was: "refers to samples outside `shards`")."""
    written = write_dataset(tmp_path / "real", n=30)
    (tmp_path / "link").symlink_to(tmp_path / "real", target_is_directory=True)
    dm = indexed_datamodule(tmp_path / "link", m_mem=200)
    keys = [k for b in epoch_batches(dm) for k in b["keys"]]
    assert len(keys) == len(set(keys)) and set(keys) <= set(written)

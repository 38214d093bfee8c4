"""Data integrity (issue 16): what the index knows about its shards, and no silent wrong sample.

One regression test (or a few) per case: resume after re-indexing in another order; a shard
rewritten in place with the same byte layout; NaN/Inf in a text embedding; duplicate keys (twice
in a shard, a shard copied under another name); an absurd member size; a shard deleted after
indexing; every sample of one rank's batch failing (2 processes, gloo)."""
from __future__ import annotations

import io
import json
import logging
import os
import shutil
import socket
import subprocess
import sys
import tarfile
from collections import OrderedDict
from pathlib import Path

import numpy as np
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

import lightning_adaptiveload.data.index as index_mod
from lightning_adaptiveload.cli import main as cli_main
from lightning_adaptiveload.data.index import (build_index, index_fingerprint, read_index, read_members,
                                               scan_shard)
from lightning_adaptiveload.data.shards import (BadSample, decode_sample, encode_sample, resolve_shards,
                                                write_shard)
from lightning_adaptiveload.scheduling.sampler import BucketBatchSampler
from lightning_adaptiveload.scheduling.shapes import TokenSpec
from tests.helpers.data import (C, D_TEXT, DM_ARGS, L_TEXT, KeyRecorder, indexed_datamodule,
                                overwrite_keeping_mtime, trainer, write_dataset)

REPO = Path(__file__).resolve().parents[2]
DECODE = dict(spec=TokenSpec(), latent_channels=C, text_len=L_TEXT, text_dim=D_TEXT, max_seq_len=None)


def reindex(root: Path, order) -> None:
    """Rebuild root/index.jsonl from its shards taken in `order` (positions in the sorted list)."""
    shards = sorted(str(p) for p in root.glob("*.tar"))
    build_index([shards[i] for i in order], root / "index.jsonl", progress=False)


def sample_items(rng, keys, thw=(1, 4, 4), text=True):
    """(key, files, latent) of samples that all have the same member sizes (same shape, same key length)."""
    items = []
    for key in keys:
        latent = rng.standard_normal((C, *thw)).astype(np.float16)
        txt = rng.standard_normal((L_TEXT, D_TEXT)).astype(np.float32) if text else None
        items.append((key, encode_sample(key, latent, {}, txt), latent))
    return items


def member_layout(path) -> list[tuple[int, int]]:
    with tarfile.open(path) as tar:
        return [(info.offset_data, info.size) for info in tar]


def items_of(dm) -> dict[str, dict]:
    """Every indexed sample as the dataset reads it: {key: decoded sample or skip marker}."""
    return {dm.source.dataset.index.key(i): dm.source.dataset[i] for i in range(len(dm.source.dataset))}


# --- 1. resume after re-indexing -----------------------------------------------------------------

def test_fingerprint_names_keys_order_and_scheduled_tokens(tmp_path):
    write_dataset(tmp_path, n=40, shards=4)
    first = read_index(tmp_path / "index.jsonl")
    assert index_fingerprint(first) == index_fingerprint(read_index(tmp_path / "index.jsonl", cache=False))
    reindex(tmp_path, [0, 1, 2, 3])  # the same shards in the same order: the same fingerprint
    assert index_fingerprint(read_index(tmp_path / "index.jsonl")) == index_fingerprint(first)
    reindex(tmp_path, [2, 0, 3, 1])
    again = read_index(tmp_path / "index.jsonl")
    assert sorted(again.key(i) for i in range(len(again))) == sorted(first.key(i) for i in range(len(first)))
    assert index_fingerprint(again) != index_fingerprint(first)
    tokens = np.arange(len(first))
    assert index_fingerprint(first, tokens) != index_fingerprint(first, tokens + 1)
    assert index_fingerprint(first).startswith("40 samples, sha256 ")


def test_resume_against_a_reordered_index_is_refused(tmp_path):
    write_dataset(tmp_path, n=60, shards=3)
    loader = indexed_datamodule(tmp_path).build_train_loader(1, 0)
    state = loader.state_dict()
    state["segments"][-1][1] = 2  # two steps of the epoch consumed
    indexed_datamodule(tmp_path).build_train_loader(1, 0).load_state_dict(state)  # same index: resumes
    reindex(tmp_path, [2, 0, 1])
    other = indexed_datamodule(tmp_path).build_train_loader(1, 0)
    with pytest.raises(ValueError, match="saved for another dataset") as info:
        other.load_state_dict(state)
    assert state["dataset_fingerprint"] in str(info.value)
    assert other.batch_sampler.dataset_fingerprint in str(info.value)


def test_resume_through_a_checkpoint_after_reindexing_is_refused(tmp_path):
    """The issue's case: the same samples indexed again in another order; resuming mid-epoch would
    have trained some twice and others never (59 and 91 of 400 in the report)."""
    write_dataset(tmp_path / "data", n=80, shards=4)
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=3, save_top_k=-1)
    trainer(tmp_path / "a", max_steps=3, callbacks=[ckpt]).fit(KeyRecorder(), indexed_datamodule(tmp_path / "data"))
    path = next((tmp_path / "ckpt").glob("*step=3.ckpt"))
    reindex(tmp_path / "data", [3, 1, 0, 2])
    with pytest.raises(ValueError, match="saved for another dataset"):
        trainer(tmp_path / "b", max_epochs=1).fit(KeyRecorder(), indexed_datamodule(tmp_path / "data"),
                                                   ckpt_path=path)


def test_restarting_the_epoch_without_the_loader_state(tmp_path):
    """What docs/data.md offers after re-indexing mid-epoch: resume from a checkpoint without its loader
    state. Lightning keeps the step count, the loader starts the new index's plan from its start, and
    the epoch ends at its usual length."""
    write_dataset(tmp_path / "data", n=80, shards=4)
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=3, save_top_k=-1)
    trainer(tmp_path / "a", max_steps=3, callbacks=[ckpt]).fit(KeyRecorder(), indexed_datamodule(tmp_path / "data"))
    state = torch.load(next((tmp_path / "ckpt").glob("*step=3.ckpt")), weights_only=False)
    del state["loops"]["fit_loop"]["state_dict"]["combined_loader"]
    torch.save(state, tmp_path / "restart.ckpt")
    reindex(tmp_path / "data", [3, 1, 0, 2])
    model = KeyRecorder()
    trainer(tmp_path / "b", max_epochs=1).fit(model, indexed_datamodule(tmp_path / "data"),
                                              ckpt_path=tmp_path / "restart.ckpt")
    dm = indexed_datamodule(tmp_path / "data")
    new_plan = [b["keys"] for b in map(lambda b: dm.on_before_batch_transfer(b, 0), dm.build_train_loader(1, 0))]
    assert model.keys == new_plan[:len(new_plan) - 3]


def test_sampler_state_without_fingerprint_resumes_with_a_warning(caplog):
    seq_lens = np.random.default_rng(0).integers(4, 64, size=200)
    kw = dict(policy="token_equal", m_mem=256, num_replicas=1, rank=0)
    old = BucketBatchSampler(seq_lens, **kw)  # a sampler made before fingerprints (or without a DataModule)
    state = old.state_dict(steps_consumed=3)
    new = BucketBatchSampler(seq_lens, **kw, dataset_fingerprint="200 samples, sha256 0123456789abcdef")
    with caplog.at_level(logging.WARNING):
        new.load_state_dict(state)
    assert "without checking its dataset" in caplog.text
    assert list(new) == list(old)[3:]  # the rest of the same plan


# --- 2. a shard changed after indexing ------------------------------------------------------------

def two_shards_same_layout(root: Path, rng, keys_b=("b0", "b1", "b2", "b3", "b4")) -> dict:
    """a.tar (5 samples) and b.tar (samples of equal member sizes), indexed. Returns {key: latent}."""
    root.mkdir(parents=True, exist_ok=True)
    written = {}
    for name, keys in (("a", [f"a{i}" for i in range(5)]), ("b", list(keys_b))):
        items = sample_items(rng, keys)
        write_shard(root / f"{name}.tar", [(k, f) for k, f, _ in items])
        written.update({k: lat for k, _, lat in items})
    build_index(resolve_shards(str(root)), root / "index.jsonl", progress=False)
    return written


def rewrite_reordered(path: Path) -> None:
    """Rewrite a shard in place with its samples rotated by one place: the same byte layout (member
    offsets and sizes), other names and bytes at every offset."""
    with tarfile.open(path) as tar:
        names = [m.name for m in tar]
        data = {m.name: tar.extractfile(m).read() for m in tar}
    keys = list(dict.fromkeys(n.split(".", 1)[0] for n in names))
    order = np.roll(np.arange(len(keys)), 1)
    layout = member_layout(path)
    write_shard(path, [(keys[i], {n.split(".", 1)[1]: data[n] for n in names if n.split(".", 1)[0] == keys[i]})
                       for i in order])
    assert member_layout(path) == layout


@pytest.mark.parametrize("long_keys", [False, True])
def test_shard_rewritten_in_place_with_the_same_layout(tmp_path, long_keys):
    """Keys over 100 bytes (PAX records, name field truncated) differ only past byte 100: a check of
    the truncated name would pass them."""
    keys_b = [("x" * 120) + f"b{i}" for i in range(5)] if long_keys else [f"b{i}" for i in range(5)]
    written = two_shards_same_layout(tmp_path, np.random.default_rng(1), keys_b)
    before = os.stat(tmp_path / "b.tar")
    rewrite_reordered(tmp_path / "b.tar")
    # the mtime shows it: setup refuses, naming the shard
    with pytest.raises(ValueError, match=r"1 shards changed after indexing, e\.g\. \['.*b\.tar \(same size, but "
                                         r"another member table"):
        indexed_datamodule(tmp_path)
    # mtime restored (or too coarse to change): every sample of b.tar is skipped, none substituted
    os.utime(tmp_path / "b.tar", ns=(before.st_atime_ns, before.st_mtime_ns))
    items = items_of(indexed_datamodule(tmp_path))
    assert {k for k, item in items.items() if "skip" in item} == set(keys_b)
    assert {item["skip"] for k, item in items.items() if k in keys_b} == {"shard_changed"}
    for key, item in items.items():
        if key not in keys_b:
            np.testing.assert_array_equal(item["latent"].numpy(), written[key])


def test_changed_size_is_refused_and_a_copy_with_a_new_mtime_accepted(tmp_path, caplog):
    written = two_shards_same_layout(tmp_path, np.random.default_rng(2))
    stamp = os.stat(tmp_path / "a.tar").st_mtime_ns + 10**9
    os.utime(tmp_path / "a.tar", ns=(stamp, stamp))  # e.g. copied without keeping mtimes: same member table
    with caplog.at_level(logging.WARNING, logger=index_mod.__name__):
        items = items_of(indexed_datamodule(tmp_path))
    assert "another mtime than when indexed but the same member table" in caplog.text and "a.tar" in caplog.text
    for key, item in items.items():
        np.testing.assert_array_equal(item["latent"].numpy(), written[key])
    with open(tmp_path / "b.tar", "ab") as f:
        f.write(b"\0" * 512)
    with pytest.raises(ValueError, match=r"b\.tar \(\d+ bytes when indexed, \d+ now\)"):
        indexed_datamodule(tmp_path)


def test_gnu_long_names_are_read_and_checked(tmp_path):
    rng = np.random.default_rng(4)
    keys = [("y" * 110) + f"k{i}" for i in range(3)]
    items = sample_items(rng, keys)
    with tarfile.open(tmp_path / "g.tar", "w", format=tarfile.GNU_FORMAT) as tar:
        for key, files, _ in items:
            for suffix in sorted(files):
                info = tarfile.TarInfo(f"{key}.{suffix}")
                info.size = len(files[suffix])
                tar.addfile(info, io.BytesIO(files[suffix]))
    build_index([str(tmp_path / "g.tar")], tmp_path / "index.jsonl", progress=False)
    index = read_index(tmp_path / "index.jsonl")
    assert all(offset - header == 1536 for row in index for offset, _, header in row["members"].values())
    fds = OrderedDict()
    for row, (key, _, latent) in zip(index, items):
        out = decode_sample(key, read_members(fds, row["shard"], row["members"], key), **DECODE)
        np.testing.assert_array_equal(out["latent"].numpy(), latent)
    with pytest.raises(BadSample, match=f"shard_changed: .*the index puts {keys[1]}.latent.npy .* a header of "
                                        f"'{keys[0]}.latent.npy'"):
        read_members(fds, index[0]["shard"], index[0]["members"], keys[1])


# --- 3. NaN / Inf in a text embedding --------------------------------------------------------------

def test_non_finite_text_is_left_out_of_the_index_and_skipped_at_read_time(tmp_path):
    rng = np.random.default_rng(5)
    items = sample_items(rng, [f"t{i}" for i in range(6)])
    for i, bad in ((1, np.nan), (4, -np.inf)):
        text = rng.standard_normal((L_TEXT, D_TEXT)).astype(np.float16)
        text[2, 3] = bad
        items[i] = (items[i][0], encode_sample(items[i][0], items[i][2], {}, text), items[i][2])
    write_shard(tmp_path / "t.tar", [(k, f) for k, f, _ in items])
    with pytest.raises(BadSample, match="non_finite: sample 't1': text embedding holds NaN or inf"):
        decode_sample("t1", items[1][1], **DECODE)
    count, bad = build_index([str(tmp_path / "t.tar")], tmp_path / "index.jsonl", progress=False)
    assert count == 4 and [(b["key"], b["reason"]) for b in bad] == [("t1", "non_finite"), ("t4", "non_finite")]
    # a text embedding that became NaN after indexing (mtime kept) is a counted skip, not a NaN loss
    dm = indexed_datamodule(tmp_path)
    row = next(r for r in dm.source.dataset.index if r["key"] == "t2")
    offset, size, _ = row["members"]["text.npy"]
    overwrite_keeping_mtime(row["shard"], offset + size - 4, np.float32(np.nan).tobytes())
    items = items_of(dm)
    assert items["t2"]["skip"] == "non_finite" and sum("skip" in item for item in items.values()) == 1


# --- 4. duplicate keys -----------------------------------------------------------------------------

def test_duplicate_keys_in_one_shard_keep_the_first(tmp_path):
    rng = np.random.default_rng(6)
    items = sample_items(rng, ["d0", "d1", "d0", "d2", "d2"])  # d0 again later; d2 twice in a row
    write_shard(tmp_path / "s.tar", [(k, f) for k, f, _ in items])
    assert [key for key, *_ in scan_shard(tmp_path / "s.tar")] == ["d0", "d1", "d0", "d2", "d2"]
    count, bad = build_index([str(tmp_path / "s.tar")], tmp_path / "index.jsonl", progress=False)
    assert count == 3 and [(b["key"], b["reason"]) for b in bad] == [("d0", "duplicate_key"), ("d2", "duplicate_key")]
    index = read_index(tmp_path / "index.jsonl")
    fds = OrderedDict()
    for row in index:  # the first occurrence's bytes
        first = next(latent for key, _, latent in items if key == row["key"])
        out = decode_sample(row["key"], read_members(fds, row["shard"], row["members"], row["key"]), **DECODE)
        np.testing.assert_array_equal(out["latent"].numpy(), first)


def test_a_shard_copied_under_another_name(tmp_path, capsys):
    write_dataset(tmp_path / "d", n=30, shards=2)
    shutil.copy(tmp_path / "d" / "shard-0001.tar", tmp_path / "d" / "shard-0001b.tar")
    assert cli_main(["index", str(tmp_path / "d"), "-o", str(tmp_path / "i.jsonl")]) == 0
    out = capsys.readouterr().out
    assert "indexed 30 samples from 3 shards" in out and "duplicate_key=15" in out
    copy, original = tmp_path / "d" / "shard-0001b.tar", tmp_path / "d" / "shard-0001.tar"
    assert f"duplicate keys (first sample kept): 15 samples of {copy} repeat keys of {original}" in out
    assert len(read_index(tmp_path / "i.jsonl")) == 30
    assert cli_main(["index", str(tmp_path / "d"), "-o", str(tmp_path / "j.jsonl"), "--duplicates", "error"]) == 2
    err = capsys.readouterr().err
    assert "adaptiveload index: error: 15 samples repeat a key indexed before" in err and "no index written" in err
    assert not (tmp_path / "j.jsonl").exists() and not (tmp_path / "j.jsonl.partial").exists()


def test_an_index_listing_a_key_twice_is_refused(tmp_path):
    write_dataset(tmp_path, n=20, shards=2)
    lines = (tmp_path / "index.jsonl").read_text().splitlines()
    sample_lines = [i for i, line in enumerate(lines) if '"key"' in line]
    lines.append(lines[sample_lines[3]])  # e.g. two indexes concatenated by hand, headers removed
    (tmp_path / "index.jsonl").write_text("\n".join(lines) + "\n")
    key = json.loads(lines[-1])["key"]
    with pytest.raises(ValueError, match=f"index.jsonl:{len(lines)}: key '{key}' is also on line "
                                         f"{sample_lines[3] + 1}"):
        indexed_datamodule(tmp_path)


# --- 5. absurd member sizes, read errors of any kind ---------------------------------------------

def test_absurd_member_size_is_an_error_at_load(tmp_path):
    write_dataset(tmp_path, n=20, shards=2)
    lines = (tmp_path / "index.jsonl").read_text().splitlines()
    i = next(i for i, line in enumerate(lines) if '"key"' in line)
    row = json.loads(lines[i])
    row["members"]["latent.npy"][1] = 10**12
    lines[i] = json.dumps(row)
    (tmp_path / "index.jsonl").write_text("\n".join(lines) + "\n")
    with pytest.raises(ValueError, match=rf"index.jsonl:{i + 1}: member 'latent.npy' of key '{row['key']}' spans "
                                         r"bytes .* past the end of shard 'shard-0000.tar' \(\d+ bytes when indexed\)"):
        indexed_datamodule(tmp_path)


def test_a_wrong_size_within_the_shard_is_never_read(tmp_path, monkeypatch):
    """A size that passes the bound (up to the shard's end) but is not the member's: the header check
    comes first, so the wrong size is never allocated or read."""
    write_dataset(tmp_path, n=20, shards=1)
    lines = (tmp_path / "index.jsonl").read_text().splitlines()
    shard_size = json.loads(lines[1])["size"]
    i = next(i for i, line in enumerate(lines) if '"key"' in line)
    row = json.loads(lines[i])
    offset = row["members"]["latent.npy"][0]
    row["members"]["latent.npy"][1] = shard_size - offset
    lines[i] = json.dumps(row)
    (tmp_path / "index.jsonl").write_text("\n".join(lines) + "\n")
    dm = indexed_datamodule(tmp_path)
    reads = []
    real_pread = os.pread
    monkeypatch.setattr(index_mod.os, "pread", lambda fd, n, at: reads.append(n) or real_pread(fd, n, at))
    item = dm.source.dataset[0]
    assert item["key"] == row["key"] and item["skip"] == "shard_changed"
    assert shard_size - offset not in reads


@pytest.mark.parametrize("error", [MemoryError(), OSError(5, "Input/output error"), OverflowError("too big")])
def test_any_read_failure_is_a_counted_skip(tmp_path, monkeypatch, error):
    written = write_dataset(tmp_path, n=20, shards=2)
    dm = indexed_datamodule(tmp_path)
    real_pread = os.pread

    def failing(fd, n, at):
        if n > 512:  # data reads of latents and text, not the headers
            raise error
        return real_pread(fd, n, at)
    monkeypatch.setattr(index_mod.os, "pread", failing)
    item = dm.source.dataset[0]
    assert item["skip"] == "read_error" and type(error).__name__ in item["detail"]
    monkeypatch.undo()
    np.testing.assert_array_equal(dm.source.dataset[0]["latent"].numpy(), written[item["key"]][0])


# --- 6. a shard deleted after indexing, an index of the previous format -----------------------------

def test_a_shard_deleted_after_indexing_is_reported_missing(tmp_path):
    write_dataset(tmp_path, n=30, shards=3)
    (tmp_path / "shard-0001.tar").unlink()
    with pytest.raises(FileNotFoundError, match=r"1 shards it lists are missing or unreadable \(deleted or moved "
                                                r"after indexing\?\), e\.g\. \['.*shard-0001\.tar \(No such file"):
        indexed_datamodule(tmp_path)


def test_an_index_of_the_previous_format_asks_for_a_reindex(tmp_path):
    write_dataset(tmp_path, n=10, shards=1)
    v1 = []
    for line in (tmp_path / "index.jsonl").read_text().splitlines():
        row = json.loads(line)
        if "key" in row:  # version 1: no header, no shard records, [offset, size] spans
            v1.append(json.dumps({**row, "members": {s: span[:2] for s, span in row["members"].items()}}))
    (tmp_path / "index.jsonl").write_text("\n".join(v1) + "\n")
    with pytest.raises(ValueError, match=r"index.jsonl:1: this index was written by an older adaptiveload \(format "
                                         r"version 1.*re-run `adaptiveload index`"):
        indexed_datamodule(tmp_path)
    (tmp_path / "index.jsonl").write_text('{"format": "adaptiveload-index", "version": 3}\n')
    with pytest.raises(ValueError, match="index format version 3, this code reads version 2"):
        read_index(tmp_path / "index.jsonl")


# --- 7. every sample of one rank's batch fails ------------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_a_batch_failing_on_one_rank_stops_every_rank(tmp_path):
    """Rank 1's batch at step 1 is unreadable: both ranks raise the same error at step 1 (after
    training step 0). Before, rank 1 raised alone and rank 0 waited in the gradient all-reduce (under
    NCCL until its timeout; gloo here notices the closed connection and fails with its own error)."""
    write_dataset(tmp_path / "data", n=60, shards=2)
    args = {"shards": str(tmp_path / "data"), "index": str(tmp_path / "data" / "index.jsonl"), **DM_ARGS}
    dm = indexed_datamodule(tmp_path / "data")
    plan = dm.build_sampler(num_replicas=2, rank=1).plan()
    assert len(plan.steps) >= 3
    for i in plan.batch(1, 1):  # the latent bytes of every sample rank 1 reads at step 1 (mtime kept)
        offset, _, _ = dm.source.dataset.index.members(int(i))["latent.npy"]
        overwrite_keeping_mtime(dm.source.dataset.index.shard_path(int(i)), offset, b"\0" * 16)
    (tmp_path / "dm_args.json").write_text(json.dumps(args))
    env = {**os.environ, "PYTHONPATH": str(REPO), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
           "WORLD_SIZE": "2", "NODE_RANK": "0"}
    procs = [subprocess.Popen([sys.executable, "-m", "tests.data.integrity_ddp_script", str(tmp_path)], cwd=REPO,
                              env={**env, "LOCAL_RANK": str(r), "RANK": str(r)}, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for r in (0, 1)]
    try:
        logs = [p.communicate(timeout=240)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert [p.returncode for p in procs] == [0, 0], logs
    results = [json.loads((tmp_path / f"result_rank{r}.json").read_text()) for r in (0, 1)]
    for r, result in enumerate(results):
        assert len(result["keys"]) == 1, (r, result)  # step 0 trained, stopped at step 1
        assert result["error"].startswith("every sample of a batch failed to load, on at least one rank"), result
    assert "this rank: bad_latent" in results[1]["error"]
    assert "this rank read its batch" in results[0]["error"]
    for r in (0, 1):  # step 0 of the plan this test computed, trained on both ranks
        assert results[r]["keys"][0] == [dm.source.dataset.index.key(int(i)) for i in plan.batch(0, r)]

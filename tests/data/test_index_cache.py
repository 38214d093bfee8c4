"""Binary cache of a parsed index (`<index>.npz`): a hit equals a fresh parse; a stale, corrupt or
other-version cache is never used; read-only folders, full disks and concurrent writers are safe."""
import errno
import json
import logging
import multiprocessing
import os
import tempfile

import numpy as np
import pytest

import lightning_adaptiveload.data.index as index_mod
import lightning_adaptiveload.data.index_cache as cache_mod
from lightning_adaptiveload.data.datamodule import AdaptiveLoadDataModule
from lightning_adaptiveload.data.index import index_cache_path, read_index
from tests.helpers.data import index_v2_lines, random_index_lines

ARRAYS = ("shard", "member_offset", "member_size", "member_header", "latent_shape", "channels", "text_shape", "tokens",
          "key_blob", "key_end", "shard_size", "shard_mtime_ns", "shard_sha256")


def random_lines(rng, n: int, folder) -> tuple[list[dict], list[str]]:
    """Random index lines (see test_data_shards) whose member offsets all have 9 digits, and the text
    lines of a version-2 index of them in `folder` (`index_v2_lines`)."""
    return index_v2_lines(random_index_lines(rng, n, offsets=(10**8, 10**9 - 512), with_json=True), folder)


def expected_rows(path, lines) -> list[dict]:
    """The lines as SampleIndex rows read, worked out from the JSON alone."""
    base = path.resolve().parent
    return [{**line, "shard": str(base / line["shard"]), "tokens": line.get("tokens", -1),
             "members": {s: tuple(span) for s, span in line["members"].items()}} for line in lines]


def assert_same_index(a, b) -> None:
    assert a.shard_paths == b.shard_paths
    for name in ARRAYS:
        x, y = getattr(a, name), getattr(b, name)
        assert x.dtype == y.dtype and np.array_equal(x, y), name


def forbid_parse(monkeypatch) -> None:
    """From now on parsing fails: what reads the index must come from the cache."""
    monkeypatch.setattr(index_mod, "_parse_index", lambda p: pytest.fail(f"parsed {p} although its cache is valid"))


def index_file(tmp_path, n=50, seed=0):
    lines, text = random_lines(np.random.default_rng(seed), n, tmp_path)
    path = tmp_path / "index.jsonl"
    path.write_text("".join(t + "\n" for t in text))
    return path, lines


def test_cache_hit_equals_fresh_parse(tmp_path, monkeypatch):
    monkeypatch.setattr(index_mod, "_CHUNK_ROWS", 7)  # several packed chunks in the parse
    path, lines = index_file(tmp_path)
    parsed = read_index(path, cache=False)
    assert not index_cache_path(path).exists()  # cache=False writes nothing
    first = read_index(path)  # parses, writes the cache
    assert index_cache_path(path).is_file()
    assert index_cache_path(path).stat().st_mode & 0o777 == path.stat().st_mode & 0o777
    with monkeypatch.context() as m:
        forbid_parse(m)
        cached = read_index(path)
    assert_same_index(cached, parsed)
    assert_same_index(first, parsed)
    assert list(cached) == expected_rows(path, lines)
    rows = np.random.default_rng(1).permutation(len(lines))[:20]
    assert list(cached.take(rows)) == [expected_rows(path, lines)[i] for i in rows]
    assert [p for p in os.listdir(tmp_path) if p.endswith(".tmp")] == []


def test_cache_follows_the_index_folder(tmp_path, monkeypatch):
    """Shard paths are stored as the lines give them: a moved folder (mtime kept) resolves anew."""
    (tmp_path / "a").mkdir()
    path, lines = index_file(tmp_path / "a", n=20)
    read_index(path)
    (tmp_path / "a").rename(tmp_path / "b")
    forbid_parse(monkeypatch)
    moved = tmp_path / "b" / "index.jsonl"
    assert list(read_index(moved)) == expected_rows(moved, lines)


def test_same_size_edit_with_restored_mtime_is_detected_by_the_hash(tmp_path, caplog):
    path, lines = index_file(tmp_path)
    read_index(path)
    before = path.stat()
    old = lines[17]["members"]["json"][0]  # a data offset: moved one block, its header with it (digits kept)
    new = old + 512 if old < 10**9 - 1024 else old - 512
    text = path.read_text()
    assert text.count(f"[{old}, ") == 1 and text.count(f", {old - 512}]") == 1
    path.write_text(text.replace(f"[{old}, ", f"[{new}, ").replace(f", {old - 512}]", f", {new - 512}]"))
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert (path.stat().st_size, path.stat().st_mtime_ns) == (before.st_size, before.st_mtime_ns)
    lines[17]["members"]["json"][0] = new
    lines[17]["members"]["json"][2] = new - 512
    with caplog.at_level(logging.WARNING, logger=cache_mod.__name__):
        index = read_index(path)
    assert index.members(17)["json"] == (new, lines[17]["members"]["json"][1], new - 512)
    assert list(index) == expected_rows(path, lines)
    assert "sha256" in caplog.text
    assert_same_index(read_index(path), read_index(path, cache=False))  # rewritten, and valid


def damaged_caches(good: bytes, rng) -> list[tuple[str, bytes]]:
    """Truncations, flipped bytes anywhere (zip headers, array headers, array data) and junk."""
    damaged = [(f"cut at {n}", good[:n]) for n in (0, 10, len(good) // 2, len(good) - 1)]
    for pos in rng.choice(len(good), size=16, replace=False):
        bad = bytearray(good)
        bad[pos] ^= 0xFF
        damaged.append((f"flip at {pos}", bytes(bad)))
    return damaged + [("junk", rng.bytes(len(good))), ("zip junk", b"PK\x03\x04" + rng.bytes(100))]


def test_corrupt_cache_falls_back_to_the_parse_and_is_rewritten(tmp_path, monkeypatch, caplog):
    path, lines = index_file(tmp_path, n=30)
    read_index(path)
    cache = index_cache_path(path)
    expected = expected_rows(path, lines)
    unused, damaged = [], damaged_caches(cache.read_bytes(), np.random.default_rng(2))
    for name, bad in damaged:
        cache.write_bytes(bad)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger=cache_mod.__name__):
            assert list(read_index(path)) == expected, name
        if "is not used" in caplog.text:
            unused.append(name)
        with monkeypatch.context() as m:  # rewritten (or, a flip in a field zip ignores, still whole)
            forbid_parse(m)
            assert list(read_index(path)) == expected, name
    # the zip's CRC covers every array byte; only a flip in a field zip ignores (e.g. a timestamp) may pass
    assert [name for name, _ in damaged if not name.startswith("flip")] == [n for n in unused if not n.startswith("flip")]
    assert len(unused) >= len(damaged) - 4, unused


def test_other_format_version_is_not_used(tmp_path, monkeypatch, caplog):
    path, lines = index_file(tmp_path, n=10)
    read_index(path)
    monkeypatch.setattr(cache_mod, "CACHE_VERSION", cache_mod.CACHE_VERSION + 1)
    calls = []
    real_parse = index_mod._parse_index
    monkeypatch.setattr(index_mod, "_parse_index", lambda p: calls.append(p) or real_parse(p))
    with caplog.at_level(logging.WARNING, logger=cache_mod.__name__):
        assert list(read_index(path)) == expected_rows(path, lines)
    assert len(calls) == 1 and "format version" in caplog.text
    read_index(path)  # rewritten under the new version: a hit
    assert len(calls) == 1
    with np.load(index_cache_path(path), allow_pickle=False) as npz:
        assert int(npz["version"]) == cache_mod.CACHE_VERSION


@pytest.mark.parametrize("fail_at", ["mkstemp", "savez"])
def test_unwritable_cache_is_skipped_with_one_log_line(tmp_path, monkeypatch, caplog, fail_at):
    """Read-only folder (mkstemp fails; as root chmod does not stop writes, so the error is
    injected) or a full disk while writing: the index is still returned, no file is left."""
    path, lines = index_file(tmp_path, n=10)

    def fail(*args, **kwargs):
        raise OSError(errno.EROFS if fail_at == "mkstemp" else errno.ENOSPC, "injected")
    monkeypatch.setattr(tempfile if fail_at == "mkstemp" else np, fail_at, fail)
    with caplog.at_level(logging.WARNING, logger=cache_mod.__name__):
        assert list(read_index(path)) == expected_rows(path, lines)
    assert len(caplog.records) == 1 and "not written" in caplog.text
    assert sorted(os.listdir(tmp_path)) == ["index.jsonl"]


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into a read-only folder")
def test_read_only_folder(tmp_path, caplog):
    path, lines = index_file(tmp_path, n=10)
    tmp_path.chmod(0o555)
    try:
        with caplog.at_level(logging.WARNING, logger=cache_mod.__name__):
            assert list(read_index(path)) == expected_rows(path, lines)
    finally:
        tmp_path.chmod(0o755)
    assert len(caplog.records) == 1 and not index_cache_path(path).exists()


def test_index_changed_during_the_parse_writes_no_cache(tmp_path, monkeypatch):
    path, lines = index_file(tmp_path, n=10)
    real_parse = index_mod._parse_index

    def parse_then_append(p):
        result = real_parse(p)
        with open(p, "a") as f:
            f.write(json.dumps({**lines[0], "key": "appended"}) + "\n")
        return result
    monkeypatch.setattr(index_mod, "_parse_index", parse_then_append)
    assert len(read_index(path)) == 10
    assert not index_cache_path(path).exists()
    monkeypatch.setattr(index_mod, "_parse_index", real_parse)
    assert len(read_index(path)) == 11


def _read_in_child(path: str, queue) -> None:
    index = read_index(path)
    queue.put([getattr(index, name).tobytes() for name in ARRAYS])


def test_concurrent_readers_and_writers(tmp_path):
    """Processes that start together (ranks) all parse and write; each gets the right index and
    the cache left behind is whole and valid."""
    path, lines = index_file(tmp_path, n=3000, seed=5)
    reference = read_index(path, cache=False)
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_read_in_child, args=(str(path), queue)) for _ in range(4)]
    for p in procs:
        p.start()
    results = [queue.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(timeout=120)
        assert p.exitcode == 0
    for result in results:
        assert result == [getattr(reference, name).tobytes() for name in ARRAYS]
    assert sorted(os.listdir(tmp_path)) == ["index.jsonl", "index.jsonl.npz"]
    with pytest.MonkeyPatch.context() as m:
        forbid_parse(m)
        assert_same_index(read_index(path), reference)


@pytest.mark.parametrize("index_cache", [True, False])
def test_datamodule_index_cache_arg(tmp_path, index_cache):
    mix = tmp_path / "mix.jsonl"
    mix.write_text('{"latent_t": 1, "latent_h": 4, "latent_w": 4, "count": 2}\n{"latent_t": 3, "latent_h": 6, "latent_w": 6}\n')
    args = dict(shards=str(tmp_path / "shards"), index=str(tmp_path / "index.jsonl"), policy="token_equal",
                m_mem=64, latent_channels=4, text_len=5, text_dim=8, num_workers=0, synthesize=20,
                synthesize_shapes=str(mix), index_cache=index_cache)
    dm = AdaptiveLoadDataModule(**args)
    dm.prepare_data()
    dm.setup("fit")
    assert index_cache_path(tmp_path / "index.jsonl").exists() == index_cache
    again = AdaptiveLoadDataModule(**args)
    again.setup("fit")
    assert_same_index(again.source.dataset.index, dm.source.dataset.index)
    assert again.bucket_table().rows() == dm.bucket_table().rows()

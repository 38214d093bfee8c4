"""Sample format, decoding/validation, index and the make-shards / index CLI."""
import io
import json
from collections import OrderedDict
import math
import os
import pickle
import tarfile

import numpy as np
import pytest
import torch

from lightning_adaptiveload.cli import main as cli_main
from lightning_adaptiveload.data.index import build_index, read_index, read_members, scan_shard
from lightning_adaptiveload.data.shards import (BadSample, decode_sample, encode_sample, fit_shape, inspect_sample,
                                                resize_latent, resolve_shards, shape_for_tokens, stand_in_text,
                                                write_shard, write_synthetic_shards, write_text)
from lightning_adaptiveload.scheduling.shapes import ShapeMix, TokenSpec
from tests.helpers.data import Evil, corrupt_cases, index_v2_lines, random_index_lines, tokens_ref

SPEC = TokenSpec()
DECODE = dict(spec=SPEC, latent_channels=4, text_len=6, text_dim=8, max_seq_len=None)


@pytest.mark.parametrize("fmt", ["npy", "pth"])
@pytest.mark.parametrize("dtype", [np.float16, np.float32])
def test_encode_decode_round_trip(fmt, dtype):
    rng = np.random.default_rng(0)
    latent = rng.standard_normal((4, 3, 4, 6)).astype(dtype)
    text = rng.standard_normal((9, 8)).astype(np.float32)  # longer than text_len: truncated
    files = encode_sample("s1", latent, {"caption": "x"}, text, latent_format=fmt)
    out = decode_sample("s1", files, **DECODE)
    assert out["latent"].dtype == torch.from_numpy(latent).dtype  # stored dtype; float32 in the batch
    np.testing.assert_array_equal(out["latent"].float().numpy(), latent.astype(np.float32))
    np.testing.assert_array_equal(write_text(torch.empty(6, 8), out).numpy(), text[:6])
    assert out["latent_shape"] == (3, 4, 6) and out["seq_len"] == tokens_ref(3, 4, 6)
    assert json.loads(files["json"])["latent_shape"] == [3, 4, 6]


def test_short_text_zero_padded_and_missing_text_gets_seeded_stand_in():
    rng = np.random.default_rng(1)
    latent = rng.standard_normal((4, 1, 4, 4)).astype(np.float32)
    short = rng.standard_normal((2, 8)).astype(np.float32)
    text = write_text(torch.full((6, 8), 7.0), decode_sample("a", encode_sample("a", latent, {}, short), **DECODE))
    np.testing.assert_array_equal(text[:2].numpy(), short)
    assert not text[2:].any()
    no_text = write_text(torch.empty(6, 8), decode_sample("b", encode_sample("b", latent, {"caption": "a dog"}), **DECODE))
    again = write_text(torch.empty(6, 8), decode_sample("c", encode_sample("c", latent, {"caption": "a dog"}), **DECODE))
    assert torch.equal(no_text, again) and torch.equal(no_text, stand_in_text("a dog", 6, 8))
    assert no_text.std() > 0.5 and not torch.equal(no_text, stand_in_text("a cat", 6, 8))


def test_every_corruption_is_a_named_bad_sample():
    for name, files, reason in corrupt_cases(np.random.default_rng(2)):
        with pytest.raises(BadSample) as info:
            decode_sample("k", files, **DECODE)
        assert info.value.reason == reason, name


def test_over_max_seq_len_dropped_or_resized():
    rng = np.random.default_rng(3)
    latent = rng.standard_normal((4, 5, 16, 24)).astype(np.float32)  # 5*8*12 = 480 tokens
    files = encode_sample("big", latent)
    with pytest.raises(BadSample, match="over_max_seq_len"):
        decode_sample("big", files, **{**DECODE, "max_seq_len": 100})
    out = decode_sample("big", files, **{**DECODE, "max_seq_len": 100}, oversize="resize")
    t, h, w = out["latent_shape"]
    assert out["latent"].shape == (4, t, h, w) and out["seq_len"] == tokens_ref(t, h, w) <= 100
    assert t == 5 and abs(w / h - 1.5) < 0.5  # spatial downscale first, aspect roughly kept
    # area resampling of a constant field stays constant: the resize is a resample, not garbage
    const = resize_latent(torch.full((2, 5, 16, 24), 3.0), (5, h, w))
    assert torch.allclose(const, torch.full_like(const, 3.0))


@pytest.mark.parametrize("thw,max_seq_len", [((21, 90, 160), 4096), ((81, 4, 4), 10), ((1, 2, 2000), 50),
                                               ((5, 64, 64), 1), ((3, 9, 13), 7)])
def test_fit_shape_fits_budget(thw, max_seq_len):
    spec = TokenSpec(patch=(1, 2, 2))
    t, h, w = fit_shape(thw, spec, max_seq_len)
    assert 1 <= t <= thw[0] and h % 2 == 0 and w % 2 == 0 and h >= 2 and w >= 2
    assert tokens_ref(t, h, w) <= max_seq_len


def test_shape_for_tokens_exact():
    spec = TokenSpec(patch=(2, 2, 2), extra_tokens=3)
    for s in (4, 10, 103, 4099, 75603):
        t, h, w = shape_for_tokens(s, spec)
        assert tokens_ref(t, h, w, (2, 2, 2), 3) == s


def write_mixed_shard(path, rng, n=12, bad=()):
    """n good samples with random shapes; `bad` (name, files) inserted in between. Returns the
    good samples {key: (latent, text)}."""
    good, items = {}, []
    for i in range(n):
        thw = (int(rng.integers(1, 4)), 2 * int(rng.integers(1, 4)), 2 * int(rng.integers(1, 4)))
        latent = rng.standard_normal((4, *thw)).astype(np.float16 if i % 2 else np.float32)
        text = rng.standard_normal((6, 8)).astype(np.float32) if i % 3 else None
        key = f"{path.stem}x{i:03d}"
        good[key] = (latent, text)
        items.append((key, encode_sample(key, latent, {}, text, latent_format="pth" if i % 4 == 1 else "npy")))
    for j, (name, files) in enumerate(bad):
        items.insert(2 * j + 1, (f"bad{name.replace('_', '')}", files))
    write_shard(path, items)
    return good


def test_index_round_trip_and_bad_samples(tmp_path):
    rng = np.random.default_rng(4)
    cases = corrupt_cases(rng)
    # text_dim and channel checks depend on the run's configuration: the index keeps those samples
    config_only = {"wrong_channels", "bad_text_dim"}
    good = write_mixed_shard(tmp_path / "a.tar", rng, bad=[(n, f) for n, f, _ in cases])
    good.update(write_mixed_shard(tmp_path / "b.tar", rng))
    count, bad = build_index(resolve_shards(str(tmp_path)), tmp_path / "index.jsonl", SPEC, progress=False)
    assert count == len(good) + len(config_only)
    assert sorted(b["reason"] for b in bad) == sorted(r for n, _, r in cases if n not in config_only)
    rows = read_index(tmp_path / "index.jsonl")
    fds = OrderedDict()
    for row in rows:
        if row["key"] not in good:
            continue
        latent, text = good[row["key"]]
        assert row["latent_shape"] == list(latent.shape[1:]) and row["tokens"] == tokens_ref(*latent.shape[1:])
        out = decode_sample(row["key"], read_members(fds, row["shard"], row["members"], row["key"]), **DECODE)
        np.testing.assert_array_equal(out["latent"].numpy(), latent.astype(np.float32))


def test_interrupted_index_leaves_no_file(tmp_path, monkeypatch):
    import lightning_adaptiveload.data.index as index_mod
    rng = np.random.default_rng(9)
    for i in range(3):
        write_mixed_shard(tmp_path / f"s{i}.tar", rng, n=4)
    calls = []

    def inspect_then_stop(key, files):
        calls.append(key)
        if len(calls) == 6:  # the middle of the second shard: lines already written
            raise KeyboardInterrupt
        return inspect_sample(key, files)

    monkeypatch.setattr(index_mod, "inspect_sample", inspect_then_stop)
    with pytest.raises(KeyboardInterrupt):
        build_index(resolve_shards(str(tmp_path)), tmp_path / "index.jsonl", SPEC, progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s0.tar", "s1.tar", "s2.tar"]
    monkeypatch.undo()
    assert build_index(resolve_shards(str(tmp_path)), tmp_path / "index.jsonl", SPEC, progress=False)[0] == 12
    assert len(read_index(tmp_path / "index.jsonl")) == 12


def test_read_members_keeps_few_files_open(tmp_path, monkeypatch):
    import lightning_adaptiveload.data.index as index_mod
    monkeypatch.setattr(index_mod, "MAX_OPEN_SHARDS", 2)
    rng = np.random.default_rng(8)
    good = {}
    for i in range(5):
        good.update(write_mixed_shard(tmp_path / f"s{i}.tar", rng, n=3))
    build_index(resolve_shards(str(tmp_path)), tmp_path / "index.jsonl", SPEC, progress=False)
    fds = OrderedDict()
    for row in list(read_index(tmp_path / "index.jsonl")) * 2:
        out = decode_sample(row["key"], read_members(fds, row["shard"], row["members"], row["key"]), **DECODE)
        np.testing.assert_array_equal(out["latent"].float().numpy(), good[row["key"]][0].astype(np.float32))
        assert len(fds) <= 2
    assert len(set(fds.values())) == len(fds)


def test_read_members_io_error_is_a_bad_sample(tmp_path):
    fds = OrderedDict([(str(tmp_path), os.open(tmp_path, os.O_RDONLY))])  # pread on a folder: EISDIR
    with pytest.raises(BadSample, match="read_error: .*member json at byte 0: IsADirectoryError"):
        read_members(fds, str(tmp_path), {"json": (512, 10, 0)}, "k")
    os.close(fds[str(tmp_path)])


def test_truncated_tar_keeps_samples_before_the_cut(tmp_path):
    rng = np.random.default_rng(5)
    good = write_mixed_shard(tmp_path / "t.tar", rng, n=6)
    data = (tmp_path / "t.tar").read_bytes()
    offsets = [(info.offset_data, info.size) for info in tarfile.open(tmp_path / "t.tar")]
    cut = offsets[7][0] + offsets[7][1] // 2  # inside the member of the third sample
    (tmp_path / "t.tar").write_bytes(data[:cut])
    results = list(scan_shard(tmp_path / "t.tar"))
    assert [r[0] for r in results if r[3] is None] == list(good)[:2]
    assert results[-1][3].reason == "read_error"
    (tmp_path / "garbage.tar").write_bytes(b"this is not a tar file" * 40)
    assert [r[3].reason for r in scan_shard(tmp_path / "garbage.tar")] == ["read_error"]


def test_resolve_shards_lists_each_file_once_in_order(tmp_path):
    for name in ("a", "b", "c"):
        write_shard(tmp_path / f"{name}.tar", [])
    tars = [str(tmp_path / f"{name}.tar") for name in ("a", "b", "c")]
    assert resolve_shards([str(tmp_path / "{b,c}.tar"), str(tmp_path), tars[1]]) == [tars[1], tars[2], tars[0]]
    assert resolve_shards(str(tmp_path / "{a..c}.tar")) == tars


def test_resolve_shards_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="missing or unreadable"):
        resolve_shards(str(tmp_path / "s-{0..2}.tar"))
    with pytest.raises(FileNotFoundError, match="holds no .tar"):
        resolve_shards(str(tmp_path))
    with pytest.raises(ValueError, match="no shards"):
        resolve_shards([])


def test_read_index_errors(tmp_path):
    bad = tmp_path / "i.jsonl"
    _, text = index_v2_lines([{"key": "a", "shard": "x.tar", "members": {}, "latent_shape": [1, 2, 2], "channels": 4}],
                             tmp_path)
    bad.write_text("\n".join(text) + "\n{oops\n")
    with pytest.raises(ValueError, match=r"i.jsonl:4: not valid JSON"):
        read_index(bad)
    bad.write_text("\n".join(text).replace("[1, 2, 2]", "[1, 2]") + "\n")
    with pytest.raises(ValueError, match="i.jsonl:3: field 'latent_shape'"):
        read_index(bad)
    bad.write_text("\n".join(text[:1] + text[2:]) + "\n")  # no shard record
    with pytest.raises(ValueError, match="i.jsonl:2: shard 'x.tar' has no shard record on an earlier line"):
        read_index(bad)
    bad.write_text("\n".join(text[:2] + text[1:]) + "\n")
    with pytest.raises(ValueError, match="i.jsonl:3: a second shard record for 'x.tar'"):
        read_index(bad)
    bad.write_text("\n".join(text + ['{"shard": "y.tar"}']) + "\n")
    with pytest.raises(ValueError, match="i.jsonl:4: neither a sample line"):
        read_index(bad)
    with pytest.raises(FileNotFoundError):
        read_index(tmp_path / "nope.jsonl")


def test_read_index_columns_equal_the_lines(tmp_path, monkeypatch):
    import lightning_adaptiveload.data.index as index_mod
    monkeypatch.setattr(index_mod, "_CHUNK_ROWS", 7)  # several packed chunks and a partial last one
    lines, text = index_v2_lines(random_index_lines(np.random.default_rng(11), 40), tmp_path)
    path = tmp_path / "i.jsonl"
    path.write_text("".join(t + "\n" + ("\n" if i % 9 == 0 else "") for i, t in enumerate(text)))
    expected = [{**line, "shard": str(tmp_path.resolve() / line["shard"]), "tokens": line.get("tokens", -1),
                 "members": {s: tuple(span) for s, span in line["members"].items()}} for line in lines]
    index = read_index(path)
    assert len(index) == len(lines) and list(index) == expected and index[-1] == expected[-1]
    assert index.key(-1) == lines[-1]["key"] and index.key(-len(lines)) == lines[0]["key"]
    assert len(index.shard_paths) == 3
    rows = np.random.default_rng(12).permutation(len(lines))[:25]
    assert list(index.take(rows)) == [expected[i] for i in rows]
    assert len(index.take(np.array([], dtype=np.int64))) == 0
    with pytest.raises(IndexError):
        index[len(lines)]


@pytest.mark.parametrize("change, message", [
    ({"members": {"latent.mp4": [512, 1, 0]}}, "suffix 'latent.mp4'"),
    ({"members": {"json": [512, -1, 0]}}, "member 'json' must be"),
    ({"members": {"json": [512, 10]}}, "member 'json' must be"),
    ({"members": {"json": [1000, 10, 0]}}, "multiples of 512 bytes"),
    ({"members": {"json": [512, 10, 512]}}, "multiples of 512 bytes"),
    ({"members": {"json": [512, 10**12, 0]}}, r"spans bytes \[512, 1000000000512\), past the end of shard 'x.tar'"),
    ({"shard": "y.tar"}, "shard 'y.tar' has no shard record"),
    ({"latent_shape": [0, 2, 2]}, "latent_shape"),
    ({"latent_shape": [1, "2", 2]}, "latent_shape"),
    ({"text_shape": [3]}, "text_shape"),
    ({"tokens": "12"}, "tokens"),
    ({"channels": True}, "channels"),
])
def test_read_index_rejects_bad_fields(tmp_path, change, message):
    good = {"key": "a", "shard": "x.tar", "members": {"json": [512, 10]}, "latent_shape": [1, 2, 2], "channels": 4}
    _, text = index_v2_lines([good], tmp_path)
    path = tmp_path / "i.jsonl"
    path.write_text("\n".join(text) + "\n" + json.dumps({**good, "key": "b", **change}) + "\n")
    with pytest.raises(ValueError, match=f"i.jsonl:4: .*{message}"):
        read_index(path)


def test_synthetic_shards_follow_the_mix(tmp_path):
    mix = ShapeMix(tokens=np.array([16, 8, 200]), counts=np.array([700, 300, 1]),
                   latent_thw=np.array([[1, 8, 8], [1, 4, 8], [-1, -1, -1]]))
    paths = write_synthetic_shards(mix, 300, tmp_path, spec=SPEC, samples_per_shard=64, seed=1, latent_channels=4,
                                   text_len=3, text_dim=8, progress=False)
    assert [p.name for p in paths] == [f"shard-{i:06d}.tar" for i in range(5)]
    count, bad = build_index([str(p) for p in paths], tmp_path / "i.jsonl", SPEC, progress=False)
    rows = read_index(tmp_path / "i.jsonl")
    assert count == 300 and not bad and all(r["text_shape"] == [3, 8] for r in rows)
    shapes = [tuple(r["latent_shape"]) for r in rows]
    frac = shapes.count((1, 8, 8)) / 300
    assert abs(frac - 0.7) < 4 * math.sqrt(0.21 / 300)  # binomial, 4 sigma
    assert set(shapes) <= {(1, 8, 8), (1, 4, 8), shape_for_tokens(200, SPEC)}
    out = decode_sample(rows[0]["key"], read_members(OrderedDict(), rows[0]["shard"], rows[0]["members"], rows[0]["key"]), **{**DECODE, "text_dim": 8})
    assert 0.7 < out["latent"].float().std() < 1.3  # N(0, 1) data, not zeros


def test_interrupted_synthesis_leaves_no_tar(tmp_path, monkeypatch):
    import lightning_adaptiveload.data.shards as shards_mod
    mix = ShapeMix(tokens=np.array([16]), counts=np.array([1]), latent_thw=np.array([[1, 8, 8]]))
    real, calls = shards_mod.encode_sample, []

    def encode_then_stop(*args, **kwargs):
        calls.append(1)
        if len(calls) == 10:  # in the third shard
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(shards_mod, "encode_sample", encode_then_stop)
    with pytest.raises(KeyboardInterrupt):
        write_synthetic_shards(mix, 20, tmp_path, spec=SPEC, samples_per_shard=4, latent_channels=4, progress=False)
    assert not list(tmp_path.glob("*.tar"))
    monkeypatch.undo()
    paths = write_synthetic_shards(mix, 20, tmp_path, spec=SPEC, samples_per_shard=4, latent_channels=4, progress=False)
    assert sorted(tmp_path.glob("*.tar")) == paths and build_index(paths, tmp_path / "i.jsonl", SPEC, progress=False)[0] == 20


def test_cli_make_shards_and_index(tmp_path, capsys):
    shapes = tmp_path / "mix.jsonl"
    shapes.write_text('{"frames": 1, "height": 64, "width": 64, "count": 3}\n{"frames": 17, "height": 32, "width": 48}\n')
    assert cli_main(["make-shards", "--shapes", str(shapes), "--n", "20", "--out", str(tmp_path / "s"),
                     "--samples-per-shard", "8", "--latent-channels", "4"]) == 0
    assert cli_main(["index", str(tmp_path / "s/shard-{000000..000002}.tar"), "-o", str(tmp_path / "i.jsonl")]) == 0
    rows = read_index(tmp_path / "i.jsonl")
    assert len(rows) == 20 and {tuple(r["latent_shape"]) for r in rows} <= {(1, 8, 8), (5, 4, 6)}
    # a shard of only bad samples: reported, no index rows, exit status 1
    write_shard(tmp_path / "bad.tar", [("z", {"json": b"{"})])
    assert cli_main(["index", str(tmp_path / "bad.tar"), "-o", str(tmp_path / "j.jsonl"),
                     "--bad", str(tmp_path / "bad.jsonl")]) == 1
    out = capsys.readouterr().out
    assert "bad_json=1" in out
    assert json.loads((tmp_path / "bad.jsonl").read_text())["reason"] == "bad_json"


def test_cli_index_and_make_shards_bad_input_exit_2(tmp_path, capsys):
    assert cli_main(["index", str(tmp_path / "missing.tar"), "-o", str(tmp_path / "i.jsonl")]) == 2
    assert "adaptiveload index: error:" in capsys.readouterr().err
    (tmp_path / "mix.jsonl").write_text('{"tokens": 0}\n')
    assert cli_main(["make-shards", "--shapes", str(tmp_path / "mix.jsonl"), "--n", "3", "--out", str(tmp_path)]) == 2
    assert "mix.jsonl:1: field 'tokens' must be an integer >= 1" in capsys.readouterr().err


def test_no_pickle_payload_runs(tmp_path, capsys):
    buf = io.BytesIO()
    pickle.dump(Evil(), buf)
    with pytest.raises(BadSample):
        decode_sample("k", {"json": b'{"latent_shape": [1, 2, 2]}', "latent.npy": buf.getvalue()}, **DECODE)
    assert "pwned" not in capsys.readouterr().out


def test_empty_prompt_round_trip_and_errors(tmp_path):
    from lightning_adaptiveload.data.shards import EMPTY_PROMPT_FILE, read_empty_prompt, write_empty_prompt

    embedding = np.random.default_rng(3).standard_normal((2, 16)).astype(np.float16)
    path = write_empty_prompt(tmp_path, embedding)
    assert path == tmp_path / EMPTY_PROMPT_FILE
    np.testing.assert_array_equal(read_empty_prompt(tmp_path), embedding)
    np.testing.assert_array_equal(read_empty_prompt(path), embedding)
    with pytest.raises(ValueError, match="finite float16/float32"):
        write_empty_prompt(tmp_path, np.full((1, 4), np.nan, dtype=np.float32))
    (tmp_path / "bad").mkdir()
    with pytest.raises(ValueError, match="cannot read"):
        read_empty_prompt(tmp_path / "bad")
    np.save(tmp_path / "bad" / EMPTY_PROMPT_FILE, np.zeros(4, dtype=np.float32))
    with pytest.raises(ValueError, match=r"\(4,\)"):
        read_empty_prompt(tmp_path / "bad")

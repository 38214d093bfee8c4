"""Shared data-test helpers: a small mixed-shape dataset on disk, corrupt sample cases, random
index lines, a token-count reference and a CPU trainer."""
import io
import json
import math

import lightning as L
import numpy as np
import torch

from lightning_adaptiveload.data.index import build_index
from lightning_adaptiveload.data.shards import encode_sample, write_shard


def tokens_ref(t, h, w, patch=(1, 2, 2), extra=0):
    return math.ceil(t / patch[0]) * (h // patch[1]) * (w // patch[2]) + extra


def npy(array) -> bytes:
    buf = io.BytesIO()
    np.save(buf, array, allow_pickle=True)
    return buf.getvalue()


def good_files(rng, thw=(3, 4, 6), dtype=np.float16, text=True):
    latent = rng.standard_normal((4, *thw)).astype(dtype)
    txt = rng.standard_normal((5, 8)).astype(np.float32) if text else None
    return latent, txt, encode_sample("k", latent, {"caption": "a cat"}, txt)


class Evil:
    def __reduce__(self):
        return (print, ("pwned",))


def corrupt_cases(rng):
    """(name, files, expected reason) for every way a sample can be bad."""
    latent, _, files = good_files(rng)
    meta = files["json"]
    buf = io.BytesIO()
    torch.save({"not": "a tensor", "evil": Evil()}, buf)
    shape_mismatch = dict(files, json=json.dumps({"latent_shape": [3, 4, 8]}).encode())
    nan = latent.astype(np.float32)
    nan[0, 0, 0, 0] = np.nan
    return [
        ("missing_latent", {"json": meta}, "missing_latent"),
        ("missing_json", {"latent.npy": files["latent.npy"]}, "missing_json"),
        ("bad_json", dict(files, json=b"{not json"), "bad_json"),
        ("json_not_object", dict(files, json=b"[1, 2]"), "bad_json"),
        ("json_bad_shape", dict(files, json=b'{"latent_shape": [3, 4]}'), "bad_json"),
        ("bad_ndim", dict(files, **{"latent.npy": npy(latent[0]), "json": meta}), "bad_ndim"),
        ("bad_dtype_int", dict(files, **{"latent.npy": npy(latent.astype(np.int32))}), "bad_dtype"),
        ("bad_dtype_f64", dict(files, **{"latent.npy": npy(latent.astype(np.float64))}), "bad_dtype"),
        ("pickled_npy", dict(files, **{"latent.npy": npy(np.array([Evil()], dtype=object))}), "bad_latent"),
        ("pickled_pth", {"json": meta, "latent.pth": buf.getvalue()}, "bad_latent"),
        ("garbage_npy", dict(files, **{"latent.npy": b"\x93NUMPY garbage"}), "bad_latent"),
        ("shape_mismatch", shape_mismatch, "bad_shape"),
        ("wrong_channels", encode_sample("k", rng.standard_normal((3, 3, 4, 6)).astype(np.float32)), "bad_shape"),
        ("below_one_patch", encode_sample("k", rng.standard_normal((4, 1, 1, 6)).astype(np.float32)), "bad_shape"),
        ("non_finite", dict(files, **{"latent.npy": npy(nan)}), "non_finite"),
        ("bad_text_dim", dict(files, **{"text.npy": npy(np.ones((5, 7), np.float32))}), "bad_text"),
        ("bad_text_pickle", dict(files, **{"text.npy": npy(np.array([Evil()], dtype=object))}), "bad_text"),
    ]


def random_index_lines(rng, n: int, offsets: tuple[int, int] = (0, 2**40), with_json: bool = False) -> list[dict]:
    """Index lines with every optional part varied: key lengths and non-ASCII keys, member subsets,
    absolute and relative shards, text or none, tokens or none. Member offsets are drawn from
    `offsets`; `with_json` makes every line have a json member."""
    suffixes = ["latent.npy", "latent.pth", "json", "text.npy"]
    lines = []
    for i in range(n):
        members = {s: [int(rng.integers(*offsets)), int(rng.integers(0, 2**33))]
                   for s in suffixes if rng.random() < 0.6}
        if with_json:
            members.setdefault("json", [int(rng.integers(*offsets)), 60])
        line = {"key": f"dir{i % 3}/s{i}" + "é" * int(rng.integers(0, 3)) + "x" * int(rng.integers(0, 30)),
                "shard": str(["a.tar", "sub/b.tar", "/abs/c.tar"][rng.integers(3)]), "members": members,
                "latent_shape": [int(v) for v in rng.integers(1, 100, 3)], "channels": int(rng.integers(1, 64)),
                "text_shape": None if rng.random() < 0.5 else [int(v) for v in rng.integers(1, 5000, 2)]}
        if rng.random() < 0.8:
            line["tokens"] = int(rng.integers(1, 10**6))
        lines.append(line)
    return lines


C, L_TEXT, D_TEXT = 4, 5, 8


# (T, H, W) latents; (1, 4, 8) and (1, 8, 4) share 8 tokens, (3, 6, 6) has 27 and (1, 6, 18) too
SHAPES = [(1, 4, 4), (1, 4, 8), (1, 8, 4), (3, 6, 6), (1, 6, 18), (5, 8, 8)]


def write_dataset(root, n=60, shards=3, seed=0, text_every=2):
    """Random latents of SHAPES in `shards` tars plus an index. Returns {key: (latent f32, text or None)}."""
    rng = np.random.default_rng(seed)
    written, per_shard = {}, math.ceil(n / shards)
    root.mkdir(parents=True, exist_ok=True)
    for s in range(shards):
        items = []
        for i in range(s * per_shard, min(n, (s + 1) * per_shard)):
            thw = SHAPES[int(rng.integers(len(SHAPES)))]
            latent = rng.standard_normal((C, *thw)).astype(np.float16)
            text = rng.standard_normal((L_TEXT, D_TEXT)).astype(np.float32) if i % text_every == 0 else None
            key = f"s{i:05d}"
            written[key] = (latent.astype(np.float32), text)
            items.append((key, encode_sample(key, latent, {"caption": f"c{i}"}, text)))
        write_shard(root / f"shard-{s:04d}.tar", items)
    build_index([str(p) for p in sorted(root.glob("*.tar"))], root / "index.jsonl", progress=False)
    return written


class KeyRecorder(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(C, 1)
        self.keys = []

    def training_step(self, batch, batch_idx):
        self.keys.append(list(batch["keys"]))
        x = batch["latents"].mean(dim=(2, 3, 4))
        return self.layer(x).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def trainer(tmp_path, **kw):
    return L.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                     enable_model_summary=False, default_root_dir=tmp_path, **kw)


def index_v2_lines(lines: list[dict], folder) -> tuple[list[dict], list[str]]:
    """Sample lines written by hand (spans [offset, size], as `random_index_lines` makes them) as a
    version-2 index in `folder` holds them: (the lines with each span [data offset moved up to a
    512-byte block, size, header offset one block before], the file's text lines: the header line,
    and a shard record before each shard's first sample). A shard that exists (relative to `folder`)
    gets its real record (`shard_record`); others a record whose size covers every member."""
    from pathlib import Path
    from lightning_adaptiveload.data.index import INDEX_FORMAT, INDEX_VERSION, member_table_sha256, shard_record

    out, text, recorded = [], [json.dumps({"format": INDEX_FORMAT, "version": INDEX_VERSION})], set()
    for line in lines:
        members = {}
        for suffix, (offset, size, *_) in line["members"].items():
            offset = max(512, -(-offset // 512) * 512)
            members[suffix] = [offset, size, offset - 512]
        out.append({**line, "members": members})
    for line in out:
        shard = line["shard"]
        if shard not in recorded:
            recorded.add(shard)
            path = Path(folder) / shard
            if path.is_file():
                record = shard_record(shard, path.stat(), member_table_sha256(path))
            else:
                end = max((o + n for row in out if row["shard"] == shard for o, n, _ in row["members"].values()),
                          default=0)
                record = {"shard": shard, "size": end, "mtime_ns": 0, "member_table_sha256": "0" * 64}
            text.append(json.dumps(record))
        text.append(json.dumps(line))
    return out, text


def write_index_lines(path, lines: list[dict]) -> list[dict]:
    """Write hand-made sample lines as a version-2 index file at `path` (see `index_v2_lines`);
    returns the lines as written."""
    out, text = index_v2_lines(lines, path.parent)
    path.write_text("".join(t + "\n" for t in text))
    return out


DM_ARGS = dict(policy="token_equal", m_mem=128, latent_channels=C, text_len=L_TEXT, text_dim=D_TEXT, num_workers=0,
               seed=3)


def indexed_datamodule(root, **kw):
    """The map-style AdaptiveLoadDataModule of `write_dataset(root)` (DM_ARGS, overridden by `kw`), set up."""
    from lightning_adaptiveload.data.datamodule import AdaptiveLoadDataModule
    dm = AdaptiveLoadDataModule(**{"shards": str(root), "index": str(root / "index.jsonl"), **DM_ARGS, **kw})
    dm.setup("fit")
    return dm


def overwrite_keeping_mtime(path, offset: int, data: bytes) -> None:
    """Write `data` at byte `offset` of `path` in place, then restore its mtime: a change that size and
    mtime do not show (bit rot, or a writer that keeps timestamps)."""
    import os
    before = os.stat(path)
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))

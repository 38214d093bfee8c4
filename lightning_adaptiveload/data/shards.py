"""The shard sample format: encode, write, decode and validate one sample.

A shard is a plain tar (WebDataset layout). One sample is the tar members sharing a key:

- `<key>.latent.npy`  (C, T, H, W) float16/float32 array (`np.save`; read with allow_pickle=False), or
  `<key>.latent.pth`  (C, T, H, W) float16/bfloat16/float32 tensor (`torch.save`; weights_only=True)
- `<key>.json`        {"latent_shape": [T, H, W], optional "frames"/"height"/"width" (pixels),
                       optional "caption"}
- `<key>.text.npy`    optional (L, D_text) float16/float32 text embedding

Beside the shards, `empty_prompt.text.npy` (optional) holds the text encoder's output for the empty
prompt, what caption dropout trains on (`write_empty_prompt`, `read_empty_prompt`).

Keys hold no dots: WebDataset splits a member name at the first dot of its basename.
Decoding never unpickles: `.npy` via np.load(allow_pickle=False), `.pth` via
torch.load(weights_only=True), JSON via json.loads; other members are ignored.
"""
from __future__ import annotations

import functools
import io
import json
import os
import tarfile
import zlib
from collections import Counter
from pathlib import Path

import braceexpand
import numpy as np
import torch
import torch.nn.functional as F

from tqdm import tqdm

from lightning_adaptiveload.scheduling.shapes import ShapeMix, TokenSpec

LATENT_SUFFIXES = ("latent.npy", "latent.pth")
META_SUFFIX = "json"
TEXT_SUFFIX = "text.npy"
MEMBER_SUFFIXES = LATENT_SUFFIXES + (META_SUFFIX, TEXT_SUFFIX)
NPY_DTYPES = (np.float16, np.float32)
PTH_DTYPES = (torch.float16, torch.bfloat16, torch.float32)

# Why a sample was skipped (keys of the DataModule's `skipped` counter).
SKIP_REASONS = (
    "read_error",        # tar truncated or unreadable, member bytes unavailable (any read failure)
    "shard_changed",     # the tar header at an indexed offset names another member: shard rewritten after indexing
    "missing_latent",    # no .latent.npy/.latent.pth member
    "missing_json",      # no .json member
    "bad_json",          # JSON undecodable, not an object, or latent_shape malformed
    "bad_latent",        # latent bytes undecodable
    "bad_ndim",          # latent is not (C, T, H, W)
    "bad_dtype",         # latent dtype not float16/float32 (npy) or float16/bfloat16/float32 (pth)
    "bad_shape",         # latent (T, H, W) differs from the JSON, wrong C, or below one patch
    "non_finite",        # latent or text embedding holds NaN or inf
    "bad_text",          # text embedding undecodable, not (L, D_text), or not float
    "over_max_seq_len",  # tokens above max_seq_len with oversize="drop"
    "shape_collision",   # streaming: an unplanned shape shared a bucket with another shape
)
STAND_IN_VOCAB = 1024  # rows of the stand-in text embedding table
SKIPPED_KEY = "skipped"  # batch entry carrying skip counts out of DataLoader workers
FAILED_KEY = "failed"  # entry of the marker a collate returns for a batch whose every sample failed


class BadSample(ValueError):
    """A sample that fails validation; `reason` is one of SKIP_REASONS."""

    def __init__(self, reason: str, detail: str):
        assert reason in SKIP_REASONS, reason
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


def resolve_shards(shards: str | list[str]) -> list[str]:
    """Tar paths of a brace pattern ("dir/shard-{000000..000009}.tar"), a folder (its *.tar,
    sorted), or a list of either, each file once (first spelling kept: overlapping patterns
    would otherwise index or stream its samples twice). Raises a clear error for missing or
    unreadable paths."""
    if isinstance(shards, (str, Path)):
        shards = [shards]
    if not shards:
        raise ValueError("no shards given (empty shard list)")
    paths = []
    for pattern in shards:
        for path in braceexpand.braceexpand(str(pattern)):
            if Path(path).is_dir():
                found = sorted(str(p) for p in Path(path).glob("*.tar"))
                if not found:
                    raise FileNotFoundError(f"shard folder {path!r} holds no .tar files")
                paths.extend(found)
            else:
                paths.append(path)
    missing = [p for p in paths if not os.access(p, os.R_OK) or not Path(p).is_file()]
    if missing:
        raise FileNotFoundError(f"{len(missing)} of {len(paths)} shards missing or unreadable, e.g. {missing[:3]}")
    unique: dict[str, str] = {}
    for path in paths:
        unique.setdefault(os.path.realpath(path), path)
    return list(unique.values())


# --- encoding and writing ------------------------------------------------------------------

def _npy_bytes(array: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, np.ascontiguousarray(array), allow_pickle=False)
    return buf.getvalue()


def encode_sample(key: str, latent: np.ndarray, meta: dict | None = None, text: np.ndarray | None = None,
                  latent_format: str = "npy") -> dict[str, bytes]:
    """Member suffix -> bytes for one sample. `latent` is (C, T, H, W); `meta` gets
    "latent_shape" filled in from it; `latent_format` is "npy" or "pth"."""
    if not key or "." in key or "/" in key:
        raise ValueError(f"sample key must be non-empty without '.' or '/', got {key!r}")
    if latent.ndim != 4:
        raise ValueError(f"sample {key!r}: latent must be (C, T, H, W), got shape {latent.shape}")
    meta = dict(meta or {})
    meta["latent_shape"] = [int(v) for v in latent.shape[1:]]
    files = {META_SUFFIX: json.dumps(meta).encode()}
    if latent_format == "npy":
        files["latent.npy"] = _npy_bytes(latent)
    elif latent_format == "pth":
        buf = io.BytesIO()
        torch.save(torch.from_numpy(np.ascontiguousarray(latent)), buf)
        files["latent.pth"] = buf.getvalue()
    else:
        raise ValueError(f"latent_format must be 'npy' or 'pth', got {latent_format!r}")
    if text is not None:
        files[TEXT_SUFFIX] = _npy_bytes(text)
    return files


def write_shard(path: str | Path, samples) -> int:
    """Write an iterable of (key, {suffix: bytes}) to a tar at `path`; returns the sample count.
    Members are written in a fixed order with mtime 0, so equal input gives an equal file."""
    count = 0
    with tarfile.open(path, "w") as tar:
        for key, files in samples:
            for suffix in sorted(files):
                info = tarfile.TarInfo(f"{key}.{suffix}")
                info.size = len(files[suffix])
                info.mode = 0o644
                tar.addfile(info, io.BytesIO(files[suffix]))
            count += 1
    return count


EMPTY_PROMPT_FILE = "empty_prompt.text.npy"  # beside the shards: the text encoder's output for ""


def write_empty_prompt(folder: str | Path, embedding: np.ndarray) -> Path:
    """Write the empty prompt's (L, D_text) float16/float32 text embedding to `folder`/EMPTY_PROMPT_FILE
    (atomically), what caption dropout trains on in place of a caption; returns the path."""
    embedding = np.asarray(embedding)
    if embedding.ndim != 2 or embedding.dtype not in NPY_DTYPES or not np.isfinite(embedding).all():
        raise ValueError(f"empty prompt embedding must be a finite float16/float32 (L, D_text) array, got "
                         f"{embedding.dtype} {embedding.shape}")
    path = Path(folder) / EMPTY_PROMPT_FILE
    partial = path.with_name(path.name + ".partial")
    partial.write_bytes(_npy_bytes(embedding))
    os.replace(partial, path)
    return path


def read_empty_prompt(path: str | Path) -> np.ndarray:
    """The (L, D_text) empty-prompt embedding at `path` (a file, or a folder holding EMPTY_PROMPT_FILE);
    ValueError naming the file when it is missing, unreadable or not a finite 2-D float array."""
    path = Path(path)
    if path.is_dir():
        path = path / EMPTY_PROMPT_FILE
    try:
        array = _load_npy(path.read_bytes())
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: cannot read the empty prompt's embedding ({e})") from None
    if array.ndim != 2 or array.dtype not in NPY_DTYPES or not np.isfinite(array).all():
        raise ValueError(f"{path}: the empty prompt's embedding must be a finite float16/float32 (L, D_text) array, "
                         f"got {array.dtype} {array.shape}")
    return array


# --- decoding and validation ---------------------------------------------------------------

def _load_npy(data: bytes) -> np.ndarray:
    return np.load(io.BytesIO(data), allow_pickle=False)


def _decode_latent(files: dict[str, bytes], key: str) -> torch.Tensor:
    if "latent.npy" in files:
        try:
            array = _load_npy(files["latent.npy"])
        except Exception as e:  # noqa: BLE001 - any decoder failure is the sample's fault
            raise BadSample("bad_latent", f"{key}.latent.npy: {e}") from None
        if array.dtype not in NPY_DTYPES:
            raise BadSample("bad_dtype", f"{key}.latent.npy has dtype {array.dtype}, expected float16/float32")
        return torch.from_numpy(array)
    if "latent.pth" in files:
        try:
            tensor = torch.load(io.BytesIO(files["latent.pth"]), weights_only=True, map_location="cpu")
        except Exception as e:  # noqa: BLE001
            raise BadSample("bad_latent", f"{key}.latent.pth: {e}") from None
        if not isinstance(tensor, torch.Tensor):
            raise BadSample("bad_latent", f"{key}.latent.pth holds a {type(tensor).__name__}, not a tensor")
        if tensor.dtype not in PTH_DTYPES:
            raise BadSample("bad_dtype",
                            f"{key}.latent.pth has dtype {tensor.dtype}, expected float16/bfloat16/float32")
        return tensor
    raise BadSample("missing_latent", f"sample {key!r} has no .latent.npy or .latent.pth (members: {sorted(files)})")


def is_int_list(value, n: int, minimum: int) -> bool:
    """`value` is a list of `n` integers >= minimum (`type is int`: JSON true/false are not)."""
    return type(value) is list and len(value) == n and all([type(v) is int and v >= minimum for v in value])


def decode_meta(data: bytes | None, key: str) -> dict:
    """Parse and check a sample's JSON: an object with "latent_shape" three integers >= 1."""
    if data is None:
        raise BadSample("missing_json", f"sample {key!r} has no .json member")
    try:
        meta = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise BadSample("bad_json", f"{key}.json: {e}") from None
    if not isinstance(meta, dict):
        raise BadSample("bad_json", f"{key}.json is a {type(meta).__name__}, not an object")
    shape = meta.get("latent_shape")
    if not is_int_list(shape, 3, 1):
        raise BadSample("bad_json", f"{key}.json: latent_shape must be [T, H, W] integers >= 1, got {shape!r}")
    return meta


def check_tokens(thw: tuple[int, int, int], key: str, spec: TokenSpec) -> int:
    """Tokens of latent (T, H, W) under `spec`; a shape smaller than one patch is a bad shape."""
    pt, ph, pw = spec.patch
    if thw[1] < ph or thw[2] < pw:
        raise BadSample("bad_shape", f"sample {key!r}: latent (T, H, W) {thw} is smaller than patch {spec.patch}")
    return spec.tokens_from_latent(*thw)


def fit_shape(thw: tuple[int, int, int], spec: TokenSpec, max_seq_len: int) -> tuple[int, int, int]:
    """The latent (T, H, W) an oversized sample is resized to: H and W scaled by one factor
    (aspect kept) and floored to patch multiples so tokens fit max_seq_len; where the frames
    alone are still too many, T is cropped as well."""
    pt, ph, pw = spec.patch
    t, h, w = thw
    budget = max_seq_len - spec.extra_tokens
    if budget < 1:
        raise ValueError(f"max_seq_len {max_seq_len} leaves no tokens after extra_tokens {spec.extra_tokens}")
    scale = min(1.0, (budget / (-(-t // pt) * (h // ph) * (w // pw))) ** 0.5)
    gh = min(budget, max(1, int(h * scale) // ph))
    gw = min(budget // gh, max(1, int(w * scale) // pw))  # extreme aspect ratios
    t = min(t, (budget // (gh * gw)) * pt)
    return t, gh * ph, gw * pw


def resize_latent(latent: torch.Tensor, thw: tuple[int, int, int]) -> torch.Tensor:
    """(C, T, H, W) -> (C, T', H', W'): crop to the first T' frames, area-resample H, W."""
    t, h, w = thw
    latent = latent[:, :t]
    if latent.shape[2:] != (h, w):
        latent = F.interpolate(latent.transpose(0, 1), size=(h, w), mode="area").transpose(0, 1)
    return latent.contiguous()


@functools.lru_cache(maxsize=4)
def _stand_in_table(text_dim: int) -> torch.Tensor:
    return torch.randn(STAND_IN_VOCAB, text_dim, generator=torch.Generator().manual_seed(0))


def stand_in_text(seed_text: str, text_len: int, text_dim: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """(text_len, text_dim) float32 stand-in embedding: rows of a fixed N(0, 1) table of
    STAND_IN_VOCAB "token embeddings", picked by an RNG seeded with crc32 of `seed_text` (the
    caption, or the key), so the same sample always gets the same stand-in. A gather, not fresh
    random numbers (cheap at 512 x 4096); written into `out` if given. Not a text encoder output."""
    ids = np.random.default_rng(zlib.crc32(seed_text.encode())).integers(STAND_IN_VOCAB, size=text_len)
    return torch.index_select(_stand_in_table(text_dim), 0, torch.from_numpy(ids), out=out)


def write_text(out: torch.Tensor, sample: dict) -> torch.Tensor:
    """Fill `out` (text_len, text_dim) float32 with a decoded sample's text embedding, zero-padded
    to text_len as text encoders pad their context, or with its stand-in if it has none."""
    if sample["text"] is None:
        return stand_in_text(sample["text_seed"], out.shape[0], out.shape[1], out=out)
    n = len(sample["text"])
    out[:n].copy_(sample["text"])
    out[n:].zero_()
    return out


def _decode_text(data: bytes, key: str) -> np.ndarray:
    try:
        array = _load_npy(data)
    except Exception as e:  # noqa: BLE001
        raise BadSample("bad_text", f"{key}.text.npy: {e}") from None
    if array.ndim != 2 or array.dtype not in NPY_DTYPES:
        raise BadSample("bad_text", f"{key}.text.npy is {array.dtype} {array.shape}, expected float16/float32 (L, D)")
    return array


def inspect_sample(key: str, files: dict[str, bytes]) -> tuple[dict, torch.Tensor, np.ndarray | None]:
    """Checks that need no configuration: JSON, latent decodes as a finite float (C, T, H, W)
    matching the JSON's latent_shape, text (if any) a finite float (L, D) array.
    Returns (meta, latent tensor in its stored dtype, text array or None); raises BadSample."""
    meta = decode_meta(files.get(META_SUFFIX), key)
    latent = _decode_latent(files, key)
    if latent.ndim != 4:
        raise BadSample("bad_ndim", f"sample {key!r}: latent has shape {tuple(latent.shape)}, expected (C, T, H, W)")
    if list(latent.shape[1:]) != meta["latent_shape"]:
        raise BadSample("bad_shape", f"sample {key!r}: latent (C, T, H, W) {tuple(latent.shape)} but JSON "
                        f"latent_shape {meta['latent_shape']}")
    _check_finite(latent, key, "latent")
    text = _decode_text(files[TEXT_SUFFIX], key) if TEXT_SUFFIX in files else None
    if text is not None:
        _check_finite(torch.from_numpy(text), key, "text embedding")
    return meta, latent, text


def _check_finite(values: torch.Tensor, key: str, what: str) -> None:
    """BadSample("non_finite") if `values` holds NaN or inf: one such sample makes the loss NaN on every rank."""
    # One reduction instead of an elementwise mask: NaN/inf make the sum non-finite; only then
    # look closer (a finite sum that overflowed is a false alarm of the shortcut).
    if not torch.isfinite(values.sum(dtype=torch.float32)) and not torch.isfinite(values).all():
        raise BadSample("non_finite", f"sample {key!r}: {what} holds NaN or inf")


def check_config(key: str, channels: int, thw: tuple[int, int, int], text_dim_found: int | None, *,
                 spec: TokenSpec, latent_channels: int, text_dim: int, max_seq_len: int | None,
                 oversize: str) -> tuple[tuple[int, int, int], int]:
    """Checks against the run's configuration. Returns (latent (T, H, W) to train on, its
    tokens): the sample's own shape, or the `fit_shape` one for an oversized sample with
    oversize="resize". Raises BadSample."""
    if channels != latent_channels:
        raise BadSample("bad_shape", f"sample {key!r}: latent has {channels} channels, expected {latent_channels}")
    if text_dim_found is not None and text_dim_found != text_dim:
        raise BadSample("bad_text", f"sample {key!r}: text embedding has D = {text_dim_found}, expected {text_dim}")
    seq_len = check_tokens(thw, key, spec)
    if max_seq_len is None or seq_len <= max_seq_len:
        return thw, seq_len
    if oversize == "drop":
        raise BadSample("over_max_seq_len", f"sample {key!r}: {seq_len} tokens > max_seq_len {max_seq_len}")
    thw = fit_shape(thw, spec, max_seq_len)
    return thw, spec.tokens_from_latent(*thw)


def decode_sample(key: str, files: dict[str, bytes], *, spec: TokenSpec, latent_channels: int,
                  text_len: int, text_dim: int, max_seq_len: int | None, oversize: str = "drop") -> dict:
    """Decode and validate one sample's members (suffix -> bytes); raises BadSample naming the
    reason. Returns {"key", "latent" (C, T, H, W) tensor in its stored dtype (float32 once
    resized), "text" (<= text_len, text_dim) tensor in its stored dtype or None, "text_seed"
    (caption or key, for `stand_in_text`), "latent_shape" (T, H, W), "seq_len" tokens}.
    Conversion to float32, padding and stand-in text happen once, in the batch (`write_text`)."""
    meta, latent, text = inspect_sample(key, files)
    thw, seq_len = check_config(key, latent.shape[0], tuple(latent.shape[1:]),
                                None if text is None else text.shape[1], spec=spec,
                                latent_channels=latent_channels, text_dim=text_dim,
                                max_seq_len=max_seq_len, oversize=oversize)
    if thw != tuple(latent.shape[1:]):
        latent = resize_latent(latent.float(), thw)
    return {"key": key, "latent": latent, "text": None if text is None else torch.from_numpy(text[:text_len]),
            "text_seed": str(meta.get("caption") or key), "latent_shape": thw, "seq_len": seq_len}


# --- batches whose every sample failed ------------------------------------------------------

def failed_batch(samples: list[dict]) -> dict:
    """What a collate function returns instead of a batch when every sample of it failed (each a
    {"key", "skip": reason, "detail"} marker): the skip counts and the first failures' details.
    Raising in the collate would stop this rank alone while the others wait in the step's
    collectives; the marker reaches the main process, where `raise_if_any_batch_failed` stops
    every rank together."""
    return {SKIPPED_KEY: dict(Counter(s["skip"] for s in samples)),
            FAILED_KEY: "; ".join(s["detail"] for s in samples[:3])}


def raise_if_any_batch_failed(batch: dict, strategy=None) -> None:
    """Raise the same RuntimeError on every rank when any rank's batch of this step is a
    `failed_batch` marker. With `strategy` (Lightning's `trainer.strategy`; None without a trainer)
    the ranks agree through one all-reduce of one number (`reduce_boolean_decision`), so every rank
    must call this once per step with its batch; the host waits for that number (on GPU, until the
    device has run the work queued before it)."""
    failed = FAILED_KEY in batch
    if (strategy.reduce_boolean_decision(failed, all=False) if strategy is not None else failed):
        here = f"this rank: {batch[FAILED_KEY]}" if failed else "this rank read its batch; see the others' logs"
        raise RuntimeError(f"every sample of a batch failed to load, on at least one rank ({here}); every rank stops "
                           f"at this step. Did the shards change after indexing, or are they unreadable? Re-run "
                           f"`adaptiveload index`.")


# --- synthetic shards -----------------------------------------------------------------------

def shape_for_tokens(seq_len: int, spec: TokenSpec) -> tuple[int, int, int]:
    """A latent (T, H, W) with exactly `seq_len` tokens: one patch of frames and the most
    square grid of (seq_len - extra_tokens) patches."""
    n = int(seq_len) - spec.extra_tokens
    if n < 1:
        raise ValueError(f"seq_len {seq_len} leaves no patch tokens after extra_tokens {spec.extra_tokens}")
    rows = max(d for d in range(1, int(n ** 0.5) + 1) if n % d == 0)
    pt, ph, pw = spec.patch
    return pt, rows * ph, (n // rows) * pw


def mix_latent_shapes(mix: ShapeMix, spec: TokenSpec, latent_scale: float = 1.0) -> np.ndarray:
    """(rows, 3) int64 latent (T, H, W) of each mix row; H and W times `latent_scale`, floored
    to patch multiples (at least one patch). Rows given as tokens get `shape_for_tokens`."""
    if not latent_scale > 0:
        raise ValueError(f"latent_scale must be > 0, got {latent_scale}")
    _, ph, pw = spec.patch
    shapes = []
    for tokens, (t, h, w) in zip(mix.tokens, mix.latent_thw):
        if t < 0:
            t, h, w = shape_for_tokens(int(tokens), spec)
        h = max(ph, int(h * latent_scale) // ph * ph)
        w = max(pw, int(w * latent_scale) // pw * pw)
        shapes.append((t, h, w))
    return np.asarray(shapes, dtype=np.int64)


def write_synthetic_shards(mix: ShapeMix, n: int, out_dir: str | Path, *, spec: TokenSpec = TokenSpec(),
                           samples_per_shard: int = 64, seed: int = 0, latent_channels: int = 16,
                           latent_scale: float = 1.0, text_len: int = 0, text_dim: int = 0,
                           dtype: str = "float16", progress: bool = True) -> list[Path]:
    """Write `n` samples with shapes drawn from `mix` (by its counts) and N(0, 1) latents to
    `out_dir`/shard-000000.tar, ...; with text_len and text_dim > 0 each sample also gets a
    random (text_len, text_dim) `.text.npy`. Returns the shard paths."""
    if n < 1 or samples_per_shard < 1:
        raise ValueError(f"n and samples_per_shard must be >= 1, got {n}, {samples_per_shard}")
    if dtype not in ("float16", "float32"):
        raise ValueError(f"dtype must be 'float16' or 'float32', got {dtype!r}")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    shapes = mix_latent_shapes(mix, spec, latent_scale)
    rng = np.random.default_rng(seed)
    rows = rng.choice(len(shapes), size=n, p=mix.counts / mix.counts.sum())
    bar = tqdm(total=n, desc="make-shards", unit="sample", disable=not progress)

    def samples(start: int, stop: int):
        for i in range(start, stop):
            t, h, w = (int(v) for v in shapes[rows[i]])
            latent = rng.standard_normal((latent_channels, t, h, w), dtype=np.float32).astype(dtype)
            text = None
            if text_len > 0 and text_dim > 0:
                text = rng.standard_normal((text_len, text_dim), dtype=np.float32).astype(dtype)
            key = f"sample{i:09d}"
            yield key, encode_sample(key, latent, {"caption": f"synthetic {t}x{h}x{w} latent"}, text)
            bar.update(1)

    paths = []
    for j, start in enumerate(range(0, n, samples_per_shard)):
        path = out_dir / f"shard-{j:06d}.tar"
        write_shard(path.with_name(path.name + ".partial"), samples(start, min(n, start + samples_per_shard)))
        paths.append(path)
    bar.close()
    # Named *.tar only once all are written: an interrupted run leaves no shards that a later
    # run (DataModule.prepare_data looks for any *.tar) would take for a finished dataset.
    for path in paths:
        os.replace(path.with_name(path.name + ".partial"), path)
    return paths

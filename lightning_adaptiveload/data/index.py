"""Sample index of tar shards: where each sample's members lie, and its shape.

An index is JSONL, one valid sample a line:
    {"key": str, "shard": path (relative to the index file's folder), "members": {suffix: [offset, size]}
     (bytes into the tar), "latent_shape": [T, H, W], "channels": C, "text_shape": [L, D] | null,
     "tokens": int (under the TokenSpec the index was built with)}
The map-style dataset reads a sample with one positioned read per member (`read_members`).
"""
from __future__ import annotations

import json
import os
import re
import tarfile
from collections import Counter, OrderedDict
from pathlib import Path

from tqdm import tqdm

from lightning_adaptiveload.data.shards import MEMBER_SUFFIXES, BadSample, check_tokens, inspect_sample
from lightning_adaptiveload.jsonl import iter_objects
from lightning_adaptiveload.shapes import TokenSpec

MAX_OPEN_SHARDS = 64  # file descriptors a process keeps open for random access
_MEMBER_NAME = re.compile(r"^((?:.*/|)[^./]+)\.([^/]*)$")  # WebDataset's key/suffix split


def split_member_name(name: str) -> tuple[str, str] | None:
    """(key, lower-case suffix) of a tar member name, split like WebDataset at the basename's first dot."""
    match = _MEMBER_NAME.match(name)
    return None if match is None else (match.group(1), match.group(2).lower())


def scan_shard(path: str | Path, read: set[str] | None = None):
    """Yield (key, {suffix: (offset, size)}, {suffix: bytes}, error) per sample of a tar, grouping
    consecutive members of one key as WebDataset does; only members whose suffix is in `read`
    (default: all) have their bytes read. `error` is a BadSample("read_error") for the sample a
    truncated or corrupt tar broke off in (or the shard itself if it cannot be opened), else None."""
    size_on_disk = os.path.getsize(path)
    key, spans, files = None, {}, {}
    try:
        with open(path, "rb") as f, tarfile.open(fileobj=f, mode="r:") as tar:
            for info in tar:
                if not info.isfile() or (parts := split_member_name(info.name)) is None:
                    continue
                if parts[0] != key:
                    if key is not None:
                        yield key, spans, files, None
                    key, spans, files = parts[0], {}, {}
                if info.offset_data + info.size > size_on_disk:
                    raise tarfile.ReadError(f"member {info.name} runs past the end of the file")
                spans[parts[1]] = (info.offset_data, info.size)
                if read is None or parts[1] in read:
                    f.seek(info.offset_data)
                    files[parts[1]] = f.read(info.size)
    except (tarfile.TarError, OSError, EOFError) as e:
        yield key or str(path), spans, files, BadSample("read_error", f"{path}: {e}")
        return
    if key is not None:
        yield key, spans, files, None


def build_index(shards: list[str], index_path: str | Path, spec: TokenSpec = TokenSpec(),
                progress: bool = True) -> tuple[int, list[dict]]:
    """Scan `shards` once, write the JSONL index of valid samples to `index_path`.
    Returns (valid sample count, bad samples as {"shard", "key", "reason", "detail"})."""
    index_path = Path(index_path)
    base = index_path.resolve().parent
    bad, count = [], 0
    with open(index_path, "w", encoding="utf-8") as out:
        for shard in tqdm(shards, desc="index", unit="shard", disable=not progress):
            rel = os.path.relpath(Path(shard).resolve(), base)
            for key, spans, files, error in scan_shard(shard):
                try:
                    if error is not None:
                        raise error
                    _, latent, text = inspect_sample(key, files)
                    thw = [int(v) for v in latent.shape[1:]]
                    tokens = check_tokens(tuple(thw), key, spec)
                except BadSample as e:
                    bad.append({"shard": str(shard), "key": key, "reason": e.reason, "detail": str(e)})
                    continue
                members = {s: list(spans[s]) for s in MEMBER_SUFFIXES if s in spans}
                row = {"key": key, "shard": rel, "members": members, "latent_shape": thw,
                       "channels": int(latent.shape[0]),
                       "text_shape": None if text is None else [int(v) for v in text.shape], "tokens": tokens}
                out.write(json.dumps(row) + "\n")
                count += 1
    return count, bad


_ROW_FIELDS = {"key": str, "shard": str, "members": dict, "latent_shape": list, "channels": int}


def read_index(path: str | Path) -> list[dict]:
    """Rows of an index file with "shard" made absolute; errors name the line and field."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"index file {str(path)!r} does not exist")
    base = path.resolve().parent
    rows = []
    for line_no, row in iter_objects(path):
        for field, kind in _ROW_FIELDS.items():
            if not isinstance(row.get(field), kind):
                raise ValueError(f"{path}:{line_no}: field {field!r} must be a {kind.__name__}, "
                                 f"got {row.get(field)!r}")
        if len(row["latent_shape"]) != 3:
            raise ValueError(f"{path}:{line_no}: field 'latent_shape' must be [T, H, W]")
        row["shard"] = str(base / row["shard"])
        row["members"] = {s: tuple(span) for s, span in row["members"].items()}
        rows.append(row)
    return rows


def read_members(fd_cache: OrderedDict, shard: str, members: dict[str, tuple[int, int]]) -> dict[str, bytes]:
    """Member bytes of one sample by positioned reads. `fd_cache` (shard path -> open file
    descriptor, most recently used last) is kept per process, a DataLoader worker opens its own;
    it holds at most MAX_OPEN_SHARDS descriptors, so thousands of shards stay under ulimit -n."""
    fd = fd_cache.pop(shard, None)
    if fd is None:
        try:
            fd = os.open(shard, os.O_RDONLY)
        except OSError as e:
            raise BadSample("read_error", f"cannot open shard {shard}: {e}") from None
        if len(fd_cache) >= MAX_OPEN_SHARDS:
            os.close(fd_cache.popitem(last=False)[1])
    fd_cache[shard] = fd
    files = {}
    for suffix, (offset, size) in members.items():
        data = os.pread(fd, size, offset)
        if len(data) != size:
            raise BadSample("read_error", f"{shard}: member {suffix} at byte {offset} is short "
                                          f"({len(data)} of {size} bytes)")
        files[suffix] = data
    return files


def summarize_bad(bad: list[dict]) -> str:
    """One line: count per reason."""
    counts = Counter(b["reason"] for b in bad)
    return ", ".join(f"{reason}={n}" for reason, n in sorted(counts.items())) or "none"


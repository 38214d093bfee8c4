"""Sample index of tar shards: where each sample's members lie, and its shape.

An index is JSONL, one valid sample a line:
    {"key": str, "shard": path (relative to the index file's folder), "members": {suffix: [offset, size]}
     (bytes into the tar), "latent_shape": [T, H, W], "channels": C, "text_shape": [L, D] | null,
     "tokens": int (under the TokenSpec the index was built with)}
The map-style dataset reads a sample with one positioned read per member (`read_members`).
`read_index` keeps the parsed columns in `<index>.npz`, used only while it matches the index's bytes.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import stat
import tarfile
import tempfile
import zipfile
from collections import Counter, OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tqdm import tqdm

from lightning_adaptiveload.data.shards import MEMBER_SUFFIXES, BadSample, check_tokens, inspect_sample, is_int_list
from lightning_adaptiveload._jsonl import iter_objects
from lightning_adaptiveload.scheduling.epoch_plan import ranges_to_positions
from lightning_adaptiveload.scheduling.shapes import TokenSpec

log = logging.getLogger(__name__)
MAX_OPEN_SHARDS = 64  # file descriptors a process keeps open for random access
_MEMBER_NAME = re.compile(r"^((?:.*/|)[^./]+)\.([^/]*)$")  # WebDataset's key/suffix split


def split_member_name(name: str) -> tuple[str, str] | None:
    """(key, lower-case suffix) of a tar member name, split like WebDataset at the basename's first dot."""
    match = _MEMBER_NAME.match(name)
    return None if match is None else (match.group(1), match.group(2).lower())


def scan_shard(path: str | Path, read: set[str] | None = None
               ) -> Iterator[tuple[str, dict[str, tuple[int, int]], dict[str, bytes], BadSample | None]]:
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
    Returns (valid sample count, bad samples as {"shard", "key", "reason", "detail"}).
    The file appears only when complete (written aside, then renamed): an interrupted run leaves
    no partial index that a later run would take for a finished one."""
    index_path = Path(index_path)
    base = index_path.resolve().parent
    partial = index_path.with_name(index_path.name + ".partial")
    try:
        count, bad = _write_index(shards, partial, base, spec, progress)
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
    os.replace(partial, index_path)
    return count, bad


def _write_index(shards: list[str], path: Path, base: Path, spec: TokenSpec, progress: bool) -> tuple[int, list[dict]]:
    bad, count = [], 0
    with open(path, "w", encoding="utf-8") as out:
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
_MEMBER_COLUMN = {suffix: i for i, suffix in enumerate(MEMBER_SUFFIXES)}
_CHUNK_ROWS = 1 << 16  # rows parsed into Python objects before they are packed into numpy columns


@dataclass(frozen=True, eq=False)
class SampleIndex:
    """An index in memory as numpy columns (N samples, S shards): no Python object per sample, so
    its arrays take about 125 bytes a sample (1.2 GB at 10M, benchmarks/index_load.py), and forked
    DataLoader workers share the pages (a list of dicts is copied into every worker page by page
    as reference counts change).

    shard_paths: S absolute shard paths; shard: (N,) int32 position in shard_paths.
    member_offset, member_size: (N, len(MEMBER_SUFFIXES)) int64 bytes into the tar, -1 = absent.
    latent_shape: (N, 3) int32 (T, H, W); channels: (N,) int32 C.
    text_shape: (N, 2) int32 (L, D), -1 where the sample has no text embedding.
    tokens: (N,) int64 tokens the indexer computed, -1 where the line has none.
    key_blob: (total key bytes,) uint8 UTF-8 keys back to back; key_end: (N,) int64 end of key i.
    """

    shard_paths: list[str]
    shard: np.ndarray
    member_offset: np.ndarray
    member_size: np.ndarray
    latent_shape: np.ndarray
    channels: np.ndarray
    text_shape: np.ndarray
    tokens: np.ndarray
    key_blob: np.ndarray
    key_end: np.ndarray

    def __len__(self) -> int:
        return len(self.shard)

    def key(self, i: int) -> str:
        i = range(len(self))[i]  # negative i counts from the end, as for the other columns
        start = int(self.key_end[i - 1]) if i > 0 else 0
        return self.key_blob[start: int(self.key_end[i])].tobytes().decode()

    def shard_path(self, i: int) -> str:
        return self.shard_paths[self.shard[i]]

    def members(self, i: int) -> dict[str, tuple[int, int]]:
        """{suffix: (byte offset, size)} of sample i's members."""
        return {s: (int(o), int(n)) for s, o, n in zip(MEMBER_SUFFIXES, self.member_offset[i], self.member_size[i])
                if o >= 0}

    def __getitem__(self, i: int) -> dict:
        """Sample i as its index line reads, with "shard" absolute and member spans as tuples."""
        i = range(len(self))[i]
        text = [int(v) for v in self.text_shape[i]]
        return {"key": self.key(i), "shard": self.shard_path(i), "members": self.members(i),
                "latent_shape": [int(v) for v in self.latent_shape[i]], "channels": int(self.channels[i]),
                "text_shape": None if text[0] < 0 else text, "tokens": int(self.tokens[i])}

    def __iter__(self) -> Iterator[dict]:
        return (self[i] for i in range(len(self)))

    def take(self, rows: np.ndarray) -> SampleIndex:
        """The index of samples `rows` (int array of positions), in that order."""
        rows = np.asarray(rows, dtype=np.int64)
        key_len = np.diff(self.key_end, prepend=0)[rows]
        key_start = self.key_end[rows] - key_len
        return SampleIndex(
            shard_paths=self.shard_paths, shard=self.shard[rows], member_offset=self.member_offset[rows],
            member_size=self.member_size[rows], latent_shape=self.latent_shape[rows], channels=self.channels[rows],
            text_shape=self.text_shape[rows], tokens=self.tokens[rows],
            key_blob=self.key_blob[ranges_to_positions(key_start, key_len)], key_end=np.cumsum(key_len))


def _parse_row(row: dict, where: str, shard_ids: dict[str, int]) -> tuple[tuple[int, ...], bytes]:
    """Check one index line; returns it as a flat tuple of ints (the _COLUMNS, shard as its
    number in `shard_ids`, which it extends) and its key as UTF-8 bytes."""
    for field, kind in _ROW_FIELDS.items():
        if type(row.get(field)) is not kind:
            raise ValueError(f"{where}: field {field!r} must be a {kind.__name__}, got {row.get(field)!r}")
    if not is_int_list(row["latent_shape"], 3, 1):
        raise ValueError(f"{where}: field 'latent_shape' must be [T, H, W] integers >= 1, got {row['latent_shape']!r}")
    text = row.get("text_shape")
    if text is not None and not is_int_list(text, 2, 1):
        raise ValueError(f"{where}: field 'text_shape' must be [L, D] integers >= 1 or null, got {text!r}")
    tokens = row.get("tokens", -1)
    if type(tokens) is not int:
        raise ValueError(f"{where}: field 'tokens' must be an int, got {tokens!r}")
    offsets, sizes = [-1] * len(MEMBER_SUFFIXES), [-1] * len(MEMBER_SUFFIXES)
    for suffix, span in row["members"].items():
        if suffix not in _MEMBER_COLUMN:
            raise ValueError(f"{where}: field 'members' has suffix {suffix!r}, expected one of {MEMBER_SUFFIXES}")
        if not is_int_list(span, 2, 0):
            raise ValueError(f"{where}: member {suffix!r} must be [byte offset, size] integers >= 0, got {span!r}")
        offsets[_MEMBER_COLUMN[suffix]], sizes[_MEMBER_COLUMN[suffix]] = span
    key = row["key"].encode()
    shard = shard_ids.setdefault(row["shard"], len(shard_ids))
    return (shard, *offsets, *sizes, *row["latent_shape"], row["channels"], *(text or (-1, -1)), tokens,
            len(key)), key


# Columns of SampleIndex in _parse_row's flat tuple: name -> (position, dtype).
_M = len(MEMBER_SUFFIXES)
_COLUMNS = {"shard": (0, np.int32), "member_offset": (slice(1, 1 + _M), np.int64),
            "member_size": (slice(1 + _M, 1 + 2 * _M), np.int64),
            "latent_shape": (slice(1 + 2 * _M, 4 + 2 * _M), np.int32), "channels": (4 + 2 * _M, np.int32),
            "text_shape": (slice(5 + 2 * _M, 7 + 2 * _M), np.int32), "tokens": (7 + 2 * _M, np.int64),
            "key_len": (8 + 2 * _M, np.int64)}


def read_index(path: str | Path, cache: bool = True) -> SampleIndex:
    """The columnar index of an index file, shard paths made absolute; errors name the line and
    field. With `cache`, a valid `<index>.npz` beside it (see `index_cache_path`) is loaded instead
    of parsing, and a missing or stale one is rewritten after the parse."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"index file {str(path)!r} does not exist")
    base = path.resolve().parent
    if not cache:
        return _as_index(base, *_parse_index(path))
    cache_path = index_cache_path(path)
    source = file_fingerprint(path)
    cached = _load_cache(cache_path, source)
    if cached is not None:
        return _as_index(base, *cached)
    shards, arrays = _parse_index(path)
    after = os.stat(path)
    # written only if the file did not change while it was parsed: else the arrays may be of other
    # bytes than the hash (a later load would then reparse, unless the file went back to the hashed bytes)
    if (after.st_ino, after.st_size, after.st_mtime_ns) == (source.inode, source.size, source.mtime_ns):
        _write_cache(cache_path, source, shards, arrays)
    return _as_index(base, shards, arrays)


def _parse_index(path: Path) -> tuple[list[str], dict[str, np.ndarray]]:
    """(shard paths as the lines give them, the SampleIndex arrays). Every _CHUNK_ROWS lines are
    packed into numpy, so parsing holds few Python objects."""
    shard_ids: dict[str, int] = {}
    pieces: dict[str, list[np.ndarray]] = {name: [] for name in _COLUMNS}
    blobs, rows, keys = [], [], []

    def pack() -> None:
        table = np.array(rows, dtype=np.int64).reshape(len(rows), 9 + 2 * _M)
        for name, (position, dtype) in _COLUMNS.items():
            pieces[name].append(table[:, position].astype(dtype))
        blobs.append(np.frombuffer(b"".join(keys), dtype=np.uint8))
        rows.clear()
        keys.clear()

    for line_no, row in iter_objects(path):
        ints, key = _parse_row(row, f"{path}:{line_no}", shard_ids)
        rows.append(ints)
        keys.append(key)
        if len(rows) == _CHUNK_ROWS:
            pack()
    pack()
    arrays = {name: np.concatenate(parts) for name, parts in pieces.items()}
    arrays["key_end"] = np.cumsum(arrays.pop("key_len"))
    arrays["key_blob"] = np.concatenate(blobs)
    return list(shard_ids), arrays


def _as_index(base: Path, shards: list[str], arrays: dict[str, np.ndarray]) -> SampleIndex:
    return SampleIndex(shard_paths=[str(base / s) for s in shards], **arrays)


# --- binary cache of a parsed index ---------------------------------------------------------------

CACHE_VERSION = 1  # bump when what the cache stores, or what its arrays mean, changes
_HASH_CHUNK = 16 << 20  # bytes read per update of the content hash
# SampleIndex arrays in the cache: name -> (dtype, ndim, columns or None)
_CACHE_ARRAYS = {"shard": (np.int32, 1, None), "member_offset": (np.int64, 2, _M), "member_size": (np.int64, 2, _M),
                 "latent_shape": (np.int32, 2, 3), "channels": (np.int32, 1, None), "text_shape": (np.int32, 2, 2),
                 "tokens": (np.int64, 1, None), "key_end": (np.int64, 1, None), "key_blob": (np.uint8, 1, None)}


@dataclass(frozen=True)
class FileFingerprint:
    """What a cache is keyed on: size (bytes), mtime (ns) and sha256 of the file's bytes. `inode` and
    `mode` come from the same fstat but are not part of the key (a copied folder keeps a valid cache)."""
    size: int
    mtime_ns: int
    sha256: bytes
    inode: int
    mode: int


def file_fingerprint(path: str | Path) -> FileFingerprint:
    """Stat and sha256 of one open file, read in 16 MiB chunks (about 0.2 s per 234 MB, a 1M-line
    index, on the benchmark CPU: benchmarks/index_load.py)."""
    digest = hashlib.sha256()
    chunk = bytearray(_HASH_CHUNK)
    with open(path, "rb", buffering=0) as f:
        st = os.fstat(f.fileno())
        while n := f.readinto(chunk):
            digest.update(memoryview(chunk)[:n])
    return FileFingerprint(st.st_size, st.st_mtime_ns, digest.digest(), st.st_ino, stat.S_IMODE(st.st_mode))


def index_cache_path(path: str | Path) -> Path:
    """`<index>.npz`: the parsed index of `path`, numpy arrays only (no pickle)."""
    path = Path(path)
    return path.with_name(path.name + ".npz")


def _load_cache(cache_path: Path, source: FileFingerprint) -> tuple[list[str], dict[str, np.ndarray]] | None:
    """(shards, arrays) of a cache made from exactly `source`'s bytes by this CACHE_VERSION, else None
    (with one log line saying why, unless there is no cache)."""
    if not cache_path.is_file():
        return None
    try:
        with np.load(cache_path, allow_pickle=False) as npz:
            version, suffixes = int(npz["version"]), npz["member_suffixes"].tolist()
            if version != CACHE_VERSION or suffixes != list(MEMBER_SUFFIXES):
                problem = f"format version {version} with member suffixes {suffixes}, this code reads " \
                          f"{CACHE_VERSION} with {list(MEMBER_SUFFIXES)}"
            elif (int(npz["source_size"]), int(npz["source_mtime_ns"]), npz["source_sha256"].tobytes()) != (
                    source.size, source.mtime_ns, source.sha256):
                problem = "made from other bytes than the index file now holds (size, mtime or sha256 differ)"
            else:
                shards, arrays = npz["shards"].tolist(), {name: npz[name] for name in _CACHE_ARRAYS}
                problem = _cache_arrays_problem(shards, arrays)
    except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile) as e:
        problem = f"unreadable ({type(e).__name__}: {e})"
    if problem:
        log.warning("index cache %s is not used: %s; parsing the index", cache_path, problem)
        return None
    return shards, arrays


def _cache_arrays_problem(shards: list, arrays: dict[str, np.ndarray]) -> str:
    """What is wrong with the arrays of a cache that passed its checks ('' if nothing): a guard against
    writers with a bug, as the zip's CRC already catches damaged bytes."""
    n = len(arrays["shard"])
    for name, (dtype, ndim, columns) in _CACHE_ARRAYS.items():
        a = arrays[name]
        if a.dtype != dtype or a.ndim != ndim or (columns is not None and a.shape[1] != columns) or (
                name != "key_blob" and len(a) != n):
            return f"array {name!r} has dtype {a.dtype} and shape {a.shape}"
    if not all(type(s) is str for s in shards):
        return "shard paths are not strings"
    if n and (int(arrays["key_end"][-1]) != len(arrays["key_blob"]) or int(arrays["shard"].max()) >= len(shards)):
        return "key ends or shard numbers out of range"
    return ""


def _write_cache(cache_path: Path, source: FileFingerprint, shards: list[str], arrays: dict[str, np.ndarray]) -> None:
    """Write the cache under a unique name and rename it into place, so ranks that start together
    never read a half-written one; where the folder is not writable, log one line and go on."""
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{cache_path.name}.", suffix=".tmp", dir=cache_path.parent)
    except OSError as e:
        log.warning("index cache %s not written (%s); every start parses the index", cache_path, e)
        return
    try:
        with os.fdopen(fd, "wb") as f:
            os.fchmod(f.fileno(), source.mode)  # readable by whoever may read the index (mkstemp gives 0600)
            np.savez(f, allow_pickle=False, version=np.array(CACHE_VERSION), member_suffixes=np.array(MEMBER_SUFFIXES),
                     source_size=np.array(source.size), source_mtime_ns=np.array(source.mtime_ns),
                     source_sha256=np.frombuffer(source.sha256, dtype=np.uint8),
                     shards=np.array(shards, dtype=np.str_), **arrays)
        os.replace(tmp, cache_path)
    except OSError as e:  # e.g. a full disk: the parse is done, the cache is only a speed-up
        os.unlink(tmp)
        log.warning("index cache %s not written (%s); every start parses the index", cache_path, e)
    except BaseException:
        os.unlink(tmp)
        raise


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
        try:
            data = os.pread(fd, size, offset)
        except OSError as e:  # an I/O error on one sample is that sample's skip, not the run's end
            raise BadSample("read_error", f"{shard}: member {suffix} at byte {offset}: {e}") from None
        if len(data) != size:
            raise BadSample("read_error", f"{shard}: member {suffix} at byte {offset} is short "
                                          f"({len(data)} of {size} bytes)")
        files[suffix] = data
    return files


def summarize_bad(bad: list[dict]) -> str:
    """One line: count per reason."""
    counts = Counter(b["reason"] for b in bad)
    return ", ".join(f"{reason}={n}" for reason, n in sorted(counts.items())) or "none"


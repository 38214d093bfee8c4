"""The binary cache of a parsed index, `<index>.npz`: the SampleIndex arrays of `read_index`, used
only while the index file holds the bytes it was made from (size, mtime and sha256), numpy arrays
only (no pickle), written atomically. A stale, foreign or damaged cache is never an error: the
index is parsed again (one log line says why).
"""
from __future__ import annotations

import hashlib
import logging
import os
import stat
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from lightning_adaptiveload.data.shards import MEMBER_SUFFIXES

log = logging.getLogger(__name__)
_M = len(MEMBER_SUFFIXES)
CACHE_VERSION = 2  # bump when what the cache stores, or what its arrays mean, changes
_HASH_CHUNK = 16 << 20  # bytes read per update of the content hash
# SampleIndex arrays in the cache: name -> (dtype, ndim, columns or None, length: "samples" | "shards" | None)
_CACHE_ARRAYS = {"shard": (np.int32, 1, None, "samples"), "member_offset": (np.int64, 2, _M, "samples"),
                 "member_size": (np.int64, 2, _M, "samples"), "member_header": (np.int32, 2, _M, "samples"),
                 "latent_shape": (np.int32, 2, 3, "samples"), "channels": (np.int32, 1, None, "samples"),
                 "text_shape": (np.int32, 2, 2, "samples"), "tokens": (np.int64, 1, None, "samples"),
                 "key_end": (np.int64, 1, None, "samples"), "key_blob": (np.uint8, 1, None, None),
                 "shard_size": (np.int64, 1, None, "shards"), "shard_mtime_ns": (np.int64, 1, None, "shards"),
                 "shard_sha256": (np.uint8, 2, 32, "shards")}


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
    index, on the benchmark CPU: benchmarks/data/index_load.py)."""
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


def load_cache(cache_path: Path, source: FileFingerprint) -> tuple[list[str], dict[str, np.ndarray]] | None:
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
                problem = _arrays_problem(shards, arrays)
    except Exception as e:  # noqa: BLE001 - any damage means a reparse (a flipped zip method: NotImplementedError)
        problem = f"unreadable ({type(e).__name__}: {e})"
    if problem:
        log.warning("index cache %s is not used: %s; parsing the index", cache_path, problem)
        return None
    return shards, arrays


def _arrays_problem(shards: list, arrays: dict[str, np.ndarray]) -> str:
    """What is wrong with the arrays of a cache that passed its checks ('' if nothing): a guard against
    writers with a bug, as the zip's CRC already catches damaged bytes."""
    lengths = {"samples": len(arrays["shard"]), "shards": len(shards), None: None}
    for name, (dtype, ndim, columns, length) in _CACHE_ARRAYS.items():
        a = arrays[name]
        if a.dtype != dtype or a.ndim != ndim or (columns is not None and a.shape[1] != columns) or (
                length is not None and len(a) != lengths[length]):
            return f"array {name!r} has dtype {a.dtype} and shape {a.shape}"
    if not all(type(s) is str for s in shards):
        return "shard paths are not strings"
    if lengths["samples"] and (int(arrays["key_end"][-1]) != len(arrays["key_blob"])
                               or int(arrays["shard"].max()) >= len(shards)):
        return "key ends or shard numbers out of range"
    return ""


def write_cache(cache_path: Path, source: FileFingerprint, shards: list[str], arrays: dict[str, np.ndarray]) -> None:
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

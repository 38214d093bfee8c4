"""Sample index of tar shards: where each sample's members lie, its shape, and what each shard held.

An index is JSONL (format version 2):
    line 1:  {"format": "adaptiveload-index", "version": 2}
    per shard, before its samples: a shard record
             {"shard": path (relative to the index file's folder), "size": bytes, "mtime_ns": int,
              "member_table_sha256": hex digest of the shard's member table (see `scan_shard`)}
    per valid sample: {"key": str, "shard": path as in its shard record,
             "members": {suffix: [data offset, size, header offset]} (bytes into the tar; the header
             offset is where the member's tar header records start), "latent_shape": [T, H, W],
             "channels": C, "text_shape": [L, D] | null, "tokens": int (under the TokenSpec the
             index was built with)}
Keys are unique (`build_index` keeps a key's first occurrence). The map-style dataset reads a
sample with one positioned read of each member's tar header (checked against the key) and one of
its data (`read_members`). `read_index` keeps the parsed columns in `<index>.npz`, used only while
it matches the index's bytes. What is verified, when, and at what cost: docs/data.md.
"""
from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import re
import tarfile
from collections import Counter, OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tqdm import tqdm

from lightning_adaptiveload.data.index_cache import file_fingerprint, index_cache_path, load_cache, write_cache
from lightning_adaptiveload.data.shards import MEMBER_SUFFIXES, BadSample, check_tokens, inspect_sample, is_int_list
from lightning_adaptiveload._jsonl import iter_objects
from lightning_adaptiveload.scheduling.epoch_plan import ranges_to_positions
from lightning_adaptiveload.scheduling.shapes import TokenSpec

log = logging.getLogger(__name__)
MAX_OPEN_SHARDS = 64  # file descriptors a process keeps open for random access
_MEMBER_NAME = re.compile(r"^((?:.*/|)[^./]+)\.([^/]*)$")  # WebDataset's key/suffix split
INDEX_FORMAT = "adaptiveload-index"
INDEX_VERSION = 2  # 1: no header line, no shard records, [offset, size] member spans
DUPLICATES = ("first", "error")  # build_index: keep a repeated key's first sample, or fail
_BLOCK = 512  # tar record size: headers and data start at multiples of it
REINDEX = "re-run `adaptiveload index`"


def split_member_name(name: str) -> tuple[str, str] | None:
    """(key, lower-case suffix) of a tar member name, split like WebDataset at the basename's first dot."""
    match = _MEMBER_NAME.match(name)
    return None if match is None else (match.group(1), match.group(2).lower())


def scan_shard(path: str | Path, read: set[str] | None = None, table=None
               ) -> Iterator[tuple[str, dict[str, tuple[int, int, int]], dict[str, bytes], BadSample | None]]:
    """Yield (key, {suffix: (data offset, size, header offset)}, {suffix: bytes}, error) per sample of
    a tar, grouping consecutive members of one key as WebDataset does; a suffix that repeats within
    a group starts a new sample of the same key (a duplicate key, for the caller to count). Only
    members whose suffix is in `read` (default: all) have their bytes read. `error` is a
    BadSample("read_error") for the sample a truncated or corrupt tar broke off in (or the shard
    itself if it cannot be opened), else None. `table` (a hashlib object), if given, is updated with
    every member's (name, type, header offset, data offset, size): the shard's member table, whose
    digest identifies its layout without reading any data."""
    size_on_disk = os.path.getsize(path)
    key, spans, files = None, {}, {}
    try:
        with open(path, "rb") as f, tarfile.open(fileobj=f, mode="r:") as tar:
            for info in tar:
                if table is not None:
                    table.update(f"{info.name}\0{info.type.decode(errors='replace')}\0{info.offset}\0"
                                 f"{info.offset_data}\0{info.size}\n".encode(errors="surrogateescape"))
                if not info.isfile() or (parts := split_member_name(info.name)) is None:
                    continue
                if parts[0] != key or parts[1] in spans:
                    if key is not None:
                        yield key, spans, files, None
                    key, spans, files = parts[0], {}, {}
                if info.offset_data + info.size > size_on_disk:
                    raise tarfile.ReadError(f"member {info.name} runs past the end of the file")
                spans[parts[1]] = (info.offset_data, info.size, info.offset)
                if read is None or parts[1] in read:
                    f.seek(info.offset_data)
                    files[parts[1]] = f.read(info.size)
    except (tarfile.TarError, OSError, EOFError) as e:
        yield key or str(path), spans, files, BadSample("read_error", f"{path}: {e}")
        return
    if key is not None:
        yield key, spans, files, None


def member_table_sha256(path: str | Path) -> str:
    """Hex sha256 of a shard's member table (see `scan_shard`): reads its tar headers, no data."""
    table = hashlib.sha256()
    for _ in scan_shard(path, read=set(), table=table):
        pass
    return table.hexdigest()


def shard_record(rel: str, st: os.stat_result, member_table: str) -> dict:
    """The index's record of one shard: `rel` (its path as the index names it), size and mtime (ns)
    from `st`, and its member table digest (`member_table_sha256`)."""
    return {"shard": rel, "size": st.st_size, "mtime_ns": st.st_mtime_ns, "member_table_sha256": member_table}


def build_index(shards: list[str], index_path: str | Path, spec: TokenSpec = TokenSpec(),
                progress: bool = True, duplicates: str = "first") -> tuple[int, list[dict]]:
    """Scan `shards` once, write the JSONL index of valid samples to `index_path`.
    Returns (valid sample count, left-out samples as {"shard", "key", "reason", "detail"}).
    A key already indexed (from this shard or an earlier one) is left out with reason
    "duplicate_key" and "first_shard" (where the kept sample lies); with duplicates="error" any
    duplicate raises ValueError after the scan and no index is written.
    The file appears only when complete (written aside, then renamed): an interrupted run leaves
    no partial index that a later run would take for a finished one."""
    if duplicates not in DUPLICATES:
        raise ValueError(f"duplicates must be one of {DUPLICATES}, got {duplicates!r}")
    index_path = Path(index_path)
    base = index_path.resolve().parent
    partial = index_path.with_name(index_path.name + ".partial")
    try:
        count, bad = _write_index(shards, partial, base, spec, progress)
        repeated = [b for b in bad if b["reason"] == "duplicate_key"]
        if repeated and duplicates == "error":
            pairs = "; ".join(summarize_duplicates(bad)[:3])
            raise ValueError(f"{len(repeated)} samples repeat a key indexed before ({pairs}); no index written "
                             f"(duplicates='first' keeps each key's first sample)")
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
    os.replace(partial, index_path)
    return count, bad


def _write_index(shards: list[str], path: Path, base: Path, spec: TokenSpec, progress: bool) -> tuple[int, list[dict]]:
    bad, count = [], 0
    first_shard: dict[str, str] = {}  # key -> shard it was indexed from
    with open(path, "w", encoding="utf-8") as out:
        out.write(json.dumps({"format": INDEX_FORMAT, "version": INDEX_VERSION}) + "\n")
        for shard in tqdm(shards, desc="index", unit="shard", disable=not progress):
            rel = os.path.relpath(Path(shard).resolve(), base)
            before, table, lines = os.stat(shard), hashlib.sha256(), []
            for key, spans, files, error in scan_shard(shard, table=table):
                try:
                    if error is not None:
                        raise error
                    _, latent, text = inspect_sample(key, files)
                    thw = [int(v) for v in latent.shape[1:]]
                    tokens = check_tokens(tuple(thw), key, spec)
                except BadSample as e:
                    bad.append({"shard": str(shard), "key": key, "reason": e.reason, "detail": str(e)})
                    continue
                if key in first_shard:
                    bad.append({"shard": str(shard), "key": key, "reason": "duplicate_key",
                                "first_shard": first_shard[key],
                                "detail": f"key {key!r} was indexed from {first_shard[key]} already (first kept)"})
                    continue
                first_shard[key] = str(shard)
                members = {s: list(spans[s]) for s in MEMBER_SUFFIXES if s in spans}
                row = {"key": key, "shard": rel, "members": members, "latent_shape": thw,
                       "channels": int(latent.shape[0]),
                       "text_shape": None if text is None else [int(v) for v in text.shape], "tokens": tokens}
                lines.append(json.dumps(row) + "\n")
                count += 1
            after = os.stat(shard)
            if (before.st_size, before.st_mtime_ns) != (after.st_size, after.st_mtime_ns):
                raise ValueError(f"shard {shard} changed while it was indexed (size or mtime); {REINDEX} once it is "
                                 f"written")
            out.write(json.dumps(shard_record(rel, after, table.hexdigest())) + "\n")
            out.writelines(lines)
    return count, bad


_ROW_FIELDS = {"key": str, "shard": str, "members": dict, "latent_shape": list, "channels": int}
_SHARD_FIELDS = {"shard": str, "size": int, "mtime_ns": int, "member_table_sha256": str}
_MEMBER_COLUMN = {suffix: i for i, suffix in enumerate(MEMBER_SUFFIXES)}
_CHUNK_ROWS = 1 << 16  # rows parsed into Python objects before they are packed into numpy columns
_SHA256_HEX = re.compile(r"^[0-9a-f]{64}$")


@dataclass(frozen=True, eq=False)
class SampleIndex:
    """An index in memory as numpy columns (N samples, S shards): no Python object per sample, so
    its arrays take about 140 bytes a sample (1.4 GB at 10M, benchmarks/data/index_load.py), and forked
    DataLoader workers share the pages (a list of dicts is copied into every worker page by page
    as reference counts change).

    shard_paths: S absolute shard paths; shard: (N,) int32 position in shard_paths.
    member_offset, member_size: (N, len(MEMBER_SUFFIXES)) int64 bytes into the tar, -1 = absent.
    member_header: (N, len(MEMBER_SUFFIXES)) int32 bytes of tar header records before each
        member's data (512 for a plain header; more with PAX or GNU long-name records), -1 = absent.
    latent_shape: (N, 3) int32 (T, H, W); channels: (N,) int32 C.
    text_shape: (N, 2) int32 (L, D), -1 where the sample has no text embedding.
    tokens: (N,) int64 tokens the indexer computed, -1 where the line has none.
    key_blob: (total key bytes,) uint8 UTF-8 keys back to back; key_end: (N,) int64 end of key i.
    shard_size, shard_mtime_ns: (S,) int64 each shard's size (bytes) and mtime when indexed.
    shard_sha256: (S, 32) uint8 sha256 of each shard's member table when indexed.
    """

    shard_paths: list[str]
    shard: np.ndarray
    member_offset: np.ndarray
    member_size: np.ndarray
    member_header: np.ndarray
    latent_shape: np.ndarray
    channels: np.ndarray
    text_shape: np.ndarray
    tokens: np.ndarray
    key_blob: np.ndarray
    key_end: np.ndarray
    shard_size: np.ndarray
    shard_mtime_ns: np.ndarray
    shard_sha256: np.ndarray

    def __len__(self) -> int:
        return len(self.shard)

    def key(self, i: int) -> str:
        i = range(len(self))[i]  # negative i counts from the end, as for the other columns
        start = int(self.key_end[i - 1]) if i > 0 else 0
        return self.key_blob[start: int(self.key_end[i])].tobytes().decode()

    def shard_path(self, i: int) -> str:
        return self.shard_paths[self.shard[i]]

    def members(self, i: int) -> dict[str, tuple[int, int, int]]:
        """{suffix: (data offset, size, header offset)} of sample i's members, bytes into its shard."""
        spans = zip(MEMBER_SUFFIXES, self.member_offset[i], self.member_size[i], self.member_header[i])
        return {s: (int(o), int(n), int(o) - int(h)) for s, o, n, h in spans if o >= 0}

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
            member_size=self.member_size[rows], member_header=self.member_header[rows],
            latent_shape=self.latent_shape[rows], channels=self.channels[rows], text_shape=self.text_shape[rows],
            tokens=self.tokens[rows], key_blob=self.key_blob[ranges_to_positions(key_start, key_len)],
            key_end=np.cumsum(key_len), shard_size=self.shard_size, shard_mtime_ns=self.shard_mtime_ns,
            shard_sha256=self.shard_sha256)


def _check_header_line(row: dict, where: str) -> None:
    """The first line of an index: its format and version, or a clear error for anything else."""
    if row.get("format") == INDEX_FORMAT and row.get("version") == INDEX_VERSION:
        return
    if "key" in row:
        raise ValueError(f"{where}: this index was written by an older adaptiveload (format version 1: no header "
                         f"line, no shard identities, duplicate keys not checked); {REINDEX} to rebuild it")
    if row.get("format") == INDEX_FORMAT:
        raise ValueError(f"{where}: index format version {row.get('version')!r}, this code reads version "
                         f"{INDEX_VERSION}; {REINDEX} with this version")
    raise ValueError(f"{where}: not an adaptiveload index: the first line must be "
                     f"{json.dumps({'format': INDEX_FORMAT, 'version': INDEX_VERSION})}, got {json.dumps(row)[:200]}")


def _parse_shard_record(row: dict, where: str) -> tuple[int, int, bytes]:
    """(size, mtime_ns, member table sha256) of a shard record line."""
    for field, kind in _SHARD_FIELDS.items():
        if type(row.get(field)) is not kind:
            raise ValueError(f"{where}: shard record field {field!r} must be a {kind.__name__}, got {row.get(field)!r}")
    if row["size"] < 0 or not _SHA256_HEX.match(row["member_table_sha256"]):
        raise ValueError(f"{where}: shard record needs size >= 0 and a 64-digit hex member_table_sha256, "
                         f"got {row['size']} and {row['member_table_sha256']!r}")
    return row["size"], row["mtime_ns"], bytes.fromhex(row["member_table_sha256"])


def _parse_row(row: dict, where: str, shard_ids: dict[str, int], shard_sizes: list[int]
               ) -> tuple[tuple[int, ...], bytes]:
    """Check one sample line; returns it as a flat tuple of ints (the _COLUMNS, shard as its number
    in `shard_ids`) and its key as UTF-8 bytes. Its shard must have a record on an earlier line
    (`shard_sizes[number]` its size): every member must lie inside it, after its tar header."""
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
    shard = shard_ids.get(row["shard"])
    if shard is None:
        raise ValueError(f"{where}: shard {row['shard']!r} has no shard record on an earlier line; {REINDEX}")
    offsets, sizes, headers = [-1] * len(MEMBER_SUFFIXES), [-1] * len(MEMBER_SUFFIXES), [-1] * len(MEMBER_SUFFIXES)
    for suffix, span in row["members"].items():
        if suffix not in _MEMBER_COLUMN:
            raise ValueError(f"{where}: field 'members' has suffix {suffix!r}, expected one of {MEMBER_SUFFIXES}")
        # unrolled is_int_list(span, 3, 0): this runs for every member of every line
        offset, size, header = span if type(span) is list and len(span) == 3 else (None, None, None)
        if not (type(offset) is type(size) is type(header) is int and size >= 0 and header >= 0):
            raise ValueError(f"{where}: member {suffix!r} must be [data offset, size, header offset] integers >= 0, "
                             f"got {span!r}")
        if offset % _BLOCK or header % _BLOCK or not _BLOCK <= offset - header < 2**31:
            raise ValueError(f"{where}: member {suffix!r} span {span}: tar headers and data start at multiples of "
                             f"{_BLOCK} bytes, the data at least one header after the header offset")
        if offset + size > shard_sizes[shard]:
            raise ValueError(f"{where}: member {suffix!r} of key {row['key']!r} spans bytes [{offset}, "
                             f"{offset + size}), past the end of shard {row['shard']!r} ({shard_sizes[shard]} bytes "
                             f"when indexed)")
        column = _MEMBER_COLUMN[suffix]
        offsets[column], sizes[column], headers[column] = offset, size, offset - header
    key = row["key"].encode()
    return (shard, *offsets, *sizes, *headers, *row["latent_shape"], row["channels"], *(text or (-1, -1)), tokens,
            len(key)), key


# Columns of SampleIndex in _parse_row's flat tuple: name -> (position, dtype).
_M = len(MEMBER_SUFFIXES)
_COLUMNS = {"shard": (0, np.int32), "member_offset": (slice(1, 1 + _M), np.int64),
            "member_size": (slice(1 + _M, 1 + 2 * _M), np.int64),
            "member_header": (slice(1 + 2 * _M, 1 + 3 * _M), np.int32),
            "latent_shape": (slice(1 + 3 * _M, 4 + 3 * _M), np.int32), "channels": (4 + 3 * _M, np.int32),
            "text_shape": (slice(5 + 3 * _M, 7 + 3 * _M), np.int32), "tokens": (7 + 3 * _M, np.int64),
            "key_len": (8 + 3 * _M, np.int64)}
_ROW_LEN = 9 + 3 * _M


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
    cached = load_cache(cache_path, source)
    if cached is not None:
        return _as_index(base, *cached)
    shards, arrays = _parse_index(path)
    after = os.stat(path)
    # written only if the file did not change while it was parsed: else the arrays may be of other
    # bytes than the hash (a later load would then reparse, unless the file went back to the hashed bytes)
    if (after.st_ino, after.st_size, after.st_mtime_ns) == (source.inode, source.size, source.mtime_ns):
        write_cache(cache_path, source, shards, arrays)
    return _as_index(base, shards, arrays)


def _parse_index(path: Path) -> tuple[list[str], dict[str, np.ndarray]]:
    """(shard paths as the lines give them, the SampleIndex arrays). Every _CHUNK_ROWS lines are
    packed into numpy, so parsing holds few Python objects. A file without any line is an empty
    index; one that repeats a key is refused (`_check_unique_keys`)."""
    shard_ids: dict[str, int] = {}
    shard_info: list[tuple[int, int, bytes]] = []  # (size, mtime_ns, member table sha256) per shard number
    shard_sizes: list[int] = []
    pieces: dict[str, list[np.ndarray]] = {name: [] for name in (*_COLUMNS, "key_hash", "line")}
    blobs, rows, keys, lines = [], [], [], []

    def pack() -> None:
        table = np.array(rows, dtype=np.int64).reshape(len(rows), _ROW_LEN)
        for name, (position, dtype) in _COLUMNS.items():
            pieces[name].append(table[:, position].astype(dtype))
        pieces["key_hash"].append(np.fromiter(map(hash, keys), dtype=np.int64, count=len(keys)))
        pieces["line"].append(np.array(lines, dtype=np.int64))
        blobs.append(np.frombuffer(b"".join(keys), dtype=np.uint8))
        rows.clear()
        keys.clear()
        lines.clear()

    header_seen = False
    for line_no, row in iter_objects(path):
        where = f"{path}:{line_no}"
        if not header_seen:
            _check_header_line(row, where)
            header_seen = True
        elif "key" in row:
            ints, key = _parse_row(row, where, shard_ids, shard_sizes)
            rows.append(ints)
            keys.append(key)
            lines.append(line_no)
            if len(rows) == _CHUNK_ROWS:
                pack()
        elif "member_table_sha256" in row:
            record = _parse_shard_record(row, where)
            if row["shard"] in shard_ids:
                raise ValueError(f"{where}: a second shard record for {row['shard']!r}; {REINDEX}")
            shard_ids[row["shard"]] = len(shard_info)
            shard_info.append(record)
            shard_sizes.append(record[0])
        else:
            raise ValueError(f"{where}: neither a sample line (no 'key') nor a shard record (no 'member_table_sha256')")
    pack()
    arrays = {name: np.concatenate(parts) for name, parts in pieces.items()}
    arrays["key_end"] = np.cumsum(arrays.pop("key_len"))
    arrays["key_blob"] = np.concatenate(blobs)
    _check_unique_keys(path, arrays.pop("key_hash"), arrays.pop("line"), arrays["key_blob"], arrays["key_end"])
    arrays["shard_size"] = np.array([size for size, _, _ in shard_info], dtype=np.int64)
    arrays["shard_mtime_ns"] = np.array([mtime for _, mtime, _ in shard_info], dtype=np.int64)
    arrays["shard_sha256"] = np.frombuffer(b"".join(d for _, _, d in shard_info), dtype=np.uint8).reshape(-1, 32)
    return list(shard_ids), arrays


def _check_unique_keys(path: Path, key_hash: np.ndarray, line: np.ndarray, key_blob: np.ndarray,
                       key_end: np.ndarray) -> None:
    """Refuse an index that lists a key twice: the sample would be trained twice an epoch and its key
    in logs would name two samples. Keys with equal hashes (`hash` of their bytes) are compared in full."""
    order = np.argsort(key_hash, kind="stable")
    same = np.flatnonzero(key_hash[order][1:] == key_hash[order][:-1])
    key_start = key_end - np.diff(key_end, prepend=0)
    for a, b in zip(order[same], order[same + 1]):
        first, second = (key_blob[key_start[i]: key_end[i]].tobytes() for i in (a, b))
        if first == second:
            raise ValueError(f"{path}:{line[b]}: key {first.decode()!r} is also on line {line[a]}; an index lists each "
                             f"key once (duplicate samples train twice an epoch); {REINDEX}, which keeps the first")


def _as_index(base: Path, shards: list[str], arrays: dict[str, np.ndarray]) -> SampleIndex:
    return SampleIndex(shard_paths=[str(base / s) for s in shards], **arrays)


# --- what the index knows about its shards and samples ---------------------------------------------

def check_shards(index: SampleIndex, where: str | Path) -> None:
    """Check that the shards `index`'s samples lie in still hold what was indexed, before training
    reads them by byte offset: each exists and is readable (else FileNotFoundError), and has the
    indexed size and mtime; where only the mtime differs (a copy that did not keep it), its member
    table is read again and must have the indexed digest. A changed shard raises ValueError naming
    it: its offsets may now point into other samples. `where` names the index in messages.
    Cost: one stat per shard, plus a read of every tar header of a shard whose mtime differs."""
    missing, changed, relisted = [], [], []
    for s in np.unique(index.shard).tolist():
        path = index.shard_paths[s]
        try:
            st = os.stat(path)
        except OSError as e:
            missing.append(f"{path} ({e.strerror})")
            continue
        if not os.access(path, os.R_OK):
            missing.append(f"{path} (not readable)")
        elif st.st_size != index.shard_size[s]:
            changed.append(f"{path} ({int(index.shard_size[s])} bytes when indexed, {st.st_size} now)")
        elif st.st_mtime_ns != index.shard_mtime_ns[s]:
            if member_table_sha256(path) == index.shard_sha256[s].tobytes().hex():
                relisted.append(path)
            else:
                changed.append(f"{path} (same size, but another member table: samples moved, renamed or replaced)")
    if missing:
        raise FileNotFoundError(f"index {where}: {len(missing)} shards it lists are missing or unreadable (deleted "
                                f"or moved after indexing?), e.g. {missing[:3]}; {REINDEX} for the shards there "
                                f"are now")
    if changed:
        raise ValueError(f"index {where}: {len(changed)} shards changed after indexing, e.g. {changed[:3]}; "
                         f"reading them by the indexed offsets could give one sample's data under another's key; "
                         f"{REINDEX}")
    if relisted:
        log.warning("index %s: %d shards have another mtime than when indexed but the same member table (copied "
                    "without keeping mtimes?), e.g. %s; their tar headers are read again at every start until you %s",
                    where, len(relisted), relisted[:3], REINDEX)


def _open_shard(fd_cache: OrderedDict, shard: str) -> int:
    """A read-only descriptor of `shard` from `fd_cache` (most recently used last), opened and the
    least recently used one closed when needed, so at most MAX_OPEN_SHARDS stay open."""
    fd = fd_cache.pop(shard, None)
    if fd is None:
        try:
            fd = os.open(shard, os.O_RDONLY)
        except OSError as e:
            raise BadSample("read_error", f"cannot open shard {shard}: {e}") from None
        if len(fd_cache) >= MAX_OPEN_SHARDS:
            os.close(fd_cache.popitem(last=False)[1])
    fd_cache[shard] = fd
    return fd


def _check_member_header(head: bytes, shard: str, key: str, suffix: str, offset: int, size: int) -> None:
    """The tar header records `head` (read just before a member's data) must name `key`.`suffix`, a
    regular file of `size` bytes; else the shard changed after indexing (BadSample "shard_changed")."""
    try:
        info = tarfile.TarFile(fileobj=io.BytesIO(head), mode="r").firstmember  # resolves PAX/GNU long names
    except Exception:  # noqa: BLE001 - no parsable header there is a changed shard, whatever the parser says
        info = None
    if info is not None and info.isfile() and info.size == size and split_member_name(info.name) == (key, suffix):
        return
    found = "no valid tar header" if info is None else f"a header of {info.name!r} ({info.size} bytes)"
    raise BadSample("shard_changed", f"{shard}: the index puts {key}.{suffix} ({size} bytes) at byte {offset}, the "
                                     f"shard has {found} there: it changed after indexing; {REINDEX}")


def read_members(fd_cache: OrderedDict, shard: str, members: dict[str, tuple[int, int, int]],
                 key: str) -> dict[str, bytes]:
    """Member bytes of sample `key` by positioned reads: per member, its tar header records (checked
    to name `key` and the member's suffix and size, so a shard rewritten after indexing never gives
    another sample's bytes) and then its data. `members`: {suffix: (data offset, size, header offset)}.
    `fd_cache` (shard path -> open file descriptor) is kept per process, a DataLoader worker opens
    its own; it holds at most MAX_OPEN_SHARDS descriptors, so thousands of shards stay under
    ulimit -n. Any failure is a BadSample: "shard_changed" for a header that does not match,
    "read_error" for anything else (I/O errors, short reads, memory)."""
    fd = _open_shard(fd_cache, shard)
    files = {}
    for suffix, (offset, size, header) in members.items():
        head = _pread(fd, offset - header, header, f"{shard}: tar header of member {suffix}")
        _check_member_header(head, shard, key, suffix, offset, size)  # before the data: a changed size is not read
        files[suffix] = _pread(fd, size, offset, f"{shard}: member {suffix}")
    return files


def _pread(fd: int, size: int, offset: int, what: str) -> bytes:
    """`size` bytes at `offset`; any failure (I/O error, short read, memory) is a BadSample("read_error")."""
    try:
        data = os.pread(fd, size, offset)
    except Exception as e:  # noqa: BLE001 - a failure to read one sample is that sample's skip, not the run's end
        raise BadSample("read_error", f"{what} at byte {offset}: {type(e).__name__}: {e}") from None
    if len(data) != size:
        raise BadSample("read_error", f"{what} at byte {offset} is short ({len(data)} of {size} bytes)")
    return data


def index_fingerprint(index: SampleIndex, seq_lens: np.ndarray | None = None) -> str:
    """What a resume state must match: the sample count and a sha256 prefix of the keys in order
    (and of `seq_lens`, (N,) int tokens each sample is scheduled at, if given). Position i of a
    sampler's plan names the same sample only while this is unchanged. About 1 s per 10M keys."""
    digest = hashlib.sha256(np.ascontiguousarray(index.key_end, dtype=np.int64).data)
    digest.update(np.ascontiguousarray(index.key_blob).data)
    if seq_lens is not None:
        digest.update(np.ascontiguousarray(seq_lens, dtype=np.int64).data)
    return f"{len(index)} samples, sha256 {digest.hexdigest()[:16]}"


def summarize_bad(bad: list[dict]) -> str:
    """One line: count per reason."""
    counts = Counter(b["reason"] for b in bad)
    return ", ".join(f"{reason}={n}" for reason, n in sorted(counts.items())) or "none"


def summarize_duplicates(bad: list[dict]) -> list[str]:
    """One line per (shard, shard of the kept samples) pair of the duplicate keys in `bad`, most first:
    a shard copied under another name shows as all of its samples repeating one other shard's keys."""
    pairs = Counter((b["shard"], b["first_shard"]) for b in bad if b["reason"] == "duplicate_key")
    return [f"{n} samples of {shard} repeat keys of {first}" if shard != first else f"{n} samples of {shard} repeat "
            f"keys earlier in the same shard" for (shard, first), n in pairs.most_common()]

"""What an encode run keeps on disk so that it can be resumed, split over ranks and finished by
one index: per rank a journal of its completed shards, its bad inputs and a done marker, all JSON.

    OUT/shard-r00000-000000.tar ...        rank 0's shards (each written as .tar.partial, renamed when whole)
    OUT/encode-state/r00000.jsonl          rank 0's journal: a header (format, config), then one line per
                                           shard once it is renamed: {"shard", "size", "member_table_sha256",
                                           "member_crc32": {member name: crc32 hex of its bytes},
                                           "losses": what its inputs lost (`merge_losses`),
                                           "inputs": [ids], "keys": [...]}
    OUT/encode-state/bad-r00000.jsonl      rank 0's bad inputs of its last run: {"path", "id", "reason", "detail"}
    OUT/encode-state/r00000.done.json      written when rank 0 finished all its inputs
    OUT/empty_prompt.text.npy              the empty prompt's text embedding (rank 0, data/shards.py's format)
    OUT/index.jsonl, OUT/bad.jsonl, OUT/encode_summary.json   written by `finalize`

A shard is in the journal only after it is whole on disk, so a kill leaves at worst a
`.partial` file or a renamed shard without its journal line; a restart deletes both and encodes
their inputs again. A restart also checks every journaled shard (size, member table and, with
check="full", every member's crc32 against the one computed from the bytes handed to the tar
writer, and every sample decoded and validated as the DataModule would) and rewrites a shard
that fails: a flipped bit in a latent is found, not trained on. Ranks agree without a process
group: each writes its done marker; the rank that finds every marker present claims the finalize
step with an exclusive file create (`finalize-<digest of the markers>.claim`), so exactly one
builds the index.
"""
from __future__ import annotations

import datetime
import hashlib
import json
import os
import re
import uuid
import zlib
from pathlib import Path

from lightning_adaptiveload._jsonl import iter_objects
from lightning_adaptiveload.data.index import build_index, scan_shard
from lightning_adaptiveload.data.shards import EMPTY_PROMPT_FILE, BadSample, inspect_sample
from lightning_adaptiveload.scheduling.model_io import write_json
from lightning_adaptiveload.scheduling.shapes import TokenSpec

STATE_DIR = "encode-state"
JOURNAL_FORMAT = "adaptiveload-encode-journal"
JOURNAL_VERSION = 2  # 1: no member checksums
CHECKS = ("full", "headers")  # a resumed shard: every sample decoded and validated, or its tar headers only
_SHARD = re.compile(r"^shard-r(\d{5})-(\d{6})\.tar(\.partial)?$")


def shard_name(rank: int, number: int) -> str:
    return f"shard-r{rank:05d}-{number:06d}.tar"


def read_records(path: Path) -> list[dict]:
    """The JSON objects of a JSONL file this module appends to ([] if it does not exist); a torn
    last line (`_append` killed mid-write) is left out, any other line that is not a JSON object is
    an error naming `path:line`."""
    try:
        return [record for _, record in iter_objects(path, torn_tail=True)]
    except FileNotFoundError:
        return []


def _append(f, record: dict) -> None:
    """One line in one write, flushed and synced: a kill leaves whole lines and at most one torn last line."""
    f.write((json.dumps(record) + "\n").encode())
    f.flush()
    os.fsync(f.fileno())


NO_LOSSES = {"tail_frames_left_out": 0, "trimmed": 0, "upscaled": 0, "max_upscale": 1.0}


def merge_losses(total: dict, losses: dict) -> dict:
    """`total` plus `losses`, both dicts of NO_LOSSES's fields: frames left out at clips' ends,
    clips trimmed (long="trim"), inputs upscaled (summed) and the largest upscale factor (max)."""
    merged = {k: total[k] + losses[k] for k in ("tail_frames_left_out", "trimmed", "upscaled")}
    return {**merged, "max_upscale": max(total["max_upscale"], losses["max_upscale"])}


def member_checksums(key: str, files: dict[str, bytes]) -> dict[str, str]:
    """{member name: crc32 of its bytes, 8 hex digits} of one sample. crc32 finds every 1-bit and
    every burst of up to 32 flipped bits (what a bad disk or transfer does) at GB/s: a resume
    check costs the read, not the hash."""
    return {f"{key}.{suffix}": f"{zlib.crc32(data):08x}" for suffix, data in sorted(files.items())}


def check_shard(path: Path, entry: dict, check: str) -> str:
    """What is wrong with a journaled shard ('' if nothing): missing, another size, another member
    table than when written, or (check="full") a member whose bytes have another crc32 than those
    written, a sample that does not decode and validate (`inspect_sample`: JSON, latent
    dtype/shape/finite, text) or other keys than journaled."""
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        return "missing"
    if size != entry["size"]:
        return f"{size} bytes, {entry['size']} when written"
    table, keys = hashlib.sha256(), []
    read = None if check == "full" else set()
    for key, _, files, error in scan_shard(path, read=read, table=table):
        if error is not None:
            return str(error)
        if check == "full":
            for member, crc in member_checksums(key, files).items():
                if entry["member_crc32"].get(member) != crc:
                    return f"member {member}: crc32 {crc}, {entry['member_crc32'].get(member)} when written"
            try:
                inspect_sample(key, files)
            except BadSample as e:
                return f"sample {key}: {e}"
        keys.append(key)
    if table.hexdigest() != entry["member_table_sha256"]:
        return "another member table than when written"
    if keys != entry["keys"]:
        return f"holds keys {keys[:3]}... , the journal {entry['keys'][:3]}..."
    return ""


class RankState:
    """One rank's journal, bad list and done marker in OUT/encode-state (see the module docstring).
    `config` (JSON-able) is what the written samples depend on: a resume with another config is
    refused, as its samples would mix with the old ones."""

    def __init__(self, out_dir: str | Path, rank: int, world_size: int, config: dict):
        if not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, world_size), got rank {rank} of world_size {world_size}")
        self.out, self.rank, self.world_size = Path(out_dir), rank, world_size
        self.config = json.loads(json.dumps(config))  # as it reads back from the journal
        self.dir = self.out / STATE_DIR
        self.journal = self.dir / f"r{rank:05d}.jsonl"
        self.bad_path = self.dir / f"bad-r{rank:05d}.jsonl"
        self.done_path = self.dir / f"r{rank:05d}.done.json"
        self.entries: list[dict] = []
        self.next_number = 0
        self._journal_file = self._bad_file = None

    def header(self) -> dict:
        return {"format": JOURNAL_FORMAT, "version": JOURNAL_VERSION, "rank": self.rank,
                "world_size": self.world_size, "config": self.config}

    def resume(self, check: str = "full", log=print) -> set[str]:
        """Start (or restart) this rank: remove its done marker, check its journaled shards, delete
        shards that fail and files no journal line vouches for, rewrite the journal, truncate the
        bad list (bad inputs are tried again: a caption added since is picked up). Returns the ids
        of inputs whose samples are in shards that passed."""
        if check not in CHECKS:
            raise ValueError(f"check must be one of {CHECKS}, got {check!r}")
        self.dir.mkdir(parents=True, exist_ok=True)
        records = read_records(self.journal)
        if records:
            self._check_header(records[0])  # before anything changes: a refused resume leaves the folder as it was
        self.done_path.unlink(missing_ok=True)
        kept, redo = [], []
        for entry in records[1:]:
            problem = check_shard(self.out / entry["shard"], entry, check)
            if problem:
                redo.append(f"{entry['shard']} ({problem})")
            else:
                kept.append(entry)
        known = {e["shard"] for e in kept}
        removed = []
        for path in sorted(self.out.iterdir()):
            match = _SHARD.match(path.name)
            if match and int(match.group(1)) == self.rank and path.name not in known:
                path.unlink()
                removed.append(path.name)
        if redo or removed:
            log(f"encode rank {self.rank}: resuming; shards that failed their check and are rewritten: "
                f"{redo or 'none'}; files removed (unfinished or not journaled): {removed or 'none'}")
        self.entries = kept
        self.next_number = 1 + max((int(_SHARD.match(e["shard"]).group(2)) for e in kept), default=-1)
        tmp = self.journal.with_name(self.journal.name + ".tmp")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in [self.header(), *kept]))
        os.replace(tmp, self.journal)
        self._journal_file = open(self.journal, "ab")
        self._bad_file = open(self.bad_path, "wb")
        return {i for e in kept for i in e["inputs"]}

    def _check_header(self, header: dict) -> None:
        if header.get("format") == JOURNAL_FORMAT and header.get("version") == 1:
            raise ValueError(f"{self.journal}: written by an older version of adaptiveload encode, whose journal "
                             f"holds no checksums of the shards' bytes; encode into a new folder")
        if header.get("format") != JOURNAL_FORMAT or header.get("version") != JOURNAL_VERSION:
            raise ValueError(f"{self.journal}:1: not an encode journal of version {JOURNAL_VERSION}: "
                             f"{json.dumps(header)[:200]}")
        if header.get("world_size") != self.world_size:
            raise ValueError(f"{self.journal}: written with world_size {header.get('world_size')}, this run has "
                             f"{self.world_size}; inputs are split by world size, so resume with the same one (or "
                             f"encode into a new folder)")
        old = header.get("config", {})
        changed = sorted(k for k in old.keys() | self.config.keys() if old.get(k) != self.config.get(k))
        if changed:
            raise ValueError(f"{self.journal}: the samples there were encoded with other settings "
                             f"({', '.join(changed)} differ); encode into a new folder, or resume with the same settings")

    def add_shard(self, name: str, inputs: list[str], keys: list[str], checksums: dict[str, str],
                  losses: dict) -> None:
        """Journal shard `name` (already renamed into place) with the inputs and keys it holds,
        `checksums` ({member name: crc32 hex}, of the bytes given to the tar writer: what was meant
        to be on disk, not what a read-back would find) and what its inputs lost (`merge_losses`;
        kept per shard so that the summary's counts survive resumes)."""
        path = self.out / name
        table = hashlib.sha256()
        for _ in scan_shard(path, read=set(), table=table):
            pass
        entry = {"shard": name, "size": path.stat().st_size, "member_table_sha256": table.hexdigest(),
                 "member_crc32": checksums, "losses": losses, "inputs": inputs, "keys": keys}
        _append(self._journal_file, entry)
        self.entries.append(entry)

    def add_bad(self, record: dict) -> None:
        _append(self._bad_file, record)

    def close(self) -> None:
        for f in (self._journal_file, self._bad_file):
            if f is not None:
                f.close()
        self._journal_file = self._bad_file = None

    def write_done(self, summary: dict) -> None:
        """The done marker: this rank finished every input it was given. `attempt` is new each run,
        so a finalize claim of an earlier set of markers never blocks a later one."""
        write_json(self.done_path, {"rank": self.rank, "world_size": self.world_size, "attempt": uuid.uuid4().hex,
                                     "finished": _now(), **summary})


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def done_markers(out_dir: str | Path) -> tuple[list[dict], int | None]:
    """(done markers found, world size they name or None if none)."""
    markers = []
    for path in sorted((Path(out_dir) / STATE_DIR).glob("r*.done.json")):
        markers.append(json.loads(path.read_text()))
    sizes = {m["world_size"] for m in markers}
    if len(sizes) > 1:
        raise ValueError(f"{Path(out_dir) / STATE_DIR}: done markers of different world sizes {sorted(sizes)}; "
                         f"remove the stale ones (and their ranks' shards) or encode into a new folder")
    return markers, (sizes.pop() if sizes else None)


def claim_finalize(out_dir: str | Path) -> bool:
    """True for exactly one caller once every rank's done marker is present: the claim is an
    exclusive create of a file named by a digest of the markers' attempts, so ranks finishing at
    the same moment see the same name and only one create succeeds."""
    markers, world_size = done_markers(out_dir)
    if world_size is None or len(markers) < world_size:
        return False
    digest = hashlib.sha256(" ".join(sorted(m["attempt"] for m in markers)).encode()).hexdigest()[:16]
    try:
        os.close(os.open(Path(out_dir) / STATE_DIR / f"finalize-{digest}.claim", os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return False
    return True


def finalize(out_dir: str | Path, index: str | Path | None = None, check: str = "headers",
             progress: bool = True) -> dict:
    """Build the index of every rank's journaled shards (`build_index`; none if no sample was
    written), merge the ranks' bad lists into OUT/bad.jsonl and write OUT/encode_summary.json;
    returns the summary. Refused
    (ValueError naming what) while a rank has no done marker, when ranks listed different inputs
    or used different settings, or when a journaled shard fails its check."""
    out = Path(out_dir)
    markers, world_size = done_markers(out)
    if world_size is None:
        raise ValueError(f"{out}: no encode done markers in {out / STATE_DIR}; run `adaptiveload encode` first")
    missing = sorted(set(range(world_size)) - {m["rank"] for m in markers})
    if missing:
        raise ValueError(f"{out}: ranks {missing} of {world_size} have not finished (no done marker); run or resume "
                         f"them, then finalize")
    listings = {(m["inputs_listed"], m["inputs_sha256"]) for m in markers}
    if len(listings) > 1:
        raise ValueError(f"{out}: ranks listed different inputs ({sorted(listings)}: input count, digest); the source "
                         f"changed between ranks' starts: resume the ranks with the old listing")
    journals = [read_records(out / STATE_DIR / f"r{rank:05d}.jsonl") for rank in range(world_size)]
    if any(j and j[0].get("version") != JOURNAL_VERSION for j in journals):
        raise ValueError(f"{out}: written by another version of adaptiveload encode (journal version "
                         f"{sorted({j[0].get('version') for j in journals if j})}, this one reads "
                         f"{JOURNAL_VERSION}); encode into a new folder")
    configs = {json.dumps(j[0]["config"], sort_keys=True) for j in journals if j}
    if len(configs) > 1:
        raise ValueError(f"{out}: ranks encoded with different settings; encode them again with one command")
    shards, problems = [], []
    for journal in journals:
        for entry in journal[1:]:
            problem = check_shard(out / entry["shard"], entry, check)
            if problem:
                problems.append(f"{entry['shard']}: {problem}")
            else:
                shards.append(str(out / entry["shard"]))
    if problems:
        raise ValueError(f"{out}: shards changed since they were written: {problems[:3]}; resume their ranks to "
                         f"rewrite them")
    bad = [r for rank in range(world_size) for r in read_records(out / STATE_DIR / f"bad-r{rank:05d}.jsonl")]
    (out / "bad.jsonl").write_text("".join(json.dumps(r) + "\n" for r in bad))
    config = json.loads(configs.pop())
    index = Path(index) if index is not None else out / "index.jsonl"
    index.unlink(missing_ok=True)  # an index of an earlier finalize must not outlive the shards it listed
    count = 0
    if shards:  # else every input was bad: no index, the summary and bad.jsonl say why
        spec = TokenSpec(**{k: (tuple(v) if k == "patch" else v) for k, v in config["token_spec"].items()})
        count, left_out = build_index(sorted(shards), index, spec, progress=progress, duplicates="error")
        if left_out:
            index.unlink()
            raise ValueError(f"{out}: {len(left_out)} written samples failed indexing, e.g. {left_out[:2]}")
    reasons: dict[str, int] = {}
    for r in bad:
        reasons[r["reason"]] = reasons.get(r["reason"], 0) + 1
    empty_prompt = out / EMPTY_PROMPT_FILE
    losses = NO_LOSSES
    for journal in journals:
        for entry in journal[1:]:
            losses = merge_losses(losses, entry["losses"])
    summary = {"finished": _now(), "world_size": world_size, "index": str(index) if count else None, "samples": count,
               "shards": len(shards), "inputs_listed": markers[0]["inputs_listed"],
               "bad_inputs": len(bad), "bad_by_reason": dict(sorted(reasons.items())),
               **losses, "ignored": markers[0]["ignored"],
               "empty_prompt": str(empty_prompt) if config["text"] and empty_prompt.exists() else None,
               "config": config, "ranks": sorted(markers, key=lambda m: m["rank"])}
    write_json(out / "encode_summary.json", summary)
    return summary

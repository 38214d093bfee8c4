"""JSON Lines input (shapes files, sample indexes) with errors that name the file and line."""
from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path


def iter_objects(path: str | Path, torn_tail: bool = False) -> Iterator[tuple[int, dict]]:
    """(line number, object) for every non-blank line of a JSONL file; a line that is not a JSON
    object raises ValueError naming `path:line`. torn_tail: the file is appended to line by line
    (the encoder's journals), so a last line without its newline was being written when the
    process was killed: it is left out instead of raising."""
    with open(path, "rb") as f:  # decoded per line, so a bad byte is reported with its line
        for line_no, raw in enumerate(f, start=1):
            if torn_tail and not raw.endswith(b"\n"):
                return
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise ValueError(f"{path}:{line_no}: not UTF-8 text ({e.reason} at byte {e.start})") from None
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{line_no}: not valid JSON ({e.msg})") from None
            if not isinstance(row, dict):
                raise ValueError(f"{path}:{line_no}: expected a JSON object, got {type(row).__name__}")
            yield line_no, row

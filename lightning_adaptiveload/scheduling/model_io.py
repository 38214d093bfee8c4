"""The fitted models' JSON documents: one checked reader, one atomic writer, the `JsonDocument`
mixin over them, and the checks of a document's fields that CostModel, DepthCostModel and MemoryModel share (each check names the
file and the field, so a bad file is an error that says where).

Calibration writes its record and cache with `write_json` too: a reader (another rank, another job
sharing a cache) never sees half a file.
"""
from __future__ import annotations

import json
import math
import os
import tempfile
from pathlib import Path

from lightning_adaptiveload._validation import is_finite_number, require_number


def read_json(path) -> object:
    """The JSON value of the file at `path`; ValueError naming it when it cannot be read, is not
    JSON, or uses the non-standard constants NaN / Infinity."""
    def reject_constant(name):
        raise ValueError(f"{path}: non-standard JSON constant {name}")

    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as e:
        raise ValueError(f"{path}: cannot read ({e.strerror})") from None
    try:
        return json.loads(text, parse_constant=reject_constant)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e.msg} at line {e.lineno})") from None


def write_bytes(path, data: bytes) -> None:
    """Write `data` under a unique name beside `path` and rename it into place (folders made as
    needed): a reader sees the old file or the new one, never a torn one."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_json(path, doc: dict) -> None:
    """Write `doc` as indented JSON (NaN refused: write null), atomically (`write_bytes`)."""
    write_bytes(path, (json.dumps(doc, indent=1, allow_nan=False) + "\n").encode("utf-8"))


class JsonDocument:
    """The fitted models' `to_json` / `from_json`, over the class's own `to_dict()` and
    `from_dict(doc, where)` (the format of each: docs/cost_model.md, docs/memory.md)."""

    def to_json(self, path) -> None:
        """Write `to_dict()` as plain JSON (write_json: atomic)."""
        write_json(path, self.to_dict())

    @classmethod
    def from_json(cls, path):
        """Read a model written by to_json; ValueError naming the file for anything malformed."""
        return cls.from_dict(read_json(path), str(path))


def nan_to_none(values: dict) -> dict:
    """JSON has no NaN: unknown numbers are written as null."""
    return {k: (v if math.isfinite(v) else None) for k, v in values.items()}


def check_header(doc, where: str, fmt: str, version: int, keys: tuple[str, ...]) -> dict:
    """`doc` if it is an object with "format" `fmt`, "version" `version` and every key of `keys`."""
    if not isinstance(doc, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(doc).__name__}")
    if doc.get("format") != fmt:
        raise ValueError(f"{where}: 'format' must be {fmt!r}, got {doc.get('format')!r}")
    missing = [k for k in ("version", *keys) if k not in doc]
    if missing:
        raise ValueError(f"{where}: missing keys {missing}")
    if doc["version"] != version or isinstance(doc["version"], bool):
        raise ValueError(f"{where}: unsupported 'version' {doc['version']!r} (this reader knows {version})")
    return doc


def check_form(doc: dict, where: str, forms: tuple[str, ...]) -> str:
    """doc["form"] if it is one of `forms`."""
    if doc["form"] not in forms:
        raise ValueError(f"{where}: unknown 'form' {doc['form']!r}, expected one of {forms}")
    return doc["form"]


def check_json_int(doc: dict, key: str, where: str, minimum: int) -> int:
    """doc[key] if it is a JSON integer (not a bool, not a float) >= minimum."""
    value = doc[key]
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{where}: '{key}' must be an integer >= {minimum}, got {value!r}")
    return value


def check_params(params, names: tuple[str, ...], form: str, where: str) -> None:
    """`params` has exactly the keys `names`, each a finite number >= 0."""
    if not isinstance(params, dict) or set(params) != set(names):
        got = sorted(params) if isinstance(params, dict) else type(params).__name__
        raise ValueError(f"{where}: 'params' of form {form!r} must have keys {list(names)}, got {got}")
    for name, value in params.items():
        require_number(f"{where}: params[{name!r}]", value, minimum=0)


def check_quality(quality, keys: tuple[str, ...], where: str) -> dict:
    """The `keys` of `quality`, each a number or null; null read as NaN (unknown)."""
    if not isinstance(quality, dict):
        raise ValueError(f"{where}: 'quality' must be an object, got {type(quality).__name__}")
    for key in keys:
        if key not in quality:
            raise ValueError(f"{where}: 'quality' is missing {key!r}")
        if quality[key] is not None and not is_finite_number(quality[key]):
            raise ValueError(f"{where}: quality[{key!r}] must be a number or null, got {quality[key]!r}")
    return {k: (float("nan") if quality[k] is None else quality[k]) for k in keys}

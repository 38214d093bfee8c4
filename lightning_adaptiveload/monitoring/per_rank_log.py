"""The per-rank balance log: the one module that writes and reads `balance_per_rank.csv` and
`balance_meta.json` (LoadBalanceMonitor writes them on rank 0; `adaptiveload report` and
benchmarks/e2e/e2e.py read them).

The CSV holds one row per train batch per rank, the rows of one batch consecutive, rank 0 first;
in memory the same data is an array of shape (steps, ranks, len(FIELDS)), and reading gives one
(steps, ranks) float64 array per field (the axis order of scheduling/metrics.py).
"""
from __future__ import annotations

import csv
import json
import math
import os
from pathlib import Path

import numpy as np

CSV_NAME = "balance_per_rank.csv"
META_NAME = "balance_meta.json"
# One row per train batch and rank, in this order (the monitor's gathered tensor follows it too).
# busy_ms, comm_ms: NaN on batches that were not profiled. compile_*: counts on that rank since
# the start of training, at the end of the batch. peak_allocated_bytes, peak_reserved_bytes: the
# device's peak allocated and reserved memory during the batch's step (its optimizer step included),
# NaN off CUDA.
FIELDS = ("epoch", "step", "batch_idx", "samples", "tokens", "seq_len", "load", "step_time_ms", "interval_ms",
          "busy_ms", "comm_ms", "compile_recompiles", "compile_graph_breaks", "compile_limit_hits",
          "peak_allocated_bytes", "peak_reserved_bytes")
INT_FIELDS = frozenset(("epoch", "step", "batch_idx", "samples", "tokens", "seq_len", "compile_recompiles",
                        "compile_graph_breaks", "compile_limit_hits", "peak_allocated_bytes", "peak_reserved_bytes"))
CSV_HEADER = ("epoch", "step", "batch_idx", "rank") + FIELDS[3:]
# Columns added after the first release: a file written before them reads them as NaN.
OPTIONAL_FIELDS = ("busy_ms", "comm_ms", "compile_recompiles", "compile_graph_breaks", "compile_limit_hits",
                   "peak_allocated_bytes", "peak_reserved_bytes")
COLUMN = {name: i for i, name in enumerate(FIELDS)}


# The per-rank table: (field, label, width, format) of each column after the rank.
_RANK_TABLE = (("samples", "samples", 9, ".2f"), ("tokens", "tokens", 10, ".1f"), ("seq_len", "seq_len", 9, ".1f"),
               ("load", "load", 12, ".4g"), ("step_time_ms", "step_ms", 10, ".2f"), ("busy_ms", "busy_ms", 10, ".2f"),
               ("comm_ms", "comm_ms", 10, ".2f"))


def format_rank_table(means: dict[str, np.ndarray]) -> list[str]:
    """The per-rank table that LoadBalanceMonitor prints at the end of fit and `adaptiveload report`
    prints from the CSV: a header, then one line per rank. `means`: field -> (ranks,) mean of that
    field over the steps (busy_ms and comm_ms over the profiled steps; NaN, printed "-", where
    none was profiled)."""
    lines = [f"{'rank':>5} " + " ".join(f"{label:>{width}}" for _, label, width, _ in _RANK_TABLE)]
    for rank in range(len(means["samples"])):
        values = [(float(means[field][rank]), width, spec) for field, _, width, spec in _RANK_TABLE]
        lines.append(f"{rank:>5} " + " ".join(f"{'-':>{width}}" if math.isnan(value) else f"{value:>{width}{spec}}"
                                              for value, width, spec in values))
    return lines


def _cell(name: str, value: float) -> str:
    if math.isnan(value):
        return "nan"
    # Floats as exact float64 text: `adaptiveload report` recomputes CVs of nearly equal loads.
    return str(int(value)) if name in INT_FIELDS else repr(float(value))


def append_rows(path: str | Path, rows: np.ndarray) -> None:
    """Append `rows (steps, ranks, len(FIELDS))` to the CSV at `path` (header first if the file is
    new): per step, one line per rank, rank 0 first."""
    rows = np.asarray(rows, dtype=np.float64)
    if rows.ndim != 3 or rows.shape[2] != len(FIELDS):
        raise ValueError(f"per-rank rows must have shape (steps, ranks, {len(FIELDS)}), got {rows.shape}")
    new_file = not os.path.exists(path)
    with open(path, "a", newline="", encoding="utf-8") as f:
        writer = csv.writer(f)
        if new_file:
            writer.writerow(CSV_HEADER)
        for step_rows in rows:
            for rank, row in enumerate(step_rows):
                cells = [_cell(name, v) for name, v in zip(FIELDS, row.tolist())]
                writer.writerow(cells[:3] + [str(rank)] + cells[3:])


def read_per_rank_csv(path: str | Path) -> dict[str, np.ndarray]:
    """Every field of a balance_per_rank.csv as a (steps, ranks) float64 array (plus "rank").
    Columns of OPTIONAL_FIELDS missing from an older file are NaN."""
    with open(path, newline="", encoding="utf-8") as f:
        reader = csv.DictReader(f)
        present = reader.fieldnames or []
        missing = [c for c in CSV_HEADER if c not in present and c not in OPTIONAL_FIELDS]
        if missing:
            raise ValueError(f"{path}: not a LoadBalanceMonitor CSV, missing columns {missing}")
        columns = [c for c in CSV_HEADER if c in present]
        try:
            rows = [[float(r[c]) for c in columns] for r in reader]
        except (TypeError, ValueError) as e:
            raise ValueError(f"{path}: line {reader.line_num}: unreadable number ({e})") from None
    if not rows:
        raise ValueError(f"{path}: no rows")
    table = np.asarray(rows, dtype=np.float64)
    rank = table[:, columns.index("rank")].astype(np.int64)
    world = int(rank.max()) + 1
    # The monitor writes each batch as `world` consecutive rows, rank 0 first.
    if len(rank) % world or not np.array_equal(rank, np.tile(np.arange(world), len(rank) // world)):
        raise ValueError(f"{path}: rows are not grouped as one row per rank per batch (ranks 0..{world - 1})")
    out = {c: table[:, i].reshape(-1, world) for i, c in enumerate(columns)}
    for c in OPTIONAL_FIELDS:
        out.setdefault(c, np.full((len(rank) // world, world), np.nan))
    return out


def drop_rows_from_step(path: str | Path, step: int) -> None:
    """Remove the rows of optimizer steps >= `step`: a fit resumed from the checkpoint at `step`
    trains them again, and the file must hold every batch once. Incomplete rows (a run killed
    while writing) go too; this runs on rank 0 alone, so it must not raise on them. A file written
    before the OPTIONAL_FIELDS existed is rewritten with them (NaN), so appended rows fit it."""
    with open(path, newline="", encoding="utf-8", errors="replace") as f:
        rows = list(csv.reader(f))
    header = rows[0] if rows else list(CSV_HEADER)
    kept = [list(CSV_HEADER)]
    for row in rows[1:]:
        if len(row) != len(header):
            continue
        cells = dict(zip(header, row))
        if cells.get("step", "").isdigit() and int(cells["step"]) < step:
            kept.append([cells.get(c, "nan") for c in CSV_HEADER])
    if kept != rows:
        with open(path, "w", newline="", encoding="utf-8") as f:
            csv.writer(f).writerows(kept)


def write_meta(log_dir: str | Path, **meta) -> None:
    """Write `balance_meta.json` in `log_dir`: the given entries plus the field list."""
    with open(Path(log_dir) / META_NAME, "w", encoding="utf-8") as f:
        json.dump({**meta, "fields": list(FIELDS)}, f, indent=1)


def read_meta(log_dir: str | Path) -> dict:
    """The `balance_meta.json` of `log_dir` as a dict; {} if there is none."""
    path = Path(log_dir) / META_NAME
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: line {e.lineno}: not valid JSON ({e.msg})") from None

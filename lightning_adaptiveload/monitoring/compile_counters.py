"""Recompiles, graph breaks and recompile-limit hits of torch.compile, counted since a start point.

Dynamo keeps process-wide counters (read in torch 2.11-2.14's `torch/_dynamo/convert_frame.py`,
`exc.py`, `symbolic_convert.py`):

- `convert_frame.FRAME_COMPILE_COUNTER[frame_id]`: compilations attempted for one code object.
  Every one after the first is a recompile (a guard failed, e.g. a new input shape), including
  the attempt refused at the recompile limit.
- `utils.counters["graph_break"]`: message -> count of graph breaks.
- `utils.counters["unimplemented"]`: message -> count; a refused recompile adds one whose message
  starts "Dynamo recompile limit exceeded" (older releases: "cache_size_limit reached",
  "recompile_limit reached"). After it, dynamo runs that code eagerly for good: silently slower.
- `utils.guard_failures[code]`: why a call of a code object missed its compiled graphs, in order: one
  reason per cached graph whose guards failed before the call compiled a new one ("0/1: tensor 'x'
  size mismatch at index 1. expected 256, actual 3600", graph 1 of frame 0), kept while
  `config.report_guard_failures` is on (its default). `RecompileReasons` reads what is new since its
  last read: what TORCH_LOGS=recompiles would print, without touching the process's logging.

Every lookup is defensive: a counter a torch release does not have reads as None (not 0), so a
missing counter is never mistaken for "no recompiles". `torch._dynamo.reset()` clears these
counters; CompileCounter keeps its counts so far when a total drops, but the compiles between its
last read and a reset that leave the total no lower than it was are under-counted.
"""
from __future__ import annotations

import sys
from collections import Counter
from collections.abc import Callable

LIMIT_MESSAGES = ("recompile limit", "recompile_limit", "cache_size_limit", "cache size limit")
NAMES = ("recompiles", "graph_breaks", "limit_hits")


def read_dynamo_counts() -> dict[str, int | None]:
    """Process-wide totals {"recompiles", "graph_breaks", "limit_hits"} from dynamo's counters;
    all 0 when torch._dynamo was never imported (nothing can have compiled), None for a counter
    this torch release does not keep."""
    if "torch._dynamo" not in sys.modules:
        return dict.fromkeys(NAMES, 0)
    from torch._dynamo import convert_frame, utils

    frame_compiles = getattr(convert_frame, "FRAME_COMPILE_COUNTER", None)
    counters = getattr(utils, "counters", None)
    recompiles = None
    if frame_compiles is not None:
        recompiles = sum(max(int(n) - 1, 0) for n in frame_compiles.values())
    graph_breaks = limit_hits = None
    if counters is not None:
        # .get: counters is a defaultdict; reading must not create categories.
        graph_breaks = int(sum(counters.get("graph_break", {}).values()))
        limit_hits = int(sum(n for msg, n in counters.get("unimplemented", {}).items()
                             if any(m in str(msg).lower() for m in LIMIT_MESSAGES)))
    return {"recompiles": recompiles, "graph_breaks": graph_breaks, "limit_hits": limit_hits}


class CompileCounter:
    """Counts since `start()`: `read()` returns {"recompiles", "graph_breaks", "limit_hits"}
    (None where torch does not keep the counter). A process-wide total that drops (a
    torch._dynamo.reset() cleared it) counts on from 0 and the counts so far are kept (see the
    module docstring for what a reset can hide)."""

    def __init__(self):
        self.start()

    def start(self) -> None:
        self._last = read_dynamo_counts()
        self._counts: dict[str, int | None] = {k: (0 if v is not None else None) for k, v in self._last.items()}

    def read(self) -> dict[str, int | None]:
        now = read_dynamo_counts()
        for name, value in now.items():
            last = self._last[name]
            if value is None or last is None:
                self._counts[name] = None
                continue
            self._counts[name] += value - last if value >= last else value
        self._last = now
        return dict(self._counts)


def _guard_failures() -> dict:
    """dynamo's code object -> reasons of its recompiles, {} before torch._dynamo is imported or in a
    release without it."""
    if "torch._dynamo" not in sys.modules:
        return {}
    from torch._dynamo import utils

    return getattr(utils, "guard_failures", {})


class RecompileReasons:
    """The guard failures dynamo recorded since the previous `read()` (or construction), one string
    per compiled graph a call failed the guards of (module docstring); a list that a
    torch._dynamo.reset() shortened is read from its start again."""

    def __init__(self):
        self._seen = {code: len(reasons) for code, reasons in list(_guard_failures().items())}

    def read(self) -> list[str]:
        new = []
        for code, reasons in list(_guard_failures().items()):
            seen = self._seen.get(code, 0)
            if len(reasons) < seen:
                seen = 0
            new.extend(str(r) for r in reasons[seen:])
            self._seen[code] = len(reasons)
        return new


def describe_reasons(reasons: list[str], width: int = 240) -> str:
    """`reasons` as one line: each distinct reason once (the first `width` characters of its first
    line, without dynamo's compile id "0/3: ", so that the same guard failing again reads the same),
    with its count when it is more than one."""
    short = Counter(r.strip().splitlines()[0].split(": ", 1)[-1][:width] for r in reasons if r.strip())
    return " | ".join(reason if n == 1 else f"{n}x {reason}" for reason, n in short.items())


def with_recompile_reasons(info: Callable[[str], None]) -> Callable[[str], None]:
    """`info` with the guard failures since its previous line appended to each line ("; compiled again,
    guards failed: ..."): a compiled model's calibration and verification say which guard made a
    shape compile again (a shape's first step of tens of seconds on a GPU), in every run."""
    reasons = RecompileReasons()

    def line(message: str) -> None:
        new = reasons.read()
        info(message + (f"; compiled again, guards failed: {describe_reasons(new)}" if new else ""))

    return line

"""The calibration record: `calibration.json` in the log dir and the cache it is reused from.

The cache key says what decides a step's cost beyond the batch shape (model fingerprint, strategy,
precision, world size, device, grid, depths and what a checkpointed block keeps, warm-up and repeats,
the batches' text shape, gradient accumulation, the torch version, and on CPU the intra-op threads;
callbacks/calibration.py); a cached
record is reused only under an equal key, only when its fit was trusted (fit.py) and its
verification left no bucket unresolved (result.py, `cacheable`; its points alone are written before
verification starts, with no verification recorded, so a later run verifies in full), and is re-validated field by field
on read: a stale or foreign cache never stops training, it is measured again.
"""
from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

import torch

from lightning_adaptiveload._validation import is_positive_number

FORMAT = "adaptiveload.calibration"
VERSION = 5  # 5: every measured point has "reserved_bytes" and "cold_ms", the memory model is fitted on held
# bytes, the required points run at a third, low depth, and the key names the data and the CPU threads;
# 4: "verification" (the shapes run before training) replaces "warmed_shapes"; 3: every point has
# "checkpointed" (k, or null without PerBucketCheckpointing)
# ok: measured; oom: out of memory on some rank; predicted_oom: not run (CUDA memory forecast);
# skipped_oom: a point no larger in B and S did not fit; skipped_budget: time budget spent.
STATUSES = ("ok", "oom", "predicted_oom", "skipped_oom", "skipped_budget")
INFEASIBLE = ("oom", "predicted_oom")


def model_fingerprint(module: torch.nn.Module) -> str:
    """sha256 of what decides the step's cost beyond the strategy: the class name, every
    parameter's name, shape and dtype, every submodule's class and any `forward` bound on an
    instance (module surgery swaps those, leaving classes and parameters alone), whether a
    submodule is compiled, and the LightningModule's hyperparameters (e.g. activation
    checkpointing, which changes no parameter)."""
    lines = [f"{type(module).__module__}.{type(module).__qualname__}"]
    lines += [f"{n}:{tuple(p.shape)}:{p.dtype}" for n, p in module.named_parameters()]
    for name, sub in module.named_modules():
        patched = getattr(sub.__dict__.get("forward"), "__func__", sub.__dict__.get("forward"))
        compiled = getattr(sub, "_compiled_call_impl", None) is not None
        lines.append(f"{name}:{type(sub).__qualname__}"
                     + (f":{patched.__module__}.{patched.__qualname__}" if patched is not None else "")
                     + (":compiled" if compiled else ""))
    hparams = getattr(module, "hparams", None)
    if hparams:
        try:
            text = json.dumps(dict(hparams), sort_keys=True, default=str)
        except TypeError:  # a nested dict with keys of several types cannot be sorted
            text = str(sorted(hparams.items()))
        # no object addresses (a function's str has one): the same hparams give the same key every run
        lines.append(re.sub(r" at 0x[0-9a-fA-F]+", "", text))
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()


def read_cache(path: Path, key: dict) -> dict | None:
    """The cached calibration at `path` if its key equals `key` and every point is well formed,
    else None (missing, other key, or unreadable)."""
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT or doc.get("version") != VERSION:
        return None
    if doc.get("key") != key or not isinstance(doc.get("points"), list):
        return None
    for p in doc["points"]:
        if not (isinstance(p, dict) and isinstance(p.get("batch_size"), int) and isinstance(p.get("seq_len"), int)
                and p.get("status") in STATUSES and "checkpointed" in p
                and (p["checkpointed"] is None or isinstance(p["checkpointed"], int))):
            return None
        if p["status"] == "ok" and not (is_positive_number(p.get("time_ms")) and is_positive_number(p.get("cold_ms"))
                                        and all(isinstance(p.get(k), int) for k in ("peak_bytes", "reserved_bytes"))):
            return None
    return doc

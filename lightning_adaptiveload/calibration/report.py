"""What a calibration leaves for people and for later runs: `calibration.json` (the record, also the
cache), the fitted models' JSON, the fit's plot, the printed report and the logged metrics."""
from __future__ import annotations

import math
import os
import time
from pathlib import Path

import lightning
import numpy as np
import torch

from lightning_adaptiveload._environment import ALLOCATOR_VARIABLES
from lightning_adaptiveload.calibration.grid import point_held_bytes
from lightning_adaptiveload.calibration.record import FORMAT, INFEASIBLE, VERSION
from lightning_adaptiveload.calibration.result import CalibrationResult, Source
from lightning_adaptiveload.calibration.plot import plot_fit
from lightning_adaptiveload.scheduling.model_io import write_json


def document(result: CalibrationResult, key: dict, policy: str | None) -> dict:
    """The calibration.json document of `result` under cache key `key` (calibration/record.py)."""
    cost_model = result.cost_model
    every_block = key["depths"][0] if key["depths"] else None
    return {
        "format": FORMAT,
        "version": VERSION,
        "key": key,
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "versions": {"torch": torch.__version__, "lightning": lightning.__version__},
        "allocator": {name: os.environ[name] for name in ALLOCATOR_VARIABLES if name in os.environ},
        "seconds": round(result.calibration_s, 3),
        # of "seconds": the grid points' first steps (a compiled model's compilation of each new shape)
        "cold_seconds": round(result.cold_s, 3),
        # the process's first step, uncounted by any measurement (in "seconds", or in "verify_seconds"
        # when the points came from a cache): one-time allocations, a compiled model's first graphs
        "first_step_seconds": None if result.first_step_s is None else round(result.first_step_s, 3),
        "source": result.source.value,
        "trusted": result.trusted,
        "distrust_reasons": list(result.distrust_reasons),
        "policy": policy,
        "m_mem": result.m_mem,
        "peak_unit": ("bytes saved for backward (CPU estimate; peak_bytes = reserved_bytes)" if key["device"] == "cpu"
                      else "bytes: peak_bytes CUDA max_memory_allocated, reserved_bytes max_memory_reserved; the "
                           "memory model is fitted on the larger of the two (held)"),
        "cost_model": None if cost_model is None else cost_model.to_dict(),
        # `measurements` holds the feasible points the cost model is fitted to (every block
        # checkpointed), in the format cost_model.load_cost_model reads
        "measurements": [p for p in result.points if p["status"] == "ok" and p.get("checkpointed") == every_block],
        "points": result.points,
        "depths": key["depths"],
        "memory_plan": _memory_document(result),
        "compiled_regions": len(result.compiled_regions),
        "recompile_limit": result.recompile_limit,
        "verify_seconds": round(result.verify_s, 3),
        "verification": _verification_document(result),
    }


def _memory_document(result: CalibrationResult) -> dict | None:
    """The memory plan's part of calibration.json: None without PerBucketCheckpointing."""
    memory = result.memory
    if memory is None:
        return None
    optimizer = memory.optimizer_memory
    return {"used": memory.used, "distrust_reasons": list(memory.distrust_reasons),
            "device_memory_bytes": memory.device_memory_bytes,
            "optimizer_memory": {"state_bytes": optimizer.state_bytes, "param_bytes": optimizer.param_bytes,
                                 "step_bytes": optimizer.step_bytes, "rule": optimizer.rule},
            "memory_model": None if memory.memory_model is None else memory.memory_model.to_dict(),
            "depth_cost_model": None if memory.depth_cost_model is None else memory.depth_cost_model.to_dict()}


def _verification_document(result: CalibrationResult) -> dict | None:
    outcome = result.verification
    if outcome is None:
        return None
    state = result.optimizer_state
    return {"rounds": outcome.rounds, "converged": outcome.converged, "settled": list(outcome.settled),
            "unresolved": list(outcome.unresolved), "left_cold": outcome.left_cold,
            "seconds": round(outcome.seconds, 3),
            "optimizer_state": None if state is None else {"state_bytes": state.state_bytes,
                                                           "step_peak_bytes": state.step_peak_bytes,
                                                           "created": state.created},
            **outcome.verification.to_dict()}


def save_outputs(log_dir: Path, result: CalibrationResult, doc: dict) -> None:
    """calibration.json, the fitted models and calibration_fit.png into `log_dir`."""
    write_json(log_dir / "calibration.json", doc)
    memory = result.memory
    if memory is not None and memory.memory_model is not None:
        write_json(log_dir / "calibration_memory_model.json", memory.memory_model.to_dict())
        write_json(log_dir / "calibration_depth_cost_model.json", memory.depth_cost_model.to_dict())
    if result.cost_model is None:
        return
    write_json(log_dir / "calibration_cost_model.json", result.cost_model.to_dict())
    feasible = doc["measurements"]
    if feasible:  # none for a cost model given as is
        b, s, t = ([p[k] for p in feasible] for k in ("batch_size", "seq_len", "time_ms"))
        plot_fit(result.cost_model, b, s, t, log_dir / "calibration_fit.png")


def format_report(result: CalibrationResult, doc: dict, longest: int) -> str:
    """The grid with the models' predictions, the verdicts, the budgets and the verification summary."""
    cost_model = result.cost_model
    memory = result.memory
    depth_model = None if memory is None else memory.depth_cost_model
    every_block = doc["depths"][0] if doc["depths"] else None
    lines = [f"{'S':>8} {'B':>5} {'k':>4} {'time ms':>10} {'pred ms':>10} {'cold ms':>10} {'alloc MiB':>10} "
             f"{'held MiB':>10}  status"]
    for p in result.points:
        ok = p["status"] == "ok"
        k = p.get("checkpointed")
        predicted = f"{'':>10}"
        if ok and depth_model is not None:
            predicted = f"{depth_model.predict(p['batch_size'], p['seq_len'], k):>10.2f}"
        elif ok and cost_model is not None and k == every_block:
            predicted = f"{cost_model.predict(p['batch_size'], p['seq_len']):>10.2f}"
        lines.append(f"{p['seq_len']:>8} {p['batch_size']:>5} {'-' if k is None else k:>4} "
                     + (f"{p['time_ms']:>10.2f} {predicted} {p.get('cold_ms', math.nan):>10.1f} "
                        f"{p['peak_bytes'] / 2**20:>10.1f} {point_held_bytes(p) / 2**20:>10.1f}" if ok
                        else f"{'':>10} {'':>10} {'':>10} {'':>10} {'':>10}")
                     + f"  {p['status']}")
    source = {Source.CACHE: " (from cache)", Source.CHECKPOINT: " (from checkpoint)", Source.GIVEN: " (given)"}.get(
        result.source, "")
    if cost_model is not None:
        q = cost_model.quality
        lines.append(f"cost model {cost_model!r}; mean rel err {q['mean_rel_err']:.1%}, held-out {q['heldout_mean_rel_err']:.1%}; "
                     + ("trusted" if result.trusted else "NOT trusted: " + "; ".join(result.distrust_reasons)))
    else:
        lines.append("no cost model: " + "; ".join(result.distrust_reasons))
    if memory is not None and memory.memory_model is not None:
        q = memory.memory_model.quality
        lines.append(f"memory model {memory.memory_model!r}; held-out mean {q['heldout_mean_rel_err']:.1%}, max "
                     f"{q['heldout_max_rel_err']:.1%} {memory_coverage(result)}; "
                     + ("used" if memory.used else "NOT used: " + "; ".join(memory.distrust_reasons)))
    lines.append(f"M_mem = {result.m_mem or 'kept from the DataModule'}"
                 + (f", M_comp = {cost_model.m_comp(result.m_mem, longest):.4g} (ref S = {longest})"
                    if result.m_mem and result.trusted else "")
                 + f"; policy {doc['policy']}; {doc['seconds']:.1f} s{source}"
                 + (f", {doc['cold_seconds']:.1f} s of it in first (cold) steps" if doc["cold_seconds"] else ""))
    if result.verification is not None:
        lines.append(format_verification(result))
    return "\n".join(lines)


def memory_coverage(result: CalibrationResult) -> str:
    """Where the memory model's held-out error holds: "(interpolated ...)" when every shape the plan
    verified lies within the measured depths and tokens (k no smaller, B*S no larger than a measured
    point's), "(EXTRAPOLATED ...)" naming how far the others lie outside; without a verification only
    the measured range. The held-out error is measured on the grid's points: outside them the
    model's error is unknown."""
    ok = [p for p in result.points if p["status"] == "ok" and p.get("checkpointed") is not None]
    if not ok:
        return "(no measured depths)"
    k_min, tokens_max = min(p["checkpointed"] for p in ok), max(p["batch_size"] * p["seq_len"] for p in ok)
    measured = f"measured k >= {k_min}, B*S <= {tokens_max}"
    if result.verification is None:
        return f"({measured})"
    shapes = [m for m in result.verification.verification.shapes if m.checkpointed is not None]
    outside = [m for m in shapes if m.checkpointed < k_min or m.batch_size * m.seq_len > tokens_max]
    if not outside:
        return f"(interpolated: the {len(shapes)} planned shape(s) lie within the {measured})"
    return (f"(EXTRAPOLATED for {len(outside)} of {len(shapes)} planned shape(s): k down to "
            f"{min(m.checkpointed for m in outside)}, B*S up to {max(m.batch_size * m.seq_len for m in outside)}; "
            f"{measured})")


def format_verification(result: CalibrationResult) -> str:
    """One line: what verification ran, round by round, what it changed, what it cost; and the first
    steps' excess."""
    outcome = result.verification
    shapes = outcome.verification.shapes
    line = (f"verification: {sum(m.ran for m in shapes)} shape(s) run in {outcome.rounds} "
            f"round(s), {outcome.seconds:.1f} s ({describe_rounds(shapes, bool(outcome.settled))}); "
            + ("converged" if outcome.converged else f"settled {len(outcome.settled)} bucket(s) on their safest batch"))
    if outcome.unresolved:
        line += f"; {len(outcome.unresolved)} bucket(s) UNRESOLVED"
    bounded = sum(m.status == "bounded" for m in shapes)
    if bounded:
        line += f"; {bounded} shape(s) not run, bounded by a larger one that fit"
    if outcome.left_cold:
        line += f"; {outcome.left_cold} scheduled shape(s) left cold (first step in training)"
    excess = [m.cold_ms - m.warm_ms for m in shapes if m.measured_fit and not m.timed_cold]
    if excess:
        line += f"; first step over the warm one: mean {np.mean(excess):.1f} ms, max {np.max(excess):.1f} ms"
    if result.first_step_s is not None:
        line += f"; the process's first (uncounted) step {result.first_step_s:.1f} s"
    one_step = sum(m.timed_cold for m in shapes)
    if one_step:
        line += (f"; {one_step} shape(s) run one step only (over the budget, or a long step whose first step "
                 f"stands for its time)")
    return line


def describe_rounds(shapes, settled: bool) -> str:
    """What each verification round measured, from the round recorded with each shape: round 1 every
    bucket's batch; a round after one with failures the batches re-planned for them; after a round
    where everything fit, the leftover partial batches; the last one, when buckets were settled, the
    settling."""
    by_round: dict[int, list] = {}
    for m in shapes:
        by_round.setdefault(m.round, []).append(m)
    parts, replanned = [], False
    last = max(by_round, default=0)
    for r in sorted(by_round):
        ran = [m for m in by_round[r] if m.ran]
        failed = [m for m in ran if not m.fits]
        what = ("the buckets' batches" if r == min(by_round) else "settling" if settled and r == last
                else "the re-planned batches" if replanned else "partial batches")
        skipped = sum(m.status == "predicted_oom" for m in by_round[r])
        bounded = sum(m.status == "bounded" for m in by_round[r])
        text = f"round {r} ({what}): {len(ran)} run"
        text += (f", {len(failed)} did not fit ({sum(m.status == 'oom' for m in failed)} out of memory) -> re-planned"
                 if failed else ", all fit")
        if skipped:
            text += f", {skipped} predicted over the device and not run"
        if bounded:
            text += f", {bounded} bounded by a larger one and not run"
        parts.append(text)
        replanned = bool(failed) or bool(skipped)
    return "; ".join(parts) or "nothing to run"


def metrics(result: CalibrationResult, doc: dict) -> dict[str, float]:
    """The numbers logged at step 0 (self.log is not allowed in on_fit_start: the loggers get them)."""
    cost_model = result.cost_model
    out = {"calibration/points": float(len(doc["measurements"])),
           "calibration/infeasible": float(sum(p["status"] in INFEASIBLE for p in result.points)),
           "calibration/seconds": doc["seconds"], "calibration/cold_seconds": doc["cold_seconds"],
           "calibration/trusted": float(result.trusted),
           "calibration/from_cache": float(result.source is Source.CACHE),
           "calibration/verify_seconds": doc["verify_seconds"]}
    if result.verification is not None:
        shapes = result.verification.verification.shapes
        out.update({"calibration/verified_shapes": float(len(shapes)),
                    "calibration/replanned_shapes": float(sum(not m.fits for m in shapes)),
                    "calibration/verify_rounds": float(result.verification.rounds),
                    "calibration/shapes_left_cold": float(result.verification.left_cold)})
    if cost_model is not None:
        out["calibration/p"] = cost_model.p
        if math.isfinite(cost_model.quality["heldout_mean_rel_err"]):
            out["calibration/heldout_mean_rel_err"] = cost_model.quality["heldout_mean_rel_err"]
    if result.m_mem:
        out["calibration/m_mem"] = float(result.m_mem)
    return out

"""Verification: every batch shape the schedule holds runs as a training step before training, and the
buckets whose shapes do not fit are planned again until they do.

A plan is a prediction: the memory and time models are fitted on a grid and asked about depths and
batch sizes it never held (on an H200 the shipped config planned k = 0 and B up to 215 from points at
k = 30 and 15, and ran out of memory in training). Verification measures what the plan will run:

    round r:  the bucket table and its scheduled shapes (full batches, then partial ones), most
              tokens first
              -> run each shape not measured yet, its held memory (max of allocated and reserved
                 peak) against the budget: one cold step from an empty allocator cache, then one warm
                 step for its time (`_steps`: none for a shape over the budget, or for a cold step
                 that stands for its warm time); a shape whose corrected prediction exceeds the device
                 is not run (predicted_oom), nor one a measured shape bounds (`_bound`: no fewer
                 samples and tokens at no more blocks checkpointed fit, and its own corrected
                 prediction lies RECHECK_MARGIN under the budget)
              -> a bucket whose full batch fits is pinned at it; every bucket's BucketLimit is
                 derived from its measurements (`_relimit`): the frontier of what they prove (a
                 failure at (b, k) rules out B >= b at k' <= k, a fit proves B <= b at k' >= k), and
                 the correction of the model's peak to held memory (its activation part scaled by
                 what the bucket measured, the reserved gap added), so the re-plan moves k by the
                 measured per-block bytes in one jump
              -> `plan.refit(Verification)` when a shape did not fit: the models fitted again on
                 everything measured; `plan.apply(Verification)`: the limits and measured step
                 times handed to the DataModule; the schedule changes
    until a round finds nothing left to measure (converged), or after `max_rounds` re-plans; then
    each bucket still without a fitting full batch is settled on the safest choice: its largest
    measured-to-fit batch, else every block checkpointed at the largest B predicted to fit, else at
    B = 1, each measured once more, else the bucket and every longer one is left out of the schedule
    (counted as oversize by the epoch plan).

The loop is a plain class over two injected parts, so it is tested with fake measurements on a CPU:
`measure(shape) -> dict` (one shape's steps, agreed across ranks by the runner) and a `Plan` (the
DataModule and the models). Every rank runs the same loop on the same measurements (the runner
reduces them over ranks), so every rank takes the same decisions and the same number of steps.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Protocol

from lightning_adaptiveload.calibration.config import cold_step_stands
from lightning_adaptiveload.scheduling.buckets import ScheduledShape
from lightning_adaptiveload.scheduling.verification import BucketLimit, MeasuredShape, Verification, held_bytes


class Plan(Protocol):
    """The schedule verification measures and changes (calibration/loop.py adapts the DataModule)."""

    def buckets(self) -> dict[int, tuple[int, tuple[int, int, int] | None, int | None]]:
        """seq_len -> (B, latent (T, H, W), k) of each scheduled bucket's full batch (k None without a
        memory plan)."""

    def shapes(self) -> list[ScheduledShape]:
        """Every (B, latent, batches per epoch, k) the epoch can schedule."""

    def seq_len(self, latent_shape: tuple[int, int, int]) -> int:
        """The bucket key (scheduled tokens) of a latent shape."""

    def predict(self, shape: ScheduledShape) -> tuple[float | None, float | None]:
        """(step ms, peak bytes) the models predict for a shape (None where there is no model); the
        verifier corrects the peak to held memory with the bucket's BucketLimit.held, its static part
        being the prediction at batch_size 0 (which `predict` must accept)."""

    def refit(self, verification: Verification) -> None:
        """Fit the models again on everything measured (a shape did not fit)."""

    def apply(self, verification: Verification) -> None:
        """Schedule within `verification` from now on."""


@dataclass(frozen=True)
class VerifyOutcome:
    """verification: the final limits and measurements (also handed to the plan); rounds: rounds
    run; converged: every bucket's target batch was measured to fit within max_rounds re-plans;
    settled: buckets (seq_len) settled on a fallback choice after that; unresolved: buckets whose
    scheduled target is still not measured to fit at the end (empty unless the plan cannot take
    limits: a DataModule without set_verification); left_cold: scheduled shapes no step ran (bounded
    ones, partial batches left after MAX_PARTIAL_ROUNDS; their first occurrence pays its kernel builds
    in training);
    seconds: wall time of the loop."""

    verification: Verification
    rounds: int
    converged: bool
    settled: tuple[int, ...]
    unresolved: tuple[int, ...]
    left_cold: int
    seconds: float


# Headroom on a bucket's measured activation scale: a step's held memory varies by a fraction of a
# percent between runs (allocator state, kernel workspaces), and the re-planned shape is one the
# bucket has not run; 2% of the activations keeps the one jump from landing just over the budget.
ACTIVATION_MARGIN = 0.02
# The smallest activation scale a bucket's measurements may set: a model that predicts more than twice
# the activations its bucket measured is not trusted to extrapolate from them.
MIN_SCALE = 0.5
# A recorded shape (a cache of this model, device, versions and allocator settings) is run again only
# when it held within this fraction of the budget, and a shape bounded by a measured larger one is not
# run when its own corrected prediction lies this fraction under the budget: between processes on one
# H200 the same shape's held peak moved by at most 1.2 GiB (2.7% of its 44 GiB; those over 100 GiB by at most 0.43 GiB:
# benchmarks/results/gpu_session8, eager_call1 against eager), so one held 10% under the budget cannot
# have come to exceed it. In that cached run 16 of the 21 recorded shapes held less, and their checks
# took 18.8 s of its 53.6 s of verification (the first step of the process, 3.8 s of it, then falls on
# another shape). A bounded shape holds no more than its bound up to that same variation between
# steps, and the margin leaves 10% for it. In that run's first verification 12 of its 21 shapes would
# have been bounded so (2 of them partial batches that took a round of their own), 16.5 s of its 61.9 s
# of steps.
RECHECK_MARGIN = 0.10


class PlanVerifier:
    """Runs the verification rounds (module docstring).

    measure(shape, warm=False) -> {"status": "ok", "cold_ms", "peak_bytes", "reserved_bytes"}: one step
    from an empty allocator cache; measure(shape, warm=True) -> {"status": "ok", "warm_ms", "peak_bytes",
    "reserved_bytes"}: one more step right after it, caches kept; either {"status": "oom"}.
    budget_bytes: the memory a step may hold (its reserved peak included); device_bytes: the device's
    memory (what an out-of-memory step needed at least; a shape predicted above it is not run);
    num_blocks: the switchable blocks L (None without per-bucket checkpointing); max_rounds: rounds
    that may re-plan; progress: a line per shape. built: the (B, S) whose kernels earlier steps of this
    process built (calibration's grid points; the verified shapes join it), None when a step of a new
    shape may compile (a compiled model): then every shape that fits gets its warm step.

    A bucket's target is its largest scheduled batch at its depth (the table's B, or all of a bucket
    smaller than one batch; a bucket the epoch never schedules has none); targets are measured first,
    the other (partial) batches once every target fits, each group most tokens (B * S) first, so a
    shape that may bound others runs before them. Rounds that only measure partial batches (they
    fit: fewer samples than a fitting target) are bounded by MAX_PARTIAL_ROUNDS; what is left then
    stays cold.
    """

    MAX_PARTIAL_ROUNDS = 2

    def __init__(self, measure: Callable[..., dict], plan: Plan, *, budget_bytes: float,
                 device_bytes: float, num_blocks: int | None, max_rounds: int = 3,
                 progress: Callable[[str], None] | None = None, built: Iterable[tuple[int, int]] | None = None,
                 clock: Callable[[], float] = time.perf_counter):
        self.measure, self.plan = measure, plan
        self.built = None if built is None else {(int(b), int(s)) for b, s in built}
        self.budget_bytes, self.device_bytes, self.num_blocks = float(budget_bytes), float(device_bytes), num_blocks
        self.max_rounds = int(max_rounds)
        self.progress = progress or (lambda line: None)
        self.clock = clock
        self.shapes: dict[tuple, MeasuredShape] = {}
        self.pinned: dict[int, tuple[int, int | None]] = {}  # seq_len -> its verified (B, k)
        self.limits: dict[int, BucketLimit] = {}  # derived from shapes and pinned by _relimit
        self.max_seq_len: int | None = None

    # ---- the loop --------------------------------------------------------------------------
    def run(self, prior: Verification | None = None, frozen: bool = False) -> VerifyOutcome:
        """The rounds. prior: a verification recorded earlier (a cache of this model, device and
        budget, or the checkpoint being resumed): its shapes count as measured and its pinned choices
        hold; each of its fitting shapes the schedule holds that held within RECHECK_MARGIN of the
        budget runs once (`measure(shape, warm=False)`: checked to fit still; its kernels are built
        then), the others are taken as recorded, and one that no longer fits is measured and planned
        again. frozen (a resume, whose epoch plan rests on the recorded times):
        nothing is measured anew, and a recorded shape that no longer fits is an error."""
        start = self.clock()
        rounds = replans = partial_rounds = 0
        if prior is not None:
            rounds += 1
            stale = self._rewarm(prior, rounds)
            if frozen:
                if stale:
                    raise RuntimeError(f"verification: {len(stale)} batch shape(s) of the resumed plan no longer fit "
                                       f"(e.g. {_describe(stale[0])}): this device or configuration is not the one the "
                                       f"checkpoint was planned on; resuming would change the epoch's batches")
                return VerifyOutcome(self._verification(), rounds, True, (), (), self._left_cold(),
                                     self.clock() - start)
        while True:
            targets, partial = self._pending()
            if not targets and (not partial or partial_rounds >= self.MAX_PARTIAL_ROUNDS):
                break
            if targets and replans >= self.max_rounds:
                break
            rounds += 1
            partial_rounds += not targets
            failed = self._measure_all(targets or partial, rounds)
            replans += failed
            if failed:  # the refit predicts every bucket anew: the corrections follow it
                self.plan.refit(self._verification())
            self._relimit()
            self.plan.apply(self._verification())
        unresolved = self._unresolved()
        settled: tuple[int, ...] = ()
        if unresolved:
            rounds += 1
            settled = self._settle(unresolved, rounds)
        return VerifyOutcome(self._verification(), rounds, not unresolved, settled, tuple(s for s, _ in self._unresolved()),
                             self._left_cold(), self.clock() - start)

    def _rewarm(self, prior: Verification, rnd: int) -> list[ScheduledShape]:
        """Seed the loop with `prior`, run once each of its fitting shapes the schedule holds that held
        within RECHECK_MARGIN of the budget; drop and return those that no longer fit (their bucket is
        then planned again). They run cheapest (B * S) first: in a cached run the first of them is the
        process's first step, which the runner precedes with an uncounted one (its one-time
        allocations: without it, on an H100 a cached run's first recheck held 4.3 GiB more than the same
        shape in the first run, a false "no longer fits"; benchmarks/results/gpu_session9)."""
        self.shapes = {m.key: m for m in prior.shapes}
        self.pinned = {s: limit.pinned for s, limit in prior.limits.items() if limit.pinned is not None}
        self.max_seq_len = prior.max_seq_len
        self._relimit()
        self.plan.apply(self._verification())
        near = (1.0 - RECHECK_MARGIN) * self.budget_bytes
        recorded = [(seq_len, shape) for seq_len, group in self._scheduled().items() for shape in group
                    if (m := self._measured(seq_len, shape)) is not None and m.measured_fit
                    and held_bytes(m.peak_bytes, m.reserved_bytes) >= near]
        # cheapest first: a process's first step runs twice, once uncounted (runner.StepRunner.measure)
        recorded.sort(key=lambda item: item[1].batch_size * item[0])
        stale = []
        for i, (seq_len, shape) in enumerate(recorded):
            raw = self.measure(shape, warm=False)
            if self.built is not None:
                self.built.add((int(shape.batch_size), int(seq_len)))
            fits = self._status(raw) == "fits"
            note = f"{raw['cold_ms']:.1f} ms cold, fits as recorded" if fits else "NO LONGER FITS"
            if not fits:  # recorded anew as what it is now (its one step's time stands for both), and re-planned
                stale.append(shape)
                note += self._record_failure(seq_len, self._run(seq_len, shape, rnd, _cold_only(raw)))
            self.progress(f"verify round {rnd} (recorded), {i + 1}/{len(recorded)}: {_describe(shape)}: {note}")
        if stale:
            self._drop_unproven()
            self._relimit()
            self.plan.apply(self._verification())
        return stale

    def _drop_unproven(self) -> None:
        """Forget the bounded shapes whose bound no longer fits, and the pins they gave their buckets:
        they are verified again."""
        for key, m in list(self.shapes.items()):
            bound = None if m.bound_by is None else self.shapes.get(m.bound_by)
            if m.status == "bounded" and not (bound is not None and bound.measured_fit):
                del self.shapes[key]
                if self.pinned.get(m.seq_len) == (m.batch_size, m.checkpointed):
                    del self.pinned[m.seq_len]

    def _scheduled(self) -> dict[int, list[ScheduledShape]]:
        by_bucket: dict[int, list[ScheduledShape]] = {}
        for shape in self.plan.shapes():
            by_bucket.setdefault(self.plan.seq_len(shape.latent_shape), []).append(shape)
        return by_bucket

    def _unresolved(self) -> list[tuple[int, ScheduledShape]]:
        """(seq_len, target) of the buckets whose target is not measured to fit."""
        return [(seq_len, target) for seq_len, target in sorted(self._targets().items())
                if not ((m := self._measured(seq_len, target)) is not None and m.fits)]

    # ---- what the measurements say ------------------------------------------------------------
    def _relimit(self) -> None:
        """Every bucket's BucketLimit from the shapes measured in it and its pin, under the models as
        they are now: its frontier; its reserved gap (the largest measured in it, else in any bucket:
        one allocator for all); its activation scale (in a bucket with a failure, the largest measured /
        predicted activation ratio of its shapes that ran, plus ACTIVATION_MARGIN; else 1: a bucket
        whose shapes all fit is pinned, and reports the model's own prediction), an out-of-memory
        step's ratio taken as at least the largest a step that ran measured at the nearest depth (it
        proves only that it needed more than the device; the model's error follows the depth, being
        fitted at two and extrapolated to the others); its batch bound."""
        by_bucket: dict[int, list[MeasuredShape]] = {}
        for m in self.shapes.values():
            by_bucket.setdefault(m.seq_len, []).append(m)
        gaps = {s: max([m.gap_bytes for m in group if m.gap_bytes is not None], default=None)
                for s, group in by_bucket.items()}
        any_gap = max([g for g in gaps.values() if g is not None], default=0.0)
        gap_of = {s: any_gap if gaps.get(s) is None else gaps[s] for s in set(self.plan.buckets()) | set(by_bucket)}
        ratios = {s: [(m, r) for m in group if (r := self._ratio(m, gap_of[s])) is not None]
                  for s, group in by_bucket.items()}
        known = [(self._depth(m.checkpointed), r) for pairs in ratios.values() for m, r in pairs if m.status != "oom"]
        self.limits = {}
        for s in sorted(gap_of):
            if self.max_seq_len is not None and s > self.max_seq_len:
                continue
            group = by_bucket.get(s, [])
            failed = [m for m in group if not m.fits]
            own = [r if m.status != "oom" else max(r, _nearest(known, self._depth(m.checkpointed)))
                   for m, r in ratios.get(s, [])] if failed else []
            scale = max(MIN_SCALE, max(own) * (1 + ACTIVATION_MARGIN)) if own else 1.0
            self.limits[s] = BucketLimit(
                failed=tuple((m.batch_size, m.checkpointed) for m in failed),
                fitted=tuple((m.batch_size, m.checkpointed) for m in group if m.fits),
                memory_scale=scale, gap_bytes=gap_of[s],
                batch_bound=min([self._batch_bound(m, scale, gap_of[s]) for m in failed
                                 if self._every_depth(m.checkpointed)], default=None),
                pinned=self.pinned.get(s))

    def _prediction(self, b: int, latent_shape, k: int | None) -> tuple[float, float] | None:
        """(static, peak): the model's peak at (B, latent, k) and its static part, its prediction at
        B = 0 (what no batch holds: parameters, gradients, optimizer state; as depth_choice takes it);
        None without a memory model."""
        peak = self.plan.predict(ScheduledShape(b, latent_shape, 0, k))[1]
        if peak is None:
            return None
        return self.plan.predict(ScheduledShape(0, latent_shape, 0, k))[1], peak

    def _ratio(self, m: MeasuredShape, gap: float) -> float | None:
        """Measured over predicted activation bytes of a shape that ran, (held - gap - static) /
        (predicted - static), an out-of-memory one holding the device; None without a prediction."""
        predicted = self._prediction(m.batch_size, m.latent_shape, m.checkpointed) if m.ran else None
        if predicted is None or predicted[1] <= predicted[0]:
            return None
        static, peak = predicted
        return (m.needed_bytes(self.device_bytes) - gap - static) / (peak - static)

    def _depth(self, k: int | None) -> int:
        """k of a shape, None counting as every block checkpointed (0 without switchable blocks)."""
        return (self.num_blocks or 0) if k is None else int(k)

    def _every_depth(self, k: int | None) -> bool:
        """Whether a failure at depth k rules out every depth (every block checkpointed, or no depth)."""
        return k is None or k == self.num_blocks

    def _batch_bound(self, failed: MeasuredShape, scale: float, gap: float) -> int:
        """The largest B below a failure at every depth that its bucket's corrected prediction fits in
        the budget, or without a memory model B in proportion to budget / held; at least 1."""
        b = failed.batch_size
        predicted = self._prediction(b, failed.latent_shape, failed.checkpointed)
        if predicted is None or predicted[1] <= predicted[0]:
            estimate = int(b * self.budget_bytes / failed.needed_bytes(self.device_bytes))
        else:
            static, peak = predicted
            per_sample = scale * (peak - static) / b
            estimate = int((self.budget_bytes - gap - static) // per_sample)
        return max(1, min(b - 1, estimate))

    def _predicted_held(self, seq_len: int, shape: ScheduledShape) -> float | None:
        """The held bytes the plan expects of `shape` now: the model's peak corrected by its bucket's
        limit (None without a memory model)."""
        predicted = self._prediction(shape.batch_size, shape.latent_shape, shape.checkpointed)
        if predicted is None:
            return None
        return float((self.limits.get(seq_len) or BucketLimit()).held(predicted[1], predicted[0]))

    def _verification(self) -> Verification:
        return Verification(tuple(self.shapes.values()), dict(self.limits), self.max_seq_len, self.budget_bytes)

    def _measured(self, seq_len: int, shape: ScheduledShape) -> MeasuredShape | None:
        return self.shapes.get((int(shape.batch_size), int(seq_len), shape.checkpointed))

    def _pending(self) -> tuple[list[tuple[int, ScheduledShape]], list[tuple[int, ScheduledShape]]]:
        """(targets, partial): the (seq_len, shape) not measured yet, each most tokens first (ties: fewer
        blocks checkpointed first), an order in which a shape comes after every shape that can bound it."""
        by_bucket = self._scheduled()
        targets, partial = [], []
        for seq_len, target in self._targets(by_bucket).items():
            if self._measured(seq_len, target) is None:
                targets.append((seq_len, target))
            partial += [(seq_len, shape) for shape in by_bucket.get(seq_len, [])
                        if shape != target and self._measured(seq_len, shape) is None]
        order = lambda item: (-item[1].batch_size * item[0], self._depth(item[1].checkpointed), -item[0])  # noqa: E731
        return sorted(targets, key=order), sorted(partial, key=order)

    def _left_cold(self) -> int:
        """Scheduled shapes no verification step ran (left pending, or bounded): each pays its kernel
        builds at its first occurrence in training."""
        return sum(not ((m := self._measured(seq_len, shape)) is not None and m.ran)
                   for seq_len, group in self._scheduled().items() for shape in group)

    def _bound(self, seq_len: int, shape: ScheduledShape, predicted_held: float | None) -> MeasuredShape | None:
        """The measured shape that proves `shape` fits without running it, or None: of the shapes that
        ran and fit with no fewer samples (B), no fewer tokens (S) and no more blocks checkpointed (k),
        the one that held least, when `shape`'s corrected prediction (predicted_held) lies
        RECHECK_MARGIN under the budget (what a step holds grows with B and S and falls with k; the
        margin covers what one step's held memory varies). None without a memory model."""
        if predicted_held is None or predicted_held > (1.0 - RECHECK_MARGIN) * self.budget_bytes:
            return None
        depth = self._depth(shape.checkpointed)
        bounds = [m for m in self.shapes.values() if m.measured_fit and m.batch_size >= shape.batch_size
                  and m.seq_len >= seq_len and self._depth(m.checkpointed) <= depth]
        return min(bounds, key=lambda m: m.used_bytes) if bounds else None

    def _targets(self, by_bucket: dict[int, list[ScheduledShape]] | None = None) -> dict[int, ScheduledShape]:
        """seq_len -> the shape that decides whether the bucket fits: its largest scheduled batch at its depth."""
        by_bucket = self._scheduled() if by_bucket is None else by_bucket
        targets = {}
        for seq_len, (b, thw, k) in self.plan.buckets().items():
            # a bucket the epoch never schedules (fewer samples than one batch, drop_last) needs no step
            scheduled = [shape for shape in by_bucket.get(seq_len, []) if shape.checkpointed == k]
            if scheduled:
                targets[seq_len] = max(scheduled, key=lambda x: x.batch_size)
        return targets

    def _measure_all(self, todo: list[tuple[int, ScheduledShape]], rnd: int) -> bool:
        """Measure every shape of `todo`; True if any did not fit (its bucket is planned again)."""
        failed = False
        targets = self._targets()
        for i, (seq_len, shape) in enumerate(todo):
            measured = self._run(seq_len, shape, rnd)
            if measured.fits:
                note = ""
                if shape == targets.get(seq_len) and seq_len not in self.pinned:
                    self.pinned[seq_len] = (shape.batch_size, shape.checkpointed)
                    note = " (pinned)"
            else:
                failed = True
                note = self._record_failure(seq_len, measured)
            self.progress(f"verify round {rnd}, {i + 1}/{len(todo)}: {_describe(shape)}: {_result(measured)}{note}")
        return failed

    def _run(self, seq_len: int, shape: ScheduledShape, rnd: int, raw: dict | None = None,
             last_resort: bool = False) -> MeasuredShape:
        """Measure `shape` (or record `raw`, a measurement made already) and keep it. A shape whose
        corrected prediction exceeds the device is recorded predicted_oom without running: the
        prediction is the same on every rank, so no rank runs out of memory alone inside a collective;
        one a measured shape bounds (`_bound`) is recorded bounded without running.
        last_resort (B = 1 with every block checkpointed, before a bucket is left out): run whatever the
        prediction, since leaving the bucket and every longer one out on a model's word would drop
        samples that may fit (the runner still agrees on out-of-memory after forward and backward)."""
        predicted_ms, _ = self.plan.predict(shape)
        predicted_held = self._predicted_held(seq_len, shape)
        common = dict(batch_size=int(shape.batch_size), seq_len=int(seq_len),
                      latent_shape=None if shape.latent_shape is None else tuple(shape.latent_shape),
                      checkpointed=shape.checkpointed, predicted_ms=predicted_ms,
                      predicted_peak_bytes=predicted_held, round=rnd)
        planned = raw is None and not last_resort  # a shape the plan asks for, not a measurement to record
        if planned and predicted_held is not None and predicted_held > self.device_bytes:
            measured = MeasuredShape(status="predicted_oom", **common)
        elif planned and (bound := self._bound(seq_len, shape, predicted_held)) is not None:
            measured = MeasuredShape(status="bounded", bound_by=bound.key, **common)
        else:
            raw = self._steps(seq_len, shape) if raw is None else raw
            status = self._status(raw)
            if status == "oom":
                measured = MeasuredShape(status="oom", **common)
            else:
                measured = MeasuredShape(status=status, warm_ms=raw["warm_ms"], cold_ms=raw["cold_ms"],
                                         peak_bytes=raw["peak_bytes"], reserved_bytes=raw.get("reserved_bytes"),
                                         timed_cold=raw.get("timed_cold", False), **common)
        self.shapes[measured.key] = measured
        return measured

    def _steps(self, seq_len: int, shape: ScheduledShape) -> dict:
        """A shape's steps: the cold one, then a warm one for its time unless that is not needed or
        known already: a shape over the budget is never scheduled, and a cold step that stands for its
        warm time (config.cold_step_stands): a long step whose (B, S) an earlier step ran at another
        depth or latent shape costs no more cold than warm (its kernels are built; what the cold step
        adds then is the allocator refilling from an empty cache: -2 to +15 ms on 2-10 s steps on an
        H200, where a new (B, S) added 65-131 ms; docs/memory.md), and a very long step's kernel builds
        are a few percent of it."""
        key = (int(shape.batch_size), int(seq_len))
        cold = self.measure(shape, warm=False)
        if cold["status"] != "ok":
            return cold
        built = None if self.built is None else key in self.built
        if self.built is not None:
            self.built.add(key)
        if self._status(cold) != "fits" or cold_step_stands(cold["cold_ms"], built):
            return _cold_only(cold)
        warm = self.measure(shape, warm=True)
        if warm["status"] != "ok":
            return warm
        return {**cold, "warm_ms": warm["warm_ms"], "peak_bytes": max(cold["peak_bytes"], warm["peak_bytes"]),
                "reserved_bytes": _larger(cold.get("reserved_bytes"), warm.get("reserved_bytes"))}

    def _status(self, raw: dict) -> str:
        """verification.STATUSES of a measurement: its peak, allocated or reserved, against the budget."""
        if raw["status"] == "oom":
            return "oom"
        return "fits" if held_bytes(raw["peak_bytes"], raw.get("reserved_bytes")) <= self.budget_bytes else "over_budget"

    def _record_failure(self, seq_len: int, failed: MeasuredShape) -> str:
        """Unpin the bucket of a shape that did not fit; leave it out with every longer one when that
        was B = 1 at every depth. Returns the progress note."""
        self.pinned.pop(seq_len, None)
        if failed.batch_size == 1 and self._every_depth(failed.checkpointed):
            self._leave_out_from(seq_len)
            return f" -> buckets of {seq_len} tokens and more are left out: not even B = 1 fits"
        depths = "every k" if self._every_depth(failed.checkpointed) else f"k <= {failed.checkpointed}"
        return f" -> rules out B >= {failed.batch_size} at {depths}"

    def _leave_out_from(self, seq_len: int) -> None:
        shorter = [s for s in self.plan.buckets() if s < seq_len]
        if not shorter:
            raise RuntimeError(f"verification: no scheduled batch fits the device: the shortest bucket ({seq_len} "
                               f"tokens) ran out of memory or over the budget of {self.budget_bytes / 2**30:.2f} GiB at "
                               f"B = 1 with every block checkpointed")
        self.max_seq_len = max(shorter) if self.max_seq_len is None else min(self.max_seq_len, max(shorter))
        for s in [s for s in self.pinned if s >= seq_len]:
            del self.pinned[s]
        self._relimit()

    # ---- after the last re-plan --------------------------------------------------------------
    def _settle(self, targets: list[tuple[int, ScheduledShape]], rnd: int) -> tuple[int, ...]:
        """Pin each bucket whose target is not measured to fit on its safest choice (module
        docstring); returns their seq_lens."""
        settled = []
        for seq_len, target in sorted(targets):
            if self.max_seq_len is not None and seq_len > self.max_seq_len:
                continue
            settled.append(seq_len)
            fitting = [m for m in self.shapes.values() if m.seq_len == seq_len and m.fits]
            if fitting:
                best = max(fitting, key=lambda m: (m.batch_size, -(m.checkpointed or 0)))
                self.pinned[seq_len] = (best.batch_size, best.checkpointed)
                self.progress(f"verify: bucket {seq_len} settled on its largest batch measured to fit, "
                              f"{_describe_key(best.batch_size, best.latent_shape, best.checkpointed)}")
                continue
            for candidate in self._safe_candidates(seq_len, target):
                measured = self._measured(seq_len, candidate)
                if measured is None or not measured.ran:
                    measured = self._run(seq_len, candidate, rnd, last_resort=candidate.batch_size == 1)
                if measured.fits:
                    self.pinned[seq_len] = (candidate.batch_size, candidate.checkpointed)
                    self.progress(f"verify: bucket {seq_len} settled on {_describe(candidate)}: {_result(measured)}")
                    break
                self.progress(f"verify: bucket {seq_len} {_describe(candidate)}: {_result(measured)}"
                              + (self._record_failure(seq_len, measured) if candidate.batch_size == 1 else ""))
        self._relimit()
        self.plan.apply(self._verification())
        return tuple(settled)

    def _safe_candidates(self, seq_len: int, target: ScheduledShape) -> list[ScheduledShape]:
        """Every block checkpointed, at the largest B below the target's whose corrected prediction fits
        the budget and that no failure rules out, then at B = 1 (the least memory a sample of the
        bucket can need)."""
        k = None if target.checkpointed is None else self.num_blocks
        limit = self.limits.get(seq_len) or BucketLimit()
        fitting = 1
        for b in range(int(target.batch_size), 1, -1):
            shape = ScheduledShape(b, target.latent_shape, 0, k)
            held = self._predicted_held(seq_len, shape)
            ruled_out = self.num_blocks is not None and limit.depth_floor(b, self.num_blocks) > self.num_blocks
            if held is not None and held <= self.budget_bytes and not ruled_out:
                fitting = b
                break
        sizes = [fitting, 1] if fitting > 1 else [1]
        return [ScheduledShape(b, target.latent_shape, 0, k) for b in sizes]


def _cold_only(raw: dict) -> dict:
    """A one-step measurement whose cold step's time stands for its warm time (MeasuredShape.timed_cold);
    an out-of-memory one as it is."""
    return {**raw, "warm_ms": raw["cold_ms"], "timed_cold": True} if raw["status"] == "ok" else raw


def _larger(a: float | None, b: float | None) -> float | None:
    return None if a is None and b is None else max(v for v in (a, b) if v is not None)


def _nearest(known: list[tuple[int, float]], k: int) -> float:
    """The largest ratio of `known` (depth, ratio) pairs at the depth nearest k; 0 when there are none."""
    if not known:
        return 0.0
    distance = min(abs(d - k) for d, _ in known)
    return max(r for d, r in known if abs(d - k) == distance)


def _describe_key(b: int, thw: Iterable[int] | None, k: int | None) -> str:
    return f"B={b} latent {None if thw is None else tuple(thw)}" + ("" if k is None else f" k={k}")


def _describe(shape: ScheduledShape) -> str:
    return _describe_key(shape.batch_size, shape.latent_shape, shape.checkpointed)


def _result(m: MeasuredShape) -> str:
    if m.status == "oom":
        return "out of memory"
    if m.status == "predicted_oom":
        return f"not run: predicted to hold {m.predicted_peak_bytes / 2**30:.2f} GiB, more than the device"
    if m.status == "bounded":
        b, s, k = m.bound_by
        return (f"not run: fits, bounded by B={b} S={s}" + ("" if k is None else f" k={k}")
                + f" (predicted {m.predicted_peak_bytes / 2**30:.2f} GiB)")
    timing = f"{m.cold_ms:.1f} ms (one step)" if m.timed_cold else f"{m.warm_ms:.1f} ms warm ({m.cold_ms:.1f} cold)"
    return (f"{timing}, peak {m.peak_bytes / 2**30:.2f} GiB allocated / "
            f"{(m.reserved_bytes or m.peak_bytes) / 2**30:.2f} reserved" + ("" if m.fits else ", over the budget"))

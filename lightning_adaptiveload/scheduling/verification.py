"""What running the scheduled batch shapes found: each shape's measured step, the limits put on the
buckets that did not fit, and step costs priced from the measurements.

Before the first training step, calibration (`lightning_adaptiveload.calibration.verify`) runs every
(B, latent shape, k) the schedule holds as a training step under training's memory conditions. Each
bucket's measurements become a `BucketLimit`: the frontier of what they prove (a failure rules out
larger B at no more blocks checkpointed, a fit proves smaller B at no fewer), and the correction of
the memory model's prediction to what a step of that bucket holds (its activations scaled, the
allocator's reserved gap added). A bucket whose shape did not fit is planned again within it; a
shape that fits is pinned, so no later refit of the models moves it to an unmeasured choice. `BucketTable.build(verification=...)` honours the limits, and prices batches with
the measured warm step times (`MeasuredCosts`), so the balanced plan weighs what the steps cost,
not what a model extrapolated to depths and batch sizes it never saw. Pure data and numpy.
"""
from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field
from types import MappingProxyType

import numpy as np

from lightning_adaptiveload._validation import is_finite_number, require_choice, require_int

# fits: the step ran with its peak (allocated and reserved) within the budget; over_budget: it ran but
# its peak exceeded the budget; oom: it ran out of device memory on some rank; predicted_oom: not run,
# its corrected prediction exceeded the device (every rank decides so alike, so no rank runs out alone);
# bounded: not run, it fits because a measured shape of no fewer samples and tokens at no more blocks
# checkpointed fit (`bound_by`; a step's memory grows with B and S and falls with k).
STATUSES = ("fits", "over_budget", "oom", "predicted_oom", "bounded")
FAILED = ("over_budget", "oom", "predicted_oom")
NOT_RUN = ("predicted_oom", "bounded")


def _optional_number(name: str, value) -> float | None:
    if value is None:
        return None
    if not is_finite_number(value) or value < 0:
        raise ValueError(f"{name} must be a finite number >= 0 or None, got {value!r}")
    return float(value)


def held_bytes(peak_bytes, reserved_bytes):
    """The memory a step held from the device, what a memory budget bounds (verification's status,
    the monitor's steps over budget): its reserved peak where known, else its allocated peak.
    Scalars (reserved None: unknown) give a float; arrays (NaN: unknown) broadcast."""
    reserved = np.nan if reserved_bytes is None else np.asarray(reserved_bytes, dtype=np.float64)
    held = np.fmax(np.asarray(peak_bytes, dtype=np.float64), reserved)
    return float(held) if held.ndim == 0 else held


@dataclass(frozen=True)
class MeasuredShape:
    """One scheduled batch shape run as a training step.

    batch_size: B (samples); seq_len: the bucket's scheduled tokens per sample; latent_shape: latent
    (T, H, W) or None where only tokens are known; checkpointed: blocks checkpointed (k), None
    without a memory plan; status: one of STATUSES. warm_ms: the step after the first (ms), cold_ms:
    the first one, with its kernel builds or compilation; peak_bytes: the steps' peak allocated
    device memory, reserved_bytes: the allocator's peak reserved memory (what fragmentation adds
    shows as reserved - allocated), both None for an out-of-memory shape. predicted_ms,
    predicted_peak_bytes: what the plan expected when it was measured. round: the verification
    round that measured it (1-based). timed_cold: only the first step ran, and warm_ms is its time
    (a shape over the budget, whose time no plan uses; a cold step that stands for its warm time,
    calibration.config.cold_step_stands; a recorded shape checked again). bound_by: for a bounded
    shape, the key (B, seq_len, k) of the measured shape that bounds its memory; it has no times or
    peaks of its own (the plan prices it with the model).
    """

    batch_size: int
    seq_len: int
    latent_shape: tuple[int, int, int] | None
    checkpointed: int | None
    status: str
    warm_ms: float | None = None
    cold_ms: float | None = None
    peak_bytes: float | None = None
    reserved_bytes: float | None = None
    predicted_ms: float | None = None
    predicted_peak_bytes: float | None = None
    round: int = 1
    timed_cold: bool = False
    bound_by: tuple[int, int, int | None] | None = None

    def __post_init__(self):
        require_int("batch_size", self.batch_size)
        require_int("seq_len", self.seq_len)
        require_choice("status", self.status, STATUSES)
        if self.checkpointed is not None:
            require_int("checkpointed", self.checkpointed, minimum=0)
        if self.latent_shape is not None:
            object.__setattr__(self, "latent_shape", tuple(require_int("latent_shape", v) for v in self.latent_shape))
        for name in ("warm_ms", "cold_ms", "peak_bytes", "reserved_bytes", "predicted_ms", "predicted_peak_bytes"):
            object.__setattr__(self, name, _optional_number(name, getattr(self, name)))
        if not isinstance(self.timed_cold, bool):
            raise ValueError(f"timed_cold must be true or false, got {self.timed_cold!r}")
        if self.status not in ("oom", *NOT_RUN) and (self.warm_ms is None or self.peak_bytes is None):
            raise ValueError(f"a {self.status!r} shape needs warm_ms and peak_bytes")
        if (self.status == "bounded") != (self.bound_by is not None):
            raise ValueError(f"bound_by (the key of the measured shape bounding it) is given for a bounded shape "
                             f"and only for one: status {self.status!r}, bound_by {self.bound_by!r}")
        if self.bound_by is not None:
            try:
                b, s, k = self.bound_by
                bound = (require_int("B", b), require_int("seq_len", s),
                         None if k is None else require_int("k", k, minimum=0))
            except (TypeError, ValueError) as e:
                raise ValueError(f"bound_by must be a (B, seq_len, k) key: {e}") from e
            object.__setattr__(self, "bound_by", bound)

    @property
    def fits(self) -> bool:
        """Measured to fit, or bounded by a shape that was."""
        return self.status in ("fits", "bounded")

    @property
    def measured_fit(self) -> bool:
        """The step ran and fit (status "fits", not "bounded"): what bounds other shapes and prices batches."""
        return self.status == "fits"

    @property
    def key(self) -> tuple[int, int, int | None]:
        """(B, seq_len, k): what identifies a shape; a later measurement of a key replaces an earlier one."""
        return self.batch_size, self.seq_len, self.checkpointed

    @property
    def ran(self) -> bool:
        """Whether the step ran (a predicted_oom shape was only predicted, a bounded one inferred)."""
        return self.status not in NOT_RUN

    @property
    def gap_bytes(self) -> float | None:
        """reserved - allocated peak (>= 0): what the allocator held beyond its allocations; None where
        unknown (no reserved peak, or no step that ran)."""
        if self.peak_bytes is None or self.reserved_bytes is None:
            return None
        return max(0.0, self.reserved_bytes - self.peak_bytes)

    @property
    def used_bytes(self) -> float | None:
        """`held_bytes` of the step; None for an out-of-memory shape."""
        return None if self.peak_bytes is None else held_bytes(self.peak_bytes, self.reserved_bytes)

    def needed_bytes(self, device_bytes: float) -> float:
        """What the step needed at least: the memory it held, or all of the device (`device_bytes`)
        where it ran out."""
        return float(device_bytes) if self.used_bytes is None else self.used_bytes

    def to_dict(self) -> dict:
        doc = asdict(self)
        doc["latent_shape"] = None if self.latent_shape is None else list(self.latent_shape)
        doc["bound_by"] = None if self.bound_by is None else list(self.bound_by)
        return doc

    @classmethod
    def from_dict(cls, doc: Mapping, where: str = "measured shape") -> "MeasuredShape":
        """The shape of a `to_dict` document; ValueError naming `where` for anything malformed."""
        if not isinstance(doc, Mapping):
            raise ValueError(f"{where}: must be an object, got {type(doc).__name__}")
        names = {f for f in cls.__dataclass_fields__}
        unknown = sorted(set(doc) - names)
        if unknown:
            raise ValueError(f"{where}: unknown keys {unknown}")
        try:
            return cls(**doc)
        except (TypeError, ValueError) as e:
            raise ValueError(f"{where}: {e}") from e


def _points(name: str, value) -> tuple[tuple[int, int | None], ...]:
    """(B, k) pairs of a frontier (JSON lists or tuples): B >= 1, k >= 0 or None."""
    try:
        pairs = tuple((require_int(f"{name}: B", b), None if k is None else require_int(f"{name}: k", k, minimum=0))
                      for b, k in value)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{name} must be a list of (B, k) pairs (B >= 1, k >= 0 or null): {e}") from e
    return pairs


def _depth(k: int | None, num_blocks: int) -> int:
    """k of a frontier point; None (a step run without a depth plan) counts as every block checkpointed."""
    return num_blocks if k is None else int(k)


@dataclass(frozen=True)
class BucketLimit:
    """What verification knows of one bucket's (B, k) choices, and how it corrects their predicted memory.

    The memory a step holds grows with B and shrinks with k (blocks checkpointed), so each measurement
    proves a quadrant, and a limit is the frontier of those proofs, not a box:

    failed: (b, k) measured over the budget or out of memory, or predicted to need more than the
        device and not run: every B >= b at every depth k' <= k is ruled out (k None: at every depth).
    fitted: (b, k) measured to fit: every B <= b at every k' >= k fits.
    memory_scale, gap_bytes: a plan's held memory is predicted as `held`: static + memory_scale *
        (predicted - static) + gap_bytes. Only the activation part (what B, S and k change) is
        scaled, by the ratio its measurements showed; static (parameters, gradients, optimizer state)
        is what a model fitted with them already has right. gap_bytes: what the allocator reserves
        beyond its allocations (fragmentation), measured in this bucket (else in others).
    batch_bound: B <= batch_bound for any plan of the bucket (None: no bound), set by a failure at every
        depth (every block checkpointed, or no depth plan): what bounds B where the plan is not chosen
        by the memory model (token-budget policies, no memory plan).
    pinned: (B, k) measured to fit as the bucket's choice; a pinned bucket is not planned again.
    """

    failed: tuple[tuple[int, int | None], ...] = ()
    fitted: tuple[tuple[int, int | None], ...] = ()
    memory_scale: float = 1.0
    gap_bytes: float = 0.0
    batch_bound: int | None = None
    pinned: tuple[int, int | None] | None = None

    def __post_init__(self):
        object.__setattr__(self, "failed", _points("failed", self.failed))
        object.__setattr__(self, "fitted", _points("fitted", self.fitted))
        if not is_finite_number(self.memory_scale) or self.memory_scale <= 0:
            raise ValueError(f"memory_scale must be a finite number > 0, got {self.memory_scale!r}")
        if not is_finite_number(self.gap_bytes) or self.gap_bytes < 0:
            raise ValueError(f"gap_bytes must be a finite number >= 0, got {self.gap_bytes!r}")
        object.__setattr__(self, "memory_scale", float(self.memory_scale))
        object.__setattr__(self, "gap_bytes", float(self.gap_bytes))
        if self.batch_bound is not None:
            object.__setattr__(self, "batch_bound", require_int("batch_bound", self.batch_bound))
        if self.pinned is not None:
            pinned = _points("pinned", [self.pinned])
            object.__setattr__(self, "pinned", pinned[0])

    @property
    def max_batch_size(self) -> int | None:
        """The largest B of the bucket's batches: the pinned B, else batch_bound (None: no bound)."""
        return self.pinned[0] if self.pinned is not None else self.batch_bound

    def held(self, predicted_bytes, static_bytes):
        """Predicted held bytes (see the class docstring) of a model's predicted peak and its static part
        (the prediction at B = 0); arrays broadcast."""
        return static_bytes + self.memory_scale * (np.asarray(predicted_bytes, dtype=np.float64) - static_bytes) \
            + self.gap_bytes

    def model_budget(self, budget_bytes: float, static_bytes):
        """The budget on the model's own prediction that `held` <= budget_bytes means."""
        return static_bytes + (budget_bytes - self.gap_bytes - static_bytes) / self.memory_scale

    def depth_floor(self, batch_size, num_blocks: int) -> np.ndarray:
        """The fewest blocks checkpointed no failure rules out at each B (int64, num_blocks + 1 where
        every depth is ruled out)."""
        b = np.asarray(batch_size, dtype=np.int64)
        floor = np.zeros(b.shape, dtype=np.int64)
        for fb, fk in self.failed:
            floor = np.where(b >= fb, np.maximum(floor, _depth(fk, num_blocks) + 1), floor)
        return floor

    def proven_depth(self, batch_size, num_blocks: int) -> np.ndarray:
        """The fewest blocks checkpointed a fitted point proves to fit at each B (int64, num_blocks + 1
        where none does)."""
        b = np.asarray(batch_size, dtype=np.int64)
        proven = np.full(b.shape, num_blocks + 1, dtype=np.int64)
        for fb, fk in self.fitted:
            proven = np.where(b <= fb, np.minimum(proven, _depth(fk, num_blocks)), proven)
        return proven

    def to_dict(self) -> dict:
        return {"failed": [list(p) for p in self.failed], "fitted": [list(p) for p in self.fitted],
                "memory_scale": self.memory_scale, "gap_bytes": self.gap_bytes, "batch_bound": self.batch_bound,
                "pinned": None if self.pinned is None else list(self.pinned)}

    @classmethod
    def from_dict(cls, doc: Mapping) -> "BucketLimit":
        """The limit of a `to_dict` document, or of the box of earlier versions (max_batch_size,
        min_checkpointed, memory_scale, pinned: B <= max_batch_size and k >= min_checkpointed), which
        is the frontier of two failures: at every depth above max_batch_size, and at B = 1 below
        min_checkpointed; a pinned box is its fitted choice. ValueError for anything else."""
        if not isinstance(doc, Mapping):
            raise ValueError(f"must be an object, got {type(doc).__name__}")
        box = {"max_batch_size", "min_checkpointed", "memory_scale", "pinned"}
        if set(doc) <= box and "min_checkpointed" in doc:
            b, k = doc.get("max_batch_size"), require_int("min_checkpointed", doc["min_checkpointed"], minimum=0)
            if doc.get("pinned"):
                if b is None:
                    raise ValueError("a pinned bucket needs its max_batch_size (the verified B)")
                return cls(fitted=((b, k),), pinned=(b, k))
            failed = ((1, k - 1),) if k > 0 else ()
            return cls(failed=failed, memory_scale=doc.get("memory_scale", 1.0), batch_bound=b)
        unknown = sorted(set(doc) - set(cls.__dataclass_fields__))
        if unknown:
            raise ValueError(f"unknown keys {unknown}")
        return cls(**doc)


@dataclass(frozen=True, eq=False)
class Verification:
    """Everything verification measured and decided, the one object the bucket table, the sampler
    and the DataModule take.

    shapes: every measured shape, in the order measured; limits: bucket seq_len -> BucketLimit;
    max_seq_len: longest bucket (tokens) to schedule, set when a bucket did not fit even at B = 1
    with every block checkpointed (longer buckets need more memory still), else None;
    budget_bytes: the memory (bytes, one rank) a shape had to fit in, allocated and reserved.
    """

    shapes: tuple[MeasuredShape, ...] = ()
    limits: Mapping[int, BucketLimit] = field(default_factory=dict)
    max_seq_len: int | None = None
    budget_bytes: float | None = None

    def __post_init__(self):
        object.__setattr__(self, "shapes", tuple(self.shapes))
        limits = {require_int("limits key (seq_len)", s): limit for s, limit in dict(self.limits).items()}
        if not all(isinstance(limit, BucketLimit) for limit in limits.values()):
            raise ValueError("limits must map seq_len -> BucketLimit")
        object.__setattr__(self, "limits", MappingProxyType(limits))
        if self.max_seq_len is not None:
            require_int("max_seq_len", self.max_seq_len)
        object.__setattr__(self, "budget_bytes", _optional_number("budget_bytes", self.budget_bytes))

    def limit(self, seq_len: int) -> BucketLimit | None:
        return self.limits.get(int(seq_len))

    def costs(self, model, checkpointed_of: Mapping[int, int | None]) -> "MeasuredCosts":
        """`MeasuredCosts` over `model` from the shapes that ran and fit at their bucket's depth in `checkpointed_of`
        (seq_len -> k of the table, None without a memory plan)."""
        return MeasuredCosts(model, [m for m in self.shapes if m.measured_fit and m.seq_len in checkpointed_of
                                     and m.checkpointed == checkpointed_of[m.seq_len]])

    def to_dict(self) -> dict:
        return {"shapes": [m.to_dict() for m in self.shapes],
                "limits": {str(s): limit.to_dict() for s, limit in sorted(self.limits.items())},
                "max_seq_len": self.max_seq_len, "budget_bytes": self.budget_bytes}

    @classmethod
    def from_dict(cls, doc: Mapping, where: str = "verification") -> "Verification":
        """The verification of a `to_dict` document; ValueError naming `where` for anything malformed."""
        if not isinstance(doc, Mapping) or set(doc) != {"shapes", "limits", "max_seq_len", "budget_bytes"}:
            raise ValueError(f"{where}: must be an object with keys shapes, limits, max_seq_len, budget_bytes")
        if not isinstance(doc["shapes"], list) or not isinstance(doc["limits"], Mapping):
            raise ValueError(f"{where}: shapes must be a list and limits an object")
        shapes = [MeasuredShape.from_dict(m, f"{where}: shapes[{i}]") for i, m in enumerate(doc["shapes"])]
        limits = {}
        for key, value in doc["limits"].items():
            try:
                limits[int(key)] = BucketLimit.from_dict(value)
            except (TypeError, ValueError) as e:
                raise ValueError(f"{where}: limits[{key!r}]: {e}") from e
        try:
            return cls(shapes, limits, doc["max_seq_len"], doc["budget_bytes"])
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from e


class MeasuredCosts:
    """Step time (ms) of a batch of (B, S) as verification measured it: the measured warm time where
    that (B, S) ran at its bucket's depth, else `model`'s prediction times the bucket's measured /
    predicted ratio (median over its measured shapes: the model's error at that bucket, e.g. 20-40% at
    depths it never measured). A bucket with no measured shape (its shapes bounded by a larger one, so
    not run) takes the ratio interpolated in log S between the nearest buckets that have one (the
    nearest one's beyond either end): the error moves smoothly with S and is rarely near 1 (on the
    committed H100 and H200 records 0.8-1.7, e.g. 1.01 at 1,024 tokens, 1.72 at 14,040, 1.05 at 75,600),
    so the raw prediction under-priced such a bucket by up to 36%
    (benchmarks/scheduling/unmeasured_price.py). The model's prediction alone only without any
    measurement. `model` is what the table prices batches with at their bucket's depth (e.g.
    depth_choice.BucketDepthCosts)."""

    def __init__(self, model, measured: Iterable[MeasuredShape]):
        self.model = model
        measured = list(measured)
        pairs: dict[tuple[int, int], list[float]] = {}
        for m in measured:
            pairs.setdefault((int(m.batch_size), int(m.seq_len)), []).append(float(m.warm_ms))
        self._keys = np.array(sorted(pairs), dtype=np.int64).reshape(-1, 2)
        self._ms = np.array([float(np.median(pairs[tuple(k)])) for k in self._keys.tolist()], dtype=np.float64)
        ratios: dict[int, list[float]] = {}
        for (b, s), ms in zip(self._keys.tolist(), self._ms):
            predicted = float(model.predict(b, s))
            if predicted > 0 and math.isfinite(predicted):
                ratios.setdefault(s, []).append(ms / predicted)
        self._ratio_s = np.array(sorted(ratios), dtype=np.int64)
        self._ratio = np.array([float(np.median(ratios[s])) for s in self._ratio_s.tolist()], dtype=np.float64)

    @property
    def measured(self) -> dict[tuple[int, int], float]:
        """(B, S) -> measured warm ms."""
        return {(int(b), int(s)): float(ms) for (b, s), ms in zip(self._keys, self._ms)}

    def predict(self, batch_size, seq_len):
        """Step ms; scalars give a float, arrays broadcast and give an array."""
        b, s = np.broadcast_arrays(np.asarray(batch_size), np.asarray(seq_len))
        t = np.asarray(self.model.predict(b, s), dtype=np.float64) * self._bucket_ratio(s)
        if len(self._keys) and t.size:
            flat_b, flat_s = b.reshape(-1).astype(np.int64), s.reshape(-1).astype(np.int64)
            # exact (B, S) lookup: one int64 code per pair, S major
            width = int(max(self._keys[:, 0].max(), flat_b.max())) + 1
            code = self._keys[:, 1] * width + self._keys[:, 0]
            order = np.argsort(code)
            code, ms = code[order], self._ms[order]
            query = flat_s * width + flat_b
            at = np.clip(np.searchsorted(code, query), 0, len(code) - 1)
            hit = code[at] == query
            t = t.reshape(-1)
            t[hit] = ms[at[hit]]
            t = t.reshape(b.shape)
        return float(t) if t.ndim == 0 else t

    def _bucket_ratio(self, s: np.ndarray) -> np.ndarray:
        if not len(self._ratio_s):
            return np.ones(s.shape)
        # exact at a measured bucket; np.interp holds the end values beyond the ends
        return np.interp(np.log(np.maximum(s, 1)), np.log(self._ratio_s), self._ratio)

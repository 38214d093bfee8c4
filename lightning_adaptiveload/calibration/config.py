"""CalibrationConfig: every setting of the calibration loop, checked once.

`CostModelCalibration` keeps a flat signature (LightningCLI builds it from YAML keys) and hands its
arguments to this frozen dataclass; the loop (calibration/loop.py) reads only this.
"""
from __future__ import annotations

from dataclasses import dataclass

from lightning_adaptiveload._validation import require_choice, require_int, require_number
from lightning_adaptiveload.scheduling.cost_model import FORMS
from lightning_adaptiveload.scheduling.depth_choice import PLAN_MARGIN, check_plan_margin

DEFAULT_BATCH_SIZES = tuple(2**i for i in range(9))  # 1 .. 256
DEFAULT_MAX_HELDOUT_ERROR = 0.15  # 15%: the shipped H200 curve fits to 5% held out (docs/cost_model.md)
# The memory model's own bar: peaks of one model over a grid fit to ~1-7% held out on an H200
# (memory_policies.json, the shipped-config runs); above 10% its plan is not a plan.
DEFAULT_MAX_MEMORY_HELDOUT_ERROR = 0.10
# Spearman rank correlation of time with tokens B*S below which times "do not grow": a launch-bound
# model on a noisy CPU measures ~0.5, constant or falling times ~0 or below.
DEFAULT_MIN_WORK_CORRELATION = 0.2
# The long-step rule (calibration/sweep.py, measure_point): a grid point whose first (cold) step takes
# this long or longer is timed on one warm step, without more warm-up. What varies between warm steps
# (launch latency, clock and allocator jitter: milliseconds) is small against seconds, while each
# extra warm-up or repeat costs seconds per point (the 1.3B model's long buckets on an H200).
LONG_STEP_MS = 2000.0
# A first step this long is its own time even at a (B, S) no earlier step built: what a new shape's
# first step adds (kernel and cuDNN graph builds, the allocator refilling) was 170-350 ms on an H200
# (B = 1 at S = 32,400 and 75,600, B = 2 at 32,400: 2,960 / 11,308 / 5,698 ms cold against 2,700 /
# 11,135 / 5,351 warm; benchmarks/results/gpu_session8/eager/calibration.json), under 4.5% of 8 s,
# while the warm step it saves is the longest step of a calibration (11 s of its 98 s there).
COLD_STANDS_MS = 8000.0


def cold_step_stands(cold_ms: float, built: bool | None) -> bool:
    """Whether a shape's first (cold) step stands for its warm time, so no warm step runs, in an eager
    model: a long step (LONG_STEP_MS) whose (B, S) an earlier step built the kernels of (`built`), or
    a very long one (COLD_STANDS_MS) whatever was built. built None: a compiled model, whose first step
    of a new shape may hold its compilation (seconds to a minute): never. Calibration's grid points and
    verification's shapes both follow it; cold_ms is agreed over ranks (the maximum), so every rank
    decides alike."""
    if built is None:
        return False
    return cold_ms >= COLD_STANDS_MS or (built and cold_ms >= LONG_STEP_MS)


@dataclass(frozen=True)
class CalibrationConfig:
    """What calibration measures and when it trusts it (docs/lightning.md, docs/memory.md)."""

    num_seq_lens: int = 4
    """Bucket lengths S benchmarked (calibration.grid.seq_len_grid: shortest, longest, evenly between)."""
    batch_sizes: tuple[int, ...] = DEFAULT_BATCH_SIZES
    """Batch sizes B tried at each S; after the first out-of-memory one at an S the larger are skipped."""
    max_tokens: int | None = None
    """Skip grid points with B*S above this (tokens); None probes until out of memory."""
    warmup: int = 1
    """Untimed steps per grid point before the timed ones, the first (cold) one included; a point
    whose cold step takes LONG_STEP_MS or more gets no more warm-up (the long-step rule)."""
    repeats: int = 3
    """Timed steps per grid point; the median counts. Under the long-step rule: 1."""
    time_budget_s: float = 180.0
    """Seconds of warm measurement for the optional grid points, counted after the required ones
    (calibration.grid); the points' first (cold) steps, a compiled model's compilation of each new
    shape, do not count."""
    m_mem: int | None = None
    """M_mem (tokens per batch) to hand to the DataModule instead of the measured one."""
    memory_margin: float = 0.9
    """M_mem = floor(margin * largest feasible B*S) when some grid point did not fit."""
    max_memory_fraction: float = 0.85
    """Share of the device's memory a step may use: grid points predicted above it are not run, the
    memory plan keeps predicted peaks under it, and verification holds every scheduled shape's measured
    peak (allocated and reserved) to it."""
    plan_margin: float = PLAN_MARGIN
    """Share of that budget a bucket's first plan leaves unused (verification judges the whole budget;
    scheduling/depth_choice.PLAN_MARGIN says why 1%); 0 plans up to the budget."""
    form: str = "auto"
    """Cost-model form passed to CostModel.fit ("auto" or one of its FORMS)."""
    max_heldout_error: float = DEFAULT_MAX_HELDOUT_ERROR
    """The step-time fit is distrusted above this cross-validated mean relative error."""
    max_memory_heldout_error: float = DEFAULT_MAX_MEMORY_HELDOUT_ERROR
    """The memory model is distrusted (no memory plan: every block checkpointed) above this
    cross-validated mean relative error of its peaks."""
    min_work_correlation: float = DEFAULT_MIN_WORK_CORRELATION
    """The fit is distrusted when step time does not grow with tokens B*S (Spearman rank correlation
    below this; -1 turns the check off)."""
    verify: bool = True
    """Run every scheduled batch shape before training, under training's memory conditions, and plan
    again the buckets that do not fit (calibration/verify.py). Off: the plan is trusted as predicted
    and the first occurrence of each shape pays its kernel builds in training."""
    verify_rounds: int = 3
    """Re-plan rounds verification may take before it settles unresolved buckets on their safest
    measured choice."""
    cache_path: str | None = None
    """Calibration JSON reused when its key matches; None: <default_root_dir>/calibration_cache.json."""
    cost_model_path: str | None = None
    """A fitted cost-model JSON to schedule with as given: no benchmark, no fit, no memory plan."""

    def __post_init__(self):
        require_int("num_seq_lens", self.num_seq_lens)
        sizes = tuple(require_int("batch_sizes[i]", b) for b in self.batch_sizes)
        if not sizes:
            raise ValueError("batch_sizes must hold at least one batch size")
        object.__setattr__(self, "batch_sizes", sizes)
        if self.max_tokens is not None:
            require_int("max_tokens", self.max_tokens)
        require_int("warmup", self.warmup, minimum=0)
        require_int("repeats", self.repeats)
        require_number("time_budget_s", self.time_budget_s, positive=True)
        if self.m_mem is not None:
            require_int("m_mem", self.m_mem)
        for name in ("memory_margin", "max_memory_fraction"):
            value = require_number(name, getattr(self, name), positive=True)
            if value > 1:
                raise ValueError(f"{name} must be in (0, 1], got {value!r}")
        check_plan_margin(self.plan_margin)
        require_choice("form", self.form, ("auto", *FORMS))
        for name in ("max_heldout_error", "max_memory_heldout_error"):  # inf: the check is off
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"{name} must be a number > 0 (inf turns the check off), got {value!r}")
        require_number("min_work_correlation", self.min_work_correlation, minimum=-1.0)
        require_int("verify_rounds", self.verify_rounds)

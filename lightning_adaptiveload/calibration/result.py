"""CalibrationResult: everything one calibration decided, in one frozen object."""
from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from lightning_adaptiveload.calibration.memory import MaterializedState, OptimizerMemory
from lightning_adaptiveload.calibration.verify import VerifyOutcome
from lightning_adaptiveload.scheduling.cost_model import CostModel
from lightning_adaptiveload.scheduling.depth_cost_model import DepthCostModel
from lightning_adaptiveload.scheduling.memory_model import MemoryModel


class Source(str, Enum):
    """Where the calibration points came from."""

    MEASURED = "measured"
    MEASURED_AGAIN = "measured again"  # the first fit was distrusted: measured once more, longer
    CACHE = "cache"
    CHECKPOINT = "checkpoint"  # a resumed fit schedules with the calibration it started with
    GIVEN = "given"  # a fitted cost model handed in as is (cost_model_path): no points

    @property
    def measured(self) -> bool:
        return self in (Source.MEASURED, Source.MEASURED_AGAIN)


@dataclass(frozen=True)
class MemoryPlanResult:
    """The memory plan's part (with PerBucketCheckpointing): used: the DataModule plans with it;
    distrust_reasons: why not ([] when used); the fitted models (None when not fitted); the optimizer
    memory the plan adds to calibration's peaks; device_memory_bytes: the smallest device of the ranks."""

    used: bool
    distrust_reasons: tuple[str, ...]
    memory_model: MemoryModel | None
    depth_cost_model: DepthCostModel | None
    optimizer_memory: OptimizerMemory
    device_memory_bytes: int


@dataclass(frozen=True)
class CalibrationResult:
    """source: where the points came from; points: the grid points (dicts, calibration.json's
    "points"); cost_model: the fit at every block checkpointed (None: none could be fitted);
    distrust_reasons: why it is not trusted ([]: trusted); m_mem: the M_mem handed to the DataModule
    (measured, or given as CalibrationConfig.m_mem; None: the DataModule keeps its own); memory: the
    memory plan's part (None without PerBucketCheckpointing); verification: the verification loop's
    outcome (None when it did not run) and optimizer_state what its optimizer step measured;
    calibration_s, verify_s: wall seconds of the two parts; cold_s: the part of calibration_s spent in
    the grid points' first (cold) steps, a compiled model's compilation of each new shape (the
    measurements of every sweep run, a re-measurement's too; 0 when nothing was measured);
    first_step_s: the process's first step, before any measured one and counted by none (in calibration,
    or in verification when the points came from a cache): one-time allocations, and a compiled model's
    first graphs traced and compiled or read from the compile cache (None: no step ran); compiled_regions, recompile_limit: the
    compiled submodules found and dynamo's limit set for them (None: not compiled); verifies_cache: the
    points came from a cache written before verification by a run that did not finish it (no
    verification recorded there), so this run's verification completes that cache."""

    source: Source
    points: list[dict]
    cost_model: CostModel | None
    distrust_reasons: tuple[str, ...]
    m_mem: int | None
    memory: MemoryPlanResult | None = None
    verification: VerifyOutcome | None = None
    optimizer_state: MaterializedState | None = None
    calibration_s: float = 0.0
    verify_s: float = 0.0
    cold_s: float = 0.0
    first_step_s: float | None = None
    compiled_regions: tuple[str, ...] = field(default_factory=tuple)
    recompile_limit: int | None = None
    verifies_cache: bool = False

    @property
    def trusted(self) -> bool:
        return not self.distrust_reasons

    @property
    def memory_plan_used(self) -> bool:
        return self.memory is not None and self.memory.used

    @property
    def cacheable(self) -> bool:
        """Whether the record may be cached for later runs: measured now (or completing a cache of
        points that has no verification yet), trusted, and (where it ran) verified without a bucket
        left unresolved. The points alone are cached before verification starts (calibration/loop.py),
        without a plan: a later run reuses them and verifies in full. A plan verification settled (a bucket pinned on its
        safest batch measured to fit after the last re-plan) is cached with its verification: every
        pinned shape was measured to fit, so a later run checks each near the budget once (verify.RECHECK_MARGIN)
        instead of running every round again. A plan with an unresolved bucket is never reused."""
        verified = self.verification is None or not self.verification.unresolved
        return (self.source.measured or self.verifies_cache) and self.trusted and verified

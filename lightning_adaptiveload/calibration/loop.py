"""The calibration loop: measure -> fit -> plan -> verify, with no Lightning in it.

1. measure: the (B, S) grid as real training steps (calibration/sweep.py), or the points of the
   checkpoint being resumed, of a cache with the same key, or none for a cost model given as is;
   with per-bucket checkpointing the points the fit needs run again at a second depth.
2. fit: rank 0 fits the step-time model and judges it (calibration/fit.py), and with per-bucket
   checkpointing the memory and depth models; every rank gets the same models and verdicts. A
   distrusted fit is measured once more with REMEASURE_REPEATS times the repeats, then falls back
   to token_equal.
3. plan: the DataModule gets the cost model (and the memory plan), so its bucket table and epoch plan
   follow them.
4. verify: every scheduled batch shape runs under training's memory conditions (the optimizer state
   present) and the buckets that do not fit are planned again (calibration/verify.py); the models
   are refitted on everything measured; the DataModule gets the verification (limits, measured times).

`Calibration(config, runner, datamodule, ...).run()` returns a `CalibrationResult`; the Lightning
callback (callbacks/calibration.py) builds the runner from the trainer and writes the files.
"""
from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path

import torch

from lightning_adaptiveload.calibration.compiled import compiled_submodules, raise_recompile_limit
from lightning_adaptiveload.calibration.config import CalibrationConfig
from lightning_adaptiveload.calibration.fit import distrust_reasons, fit_memory_models, fit_points
from lightning_adaptiveload.calibration.grid import calibration_grid, required_points, seq_len_grid
from lightning_adaptiveload.calibration.memory import (MaterializedState, OptimizerMemory, device_memory_bytes,
                                                       optimizer_memory, optimizer_state_present)
from lightning_adaptiveload.calibration.protocols import (CalibratedDataModule, MemoryPlanned, Replannable, Runner,
                                                          ShapeListing, Switch, missing_methods)
from lightning_adaptiveload.calibration.record import INFEASIBLE, read_cache
from lightning_adaptiveload.calibration.result import CalibrationResult, MemoryPlanResult, Source
from lightning_adaptiveload.calibration.sweep import sweep
from lightning_adaptiveload.calibration.verify import PlanVerifier, VerifyOutcome
from lightning_adaptiveload.scheduling.buckets import ScheduledShape
from lightning_adaptiveload.scheduling.cost_model import CostModel, load_cost_model
from lightning_adaptiveload.scheduling.depth_cost_model import DepthCostModel
from lightning_adaptiveload.scheduling.memory_model import MemoryModel
from lightning_adaptiveload.scheduling.verification import Verification

CPU_MEASUREMENT_THREADS = 1  # intra-op threads while calibration measures on CPU (measurement_threads)
FALLBACK_POLICY = "token_equal"  # what trains when the cost model cannot be trusted
REMEASURE_REPEATS = 3  # a distrusted fit is measured once more with this many times the repeats


@contextlib.contextmanager
def measurement_threads(device: torch.device, info: Callable[[str], None] = print,
                        compiled: bool = False) -> Iterator[None]:
    """Inside, a CPU device's steps run on CPU_MEASUREMENT_THREADS intra-op threads
    (torch.set_num_threads), restored on exit; a CUDA device is left alone, and so is a model with
    compiled regions (`compiled`): dynamo guards on the thread count, so graphs compiled on one
    thread would all compile again for training's count (the CPU demo with `compile: dynamic` and
    per-bucket checkpointing compiled 6 graphs instead of 4, 2 of them in training).

    Why: on a machine whose cores other processes share, an op split over every core waits for
    its slowest thread, and which thread is preempted changes from step to step: with 2 threads on a
    busy 2-core machine the demo's times scattered so much that its fit was distrusted in 3 of 3 fresh
    runs, and with one thread it was trusted at once (issue 28). Every measurement of the loop (the
    grid and verification) runs so, so the models and the measured times priced together agree with
    each other. Training then runs at the machine's thread count: its step times are shorter than
    the measured ones, and the plan balances their ratios, which the thread count changes less."""
    if device.type != "cpu" or compiled:
        yield
        return
    threads = torch.get_num_threads()
    if threads != CPU_MEASUREMENT_THREADS:
        info(f"CostModelCalibration: measuring with {CPU_MEASUREMENT_THREADS} intra-op thread(s) on CPU "
             f"(training runs with {threads})")
    torch.set_num_threads(CPU_MEASUREMENT_THREADS)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def check_datamodule(datamodule: object) -> None:
    """TypeError naming what a DataModule lacks to be calibrated at all."""
    missing = missing_methods(datamodule, CalibratedDataModule)
    if missing:
        raise TypeError(f"CostModelCalibration needs a datamodule with {', '.join(m + '()' for m in missing)} (an "
                        f"AdaptiveLoadDataModule); got {type(datamodule).__name__}")


class Calibration:
    """One calibration of one fit (module docstring).

    runner: real steps (calibration.protocols.Runner); datamodule: a CalibratedDataModule (and what
    else of calibration.protocols it offers); switch: the per-bucket checkpointing switch, or None;
    optimizers: the fit's optimizers (their state is measured and, for verification, created and
    dropped again); key: the cache key (calibration/record.py); restored_points: the points of the
    checkpoint a resumed fit started with, restored_verification and restored_models the verification
    and the memory and depth models it trained with; info, warn: where progress lines and warnings go;
    progress: where the sweep's and verification's line per shape goes (default info; the callback adds the
    guards a compiled model's shape failed when it compiled again).
    """

    def __init__(self, config: CalibrationConfig, runner: Runner, datamodule, *, switch: Switch | None,
                 optimizers: list[torch.optim.Optimizer], key: dict, cache_path: Path,
                 restored_points: list[dict] | None = None, restored_verification: Verification | None = None,
                 restored_models: tuple[MemoryModel, DepthCostModel] | None = None,
                 save: Callable[[CalibrationResult], None] | None = None,
                 info: Callable[[str], None] = print, warn: Callable[[str], None] = print,
                 progress: Callable[[str], None] | None = None):
        check_datamodule(datamodule)
        self.config, self.runner, self.datamodule, self.switch = config, runner, datamodule, switch
        self.optimizers, self.key, self.cache_path = optimizers, key, cache_path
        self.restored_points, self.restored_verification = restored_points, restored_verification
        self.restored_models = restored_models
        # called on every rank with the measured, trusted calibration before verification runs, so a run
        # stopped in verification (a time limit, a preemption) leaves its points to the next run's cache
        self.save = save
        self.info, self.warn = info, warn
        # the sweep's and verification's line per shape (the callback's adds a compiled model's recompile reasons)
        self.progress = info if progress is None else progress
        self.every_block = None if switch is None else switch.num_blocks  # k of the cost model's points
        self.grid_checkpointed = None if switch is None else (switch.num_blocks, switch.num_blocks // 2)
        self.device_bytes: int | None = None  # the smallest rank's device memory (run() measures it)
        self.memory: MemoryPlanResult | None = None  # the memory plan's part as it stands (refits update it)
        self.cached_verification: dict | None = None  # the "verification" of a cache this run reuses
        self.cold_s = 0.0  # seconds of the grid points' first (cold) steps, over every sweep run

    # ---- the loop -----------------------------------------------------------------------------
    def run(self, grid: list[tuple[int, int]], compiled: list[str], recompile_limit: int | None) -> CalibrationResult:
        with measurement_threads(self.runner.device, self.info, compiled=bool(compiled)):
            return self._run(grid, compiled, recompile_limit)

    def _run(self, grid: list[tuple[int, int]], compiled: list[str], recompile_limit: int | None) -> CalibrationResult:
        start = time.perf_counter()
        config = self.config
        # one number on every rank: the sweep's limit and verification's budget decide collectively
        self.device_bytes = int(-self.runner.max_over_ranks(-device_memory_bytes(self.runner.device))[0])
        memory_terms = self._memory_terms() if self.switch is not None else None
        if config.cost_model_path is not None:  # every rank reads the same file
            self.info(f"CostModelCalibration: scheduling with the cost model {config.cost_model_path} as given; "
                      "no benchmark run")
            points, source = [], Source.GIVEN
            cost_model, reasons, m_mem = load_cost_model(config.cost_model_path), [], config.m_mem
            memory = None if memory_terms is None else MemoryPlanResult(
                False, ("the cost model was given: no memory measured",), None, None, *memory_terms)
        else:
            points, source = self._points(grid, eager=not compiled)
            cost_model, reasons, m_mem, memory = self._fit(points, memory_terms)
            if source is Source.CHECKPOINT and memory is not None and self.restored_models is not None:
                # the models the resumed run planned with, refits by its verification included
                memory = replace(memory, memory_model=self.restored_models[0], depth_cost_model=self.restored_models[1],
                                 distrust_reasons=())
            if reasons and source is Source.MEASURED:
                self.warn("CostModelCalibration: the fit is not trusted (" + "; ".join(reasons) + "); measuring "
                          f"again with {REMEASURE_REPEATS * config.repeats} repeats per point")
                points, source = self._sweep(grid, REMEASURE_REPEATS * config.repeats, not compiled), Source.MEASURED_AGAIN
                cost_model, reasons, m_mem, memory = self._fit(points, memory_terms)
        self.memory = self._apply(cost_model, reasons, m_mem, memory)
        result = CalibrationResult(source=source, points=points, cost_model=cost_model, distrust_reasons=tuple(reasons),
                                   m_mem=m_mem, memory=self.memory, calibration_s=time.perf_counter() - start,
                                   cold_s=self.cold_s, first_step_s=self._first_step_s(), compiled_regions=tuple(compiled),
                                   recompile_limit=recompile_limit)
        if not config.verify:
            return result
        if self.save is not None and result.cacheable:
            self.save(result)
        verify_start = time.perf_counter()
        # the kernels of the grid's (B, S) are built in this process when it measured them; a
        # compiled model may compile again on any new shape, so its cold steps never stand for warm ones
        built: set[tuple[int, int]] | None = None
        if not compiled:
            built = {(p["batch_size"], p["seq_len"]) for p in points if p["status"] == "ok"} \
                if source in (Source.MEASURED, Source.MEASURED_AGAIN) else set()
        outcome, state = self._verify(points, None if reasons else cost_model, built)
        return replace(result, verification=outcome, optimizer_state=state, verify_s=time.perf_counter() - verify_start,
                       verifies_cache=source is Source.CACHE and self.cached_verification is None,
                       first_step_s=self._first_step_s())

    def _first_step_s(self) -> float | None:
        first = self.runner.first_step_ms
        return None if first is None else first / 1e3

    # ---- 1. measure -----------------------------------------------------------------------------
    def _points(self, grid: list[tuple[int, int]], eager: bool) -> tuple[list[dict], Source]:
        """The grid's points and where they come from: the checkpoint of a resumed fit, a cache with
        this key, or a new measurement."""
        if self.restored_points is not None:  # every rank loaded the same checkpoint
            self.info("CostModelCalibration: resuming with the calibration stored in the checkpoint; no benchmark run")
            return self.restored_points, Source.CHECKPOINT
        cached = self.runner.broadcast(read_cache(self.cache_path, self.key) if self.runner.is_global_zero else None)
        self.cached_verification = None if cached is None else cached.get("verification")
        if cached is not None:
            self.info(f"CostModelCalibration: reusing {self.cache_path} (same model, strategy, precision, world size, "
                      "device and grid); no benchmark run")
            return cached["points"], Source.CACHE
        return self._sweep(grid, self.config.repeats, eager), Source.MEASURED

    def _sweep(self, grid: list[tuple[int, int]], repeats: int, eager: bool) -> list[dict]:
        config, switch = self.config, self.switch
        points = sweep(self.runner, lambda s, b: self.datamodule.synthetic_batch(s, b), grid,
                       batch_sizes=config.batch_sizes, max_tokens=config.max_tokens, warmup=config.warmup,
                       repeats=repeats, time_budget_s=config.time_budget_s,
                       memory_limit=config.max_memory_fraction * self.device_bytes,
                       checkpointed=self.grid_checkpointed,
                       checkpointing=None if switch is None else switch.checkpointing, progress=self.progress, eager=eager)
        self.cold_s += sum(p.get("cold_ms", 0.0) for p in points) / 1e3
        return points

    def _memory_terms(self) -> tuple[OptimizerMemory, int]:
        """The optimizer memory (the largest of the ranks', calibration/memory.py) and the device
        memory (the smallest of the ranks') the memory plan budgets with."""
        mine = optimizer_memory(self.optimizers)
        state, params = self.runner.max_over_ranks(mine.state_bytes, mine.param_bytes)
        return OptimizerMemory(int(state), int(params), mine.rule), self.device_bytes

    # ---- 2. fit ---------------------------------------------------------------------------------
    def _fit(self, points: list[dict], memory_terms: tuple[OptimizerMemory, int] | None
             ) -> tuple[CostModel | None, list[str], int | None, MemoryPlanResult | None]:
        """Rank 0 fits and judges; every rank gets the same models, verdicts and M_mem (or the same
        fallback), so none schedules differently or waits alone. The cost model and M_mem come from
        the points with every block checkpointed; with a switch the memory and depth models from all."""
        config = self.config
        at_every_block = [p for p in points if p.get("checkpointed") == self.every_block]
        feasible = [p for p in at_every_block if p["status"] == "ok"]
        infeasible = [p for p in at_every_block if p["status"] in INFEASIBLE]
        if config.m_mem is not None:
            m_mem = int(config.m_mem)
        elif infeasible and feasible:
            m_mem = max(1, math.floor(config.memory_margin * max(p["batch_size"] * p["seq_len"] for p in feasible)))
        else:
            m_mem = None  # the grid never hit the memory limit: keep the DataModule's
        verdict = None
        if self.runner.is_global_zero:
            model, error = fit_points(feasible, config.form)
            reasons = [error] if model is None else distrust_reasons(model, feasible, config.max_heldout_error,
                                                                     config.min_work_correlation)
            models = (None, None, ["no cost model to build the depth model on"])
            if memory_terms is not None and model is not None:
                models = self._fit_memory(points, model, memory_terms[0].state_bytes)
            verdict = (model, reasons, *models)
        model, reasons, memory_model, depth_model, memory_reasons = self.runner.broadcast(verdict)
        memory = None if memory_terms is None else MemoryPlanResult(
            False, tuple(memory_reasons), memory_model, depth_model, *memory_terms)
        return model, reasons, m_mem, memory

    def _fit_memory(self, points: list[dict], model: CostModel, state_bytes: int, verified=()
                    ) -> tuple[MemoryModel | None, DepthCostModel | None, list[str]]:
        memory, depth_model, why = fit_memory_models(points, self.every_block, model, state_bytes,
                                               self.config.max_memory_heldout_error, verified=list(verified))
        return memory, depth_model, [] if why is None else [why]

    # ---- 3. plan --------------------------------------------------------------------------------
    def _apply(self, cost_model: CostModel | None, reasons: list[str], m_mem: int | None,
               memory: MemoryPlanResult | None) -> MemoryPlanResult | None:
        """Hand the verdict to the DataModule: a trusted fit with its memory models as a memory plan
        (the DataModule keeps its m_mem as the batches' token cap), or the cost model and M_mem with
        every block checkpointed; a distrusted one falls back to token_equal."""
        datamodule = self.datamodule
        if reasons:
            self.warn("CostModelCalibration: the cost model is NOT trusted (" + "; ".join(reasons) + "); training falls "
                      f"back to the {FALLBACK_POLICY} policy with "
                      + (f"M_mem = {m_mem}" if m_mem else "the DataModule's M_mem") + " and no cost model"
                      + (", every block checkpointed" if self.switch is not None else "")
                      + "; nothing is cached. Calibrate on a quiet machine or widen the grid (docs/cost_model.md).")
            datamodule.set_cost_model(None, m_mem, policy=FALLBACK_POLICY)
            if memory is not None:
                memory = replace(memory, used=False,
                                 distrust_reasons=("the cost model is not trusted",) + memory.distrust_reasons)
            return memory
        if memory is not None and memory.memory_model is not None and not isinstance(datamodule, MemoryPlanned):
            memory = replace(memory, distrust_reasons=(f"{type(datamodule).__name__} has no set_memory_plan()",))
        if memory is None or memory.distrust_reasons:
            datamodule.set_cost_model(cost_model, m_mem)
            if memory is not None:
                self.warn("CostModelCalibration: no memory plan (" + "; ".join(memory.distrust_reasons)
                          + f"); every step checkpoints all {self.switch.num_blocks} blocks")
            return memory
        memory = replace(memory, used=True)
        datamodule.set_cost_model(cost_model, None)
        datamodule.set_memory_plan(memory.depth_cost_model, memory.memory_model, memory.device_memory_bytes,
                                   self.config.max_memory_fraction, plan_margin=self.config.plan_margin)
        budget = self.config.max_memory_fraction * memory.device_memory_bytes
        if memory.optimizer_memory.step_bytes > budget:
            self.warn(f"CostModelCalibration: the optimizer step alone (parameters, gradients, optimizer state and a "
                      f"temporary copy: ~{memory.optimizer_memory.step_bytes / 2**30:.2f} GiB per rank) exceeds the "
                      f"memory plan's budget of {budget / 2**30:.2f} GiB; training may run out of memory at the "
                      f"optimizer step (shard the model, or raise max_memory_fraction)")
        return memory

    # ---- 4. verify ------------------------------------------------------------------------------
    def _verify(self, points: list[dict], cost_model: CostModel | None, built: set[tuple[int, int]] | None
                ) -> tuple[VerifyOutcome | None, MaterializedState | None]:
        datamodule = self.datamodule
        if not isinstance(datamodule, ShapeListing):
            self.info(f"CostModelCalibration: no verification ({type(datamodule).__name__} does not list its scheduled "
                      "batch shapes: scheduled_batch_shapes())")
            return None, None
        device = self.runner.device
        budget = self.config.max_memory_fraction * self.device_bytes
        prior, frozen = self._prior(budget)
        plan = _DataModulePlan(self, points, cost_model)
        with optimizer_state_present(self.optimizers, device) as state:
            # the optimizer state every verified peak holds: created now and measured, or there already
            plan.state_bytes = state.state_bytes if state.created or self.memory is None \
                else self.memory.optimizer_memory.state_bytes
            if state.step_peak_bytes is not None:
                self.info(f"CostModelCalibration: the optimizer's first step peaked at {state.step_peak_bytes / 2**30:.2f} "
                          f"GiB and its state holds {state.state_bytes / 2**30:.2f} GiB; every shape below runs with it")
            verifier = PlanVerifier(plan.measure, plan, budget_bytes=budget, device_bytes=self.device_bytes,
                                    num_blocks=None if self.switch is None else self.switch.num_blocks,
                                    max_rounds=self.config.verify_rounds, progress=self.progress, built=built)
            outcome = verifier.run(prior, frozen)
        if outcome.unresolved:
            self.warn(f"CostModelCalibration: {len(outcome.unresolved)} scheduled bucket(s) did not fit in "
                      f"verification and {type(datamodule).__name__} cannot be planned again (no set_verification()), "
                      f"e.g. {outcome.unresolved[0]} tokens: training will run out of memory on them; lower "
                      f"max_seq_len or m_mem")
        elif outcome.settled:
            self.warn(f"CostModelCalibration: {len(outcome.settled)} bucket(s) still did not fit after "
                      f"{self.config.verify_rounds} re-plans and were settled on their safest measured batch "
                      f"({', '.join(map(str, outcome.settled))} tokens); a trusted fit is cached with this settled plan: a "
                      f"later run checks each of its shapes near the budget once")
        return outcome, state

    def _prior(self, budget: float) -> tuple[Verification | None, bool]:
        """(the verification to start from, frozen): a resumed fit's, frozen (its epoch plan rests on it),
        else a reused cache's when it was verified against this budget, else none."""
        if not isinstance(self.datamodule, Replannable):
            return None, False
        if self.restored_verification is not None:
            return self.restored_verification, True
        doc = self.cached_verification
        if doc is None or doc.get("budget_bytes") != budget:
            return None, False
        try:
            return Verification.from_dict({k: doc[k] for k in ("shapes", "limits", "max_seq_len", "budget_bytes")},
                                          f"{self.cache_path}: 'verification'"), False
        except (KeyError, ValueError) as e:
            self.info(f"CostModelCalibration: the cache's verification is not reused ({e}); every shape is measured")
            return None, False


class _DataModulePlan:
    """verify.Plan over the DataModule and the calibration's models: what is scheduled, what it is
    expected to cost, and the refit and hand-over after each verification round."""

    def __init__(self, calibration: Calibration, points: list[dict], cost_model: CostModel | None):
        self.calibration, self.points, self.cost_model = calibration, points, cost_model
        self.datamodule, self.switch, self.runner = calibration.datamodule, calibration.switch, calibration.runner
        self.state_bytes = 0  # the optimizer state in every verified peak
        self._schedule: tuple[list[dict] | None, list[ScheduledShape]] | None = None
        self._tokens: dict[tuple[int, int, int], int] = {}

    def _rows(self) -> list[dict] | None:
        return self._scheduled()[0]

    def _scheduled(self) -> tuple[list[dict] | None, list[ScheduledShape]]:
        """(bucket rows, scheduled shapes) of the DataModule as it plans now, computed once between
        hand-overs (listing the shapes plans the epoch, which verification asks for many times)."""
        if self._schedule is None:
            rows = self.datamodule.bucket_table().rows() if isinstance(self.datamodule, Replannable) else None
            shapes = [ScheduledShape(*entry) for entry in self.datamodule.scheduled_batch_shapes()]
            self._schedule = rows, shapes
        return self._schedule

    def buckets(self) -> dict[int, tuple[int, tuple[int, int, int] | None, int | None]]:
        rows = self._rows()
        if rows is not None:
            return {row["seq_len"]: (row["batch_size"], row["latent_shape"], row["checkpointed"]) for row in rows}
        buckets: dict[int, tuple] = {}  # only the shapes are known: each latent shape is a bucket
        for shape in self.shapes():
            s = self.seq_len(shape.latent_shape)
            if s not in buckets or shape.batch_size > buckets[s][0]:
                buckets[s] = (shape.batch_size, tuple(shape.latent_shape), shape.checkpointed)
        return buckets

    def shapes(self) -> list[ScheduledShape]:
        return self._scheduled()[1]

    def seq_len(self, latent_shape) -> int:
        thw = tuple(int(v) for v in latent_shape)
        if thw not in self._tokens:
            rows = self._rows()
            by_shape = {} if rows is None else {tuple(r["latent_shape"]): r["seq_len"] for r in rows if r["latent_shape"]}
            self._tokens[thw] = by_shape.get(thw) or int(self.datamodule.synthetic_batch(thw, 1)["seq_len"])
        return self._tokens[thw]

    def predict(self, shape: ScheduledShape) -> tuple[float | None, float | None]:
        s = self.seq_len(shape.latent_shape)
        memory = self.calibration.memory
        if memory is not None and memory.used:
            k = memory.memory_model.num_blocks if shape.checkpointed is None else shape.checkpointed
            return (float(memory.depth_cost_model.predict(shape.batch_size, s, k)),
                    float(memory.memory_model.predict(shape.batch_size, s, k)))
        return (None if self.cost_model is None else float(self.cost_model.predict(shape.batch_size, s))), None

    def measure(self, shape: ScheduledShape, warm: bool) -> dict:
        """One training step of the shape at its depth (no depth: every block checkpointed, as
        training runs it without a plan): the first (cold) one from an empty allocator cache, or with
        `warm` the next one, the allocator's blocks kept (verify.PlanVerifier's measure)."""
        switch = self.switch
        checkpointed = None if switch is None else (switch.num_blocks if shape.checkpointed is None else shape.checkpointed)
        with switch.checkpointing(checkpointed) if switch is not None else contextlib.nullcontext():
            raw = self.runner.measure(lambda: self.datamodule.synthetic_batch(tuple(shape.latent_shape), shape.batch_size),
                                      warmup=0, repeats=1, empty_cache=not warm)
        if raw["status"] != "ok":
            return raw
        return {"status": "ok", "warm_ms" if warm else "cold_ms": raw["time_ms"], "peak_bytes": raw["peak_bytes"],
                "reserved_bytes": raw["reserved_bytes"]}

    def refit(self, verification: Verification) -> None:
        """The memory and depth models fitted again on the grid points and every measured shape with
        a peak (rank 0 fits, every rank gets them), handed to the DataModule; kept as they were when
        the refit fails or there is no memory plan."""
        memory = self.calibration.memory
        if memory is None or not memory.used or not isinstance(self.datamodule, Replannable):
            return
        verdict = None
        if self.runner.is_global_zero:
            verdict = self.calibration._fit_memory(self.points, self.cost_model, self.state_bytes,
                                                   verified=[m for m in verification.shapes if m.peak_bytes])
        memory_model, depth_model, reasons = self.runner.broadcast(verdict)
        if reasons:
            self.calibration.info("CostModelCalibration: refit on the verified shapes failed (" + "; ".join(reasons)
                                  + "); the plan keeps the models it had")
            return
        # the measured optimizer state replaces the predicted one in the models' m0
        self.calibration.memory = replace(memory, memory_model=memory_model, depth_cost_model=depth_model)
        self.datamodule.set_memory_plan(depth_model, memory_model, memory.device_memory_bytes,
                                        self.calibration.config.max_memory_fraction,
                                        plan_margin=self.calibration.config.plan_margin)
        self._schedule = None

    def apply(self, verification: Verification) -> None:
        if isinstance(self.datamodule, Replannable):  # one that cannot take limits: the shapes ran, nothing changes
            self.datamodule.set_verification(verification)
            self._schedule = None


def grid_and_recompile_room(config: CalibrationConfig, datamodule, pl_module: torch.nn.Module, depths: bool,
                            info: Callable[[str], None]) -> tuple[list[tuple[int, int]], list[str], int | None]:
    """The (B, S) grid of this DataModule's buckets, the compiled regions of the module and the dynamo
    recompile limit raised for what calibration and verification will feed them (None: not compiled)."""
    seq_lens = seq_len_grid(datamodule.bucket_seq_lens(), config.num_seq_lens)
    grid = calibration_grid(seq_lens, list(config.batch_sizes), config.max_tokens)
    compiled = compiled_submodules(pl_module)
    if not compiled:
        return grid, compiled, None
    # the required points run again at two more depths (sweep.sweep)
    depth_points = 2 * len(required_points(seq_lens, list(config.batch_sizes), config.max_tokens)) if depths else 0
    # a compiled block traces the checkpointing switch: the other depths' points compile again. The
    # schedule is not known before the fit: a bucket runs its full batch and one smaller one (its
    # remainder), and each re-plan of verification may try one more full batch, plus its safest one.
    shapes = 2 * len(datamodule.bucket_seq_lens()) * (config.verify_rounds + 2)
    old, new = raise_recompile_limit(len(grid) + depth_points + shapes)
    info(f"CostModelCalibration: {len(compiled)} compiled region(s) (e.g. {compiled[0] or '<root>'}); dynamo "
         f"recompile_limit {old} -> {new} for {len(grid) + depth_points} grid points and the scheduled shapes")
    return grid, compiled, new

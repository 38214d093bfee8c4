"""CostModelCalibration: benchmark the user's training step on a (B, S) grid before fit, fit the
step-time cost model, and rebuild the DataModule's bucket table from it.

Runs once in `on_fit_start` (after the strategy wrapped the model and the optimizers exist,
before the train loader is built). Each grid point is real forward + backward of the user's
`training_step` on `datamodule.synthetic_batch(S, B)` under the active strategy and precision
(`trainer.strategy.training_step`, `pre_backward`/`post_backward` around `loss.backward()`);
no optimizer step, so parameters and optimizer state are untouched, and gradients, buffers,
train/eval modes and the python/numpy/torch/cuda RNG states are restored afterwards.
docs/lightning.md describes the grid, the memory rule and the files written.
"""
from __future__ import annotations

import contextlib
import gc
import hashlib
import json
import math
import os
import random
import re
import time
from pathlib import Path

import lightning
import numpy as np
import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_info
from lightning.pytorch.utilities.signature_utils import is_param_in_hook_signature

from lightning_adaptiveload.scheduling.cost_model import CostModel, plot_fit

FORMAT = "adaptiveload.calibration"
VERSION = 1
# ok: measured; oom: out of memory on some rank; predicted_oom: not run (CUDA memory forecast);
# skipped_oom: a point no larger in B and S did not fit; skipped_budget: time budget spent.
STATUSES = ("ok", "oom", "predicted_oom", "skipped_oom", "skipped_budget")


def seq_len_grid(bucket_seq_lens: np.ndarray, num_seq_lens: int) -> list[int]:
    """`num_seq_lens` distinct bucket lengths (tokens) evenly spaced in rank order over the
    sorted unique buckets: always the shortest and the longest, so the fit spans the range the
    sampler will schedule."""
    unique = np.unique(np.asarray(bucket_seq_lens, dtype=np.int64))
    if unique.size == 0 or unique[0] < 1:
        raise ValueError(f"bucket_seq_lens must be non-empty positive token counts, got {unique.tolist()}")
    picks = np.unique(np.linspace(0, unique.size - 1, min(num_seq_lens, unique.size)).round().astype(int))
    return [int(unique[i]) for i in picks]


def calibration_grid(seq_lens: list[int], batch_sizes: list[int], max_tokens: int | None) -> list[tuple[int, int]]:
    """(B, S) points, B from `batch_sizes` with B*S <= max_tokens (B=1 always kept), ordered by
    B*S then S so memory grows along the run and early OOMs prune the larger points."""
    points = [(b, s) for s in seq_lens for b in sorted(set(batch_sizes))
              if b == 1 or max_tokens is None or b * s <= max_tokens]
    return sorted(points, key=lambda p: (p[0] * p[1], p[1]))


def predicted_peak_bytes(points: list[dict], b: int, s: int) -> float:
    """Peak memory (bytes) of (b, s) extrapolated linearly in B through the two largest measured
    batch sizes at the same S; 0 when fewer than two were measured (nothing to extrapolate)."""
    same_s = sorted((p["batch_size"], p["peak_bytes"]) for p in points if p["seq_len"] == s and p["status"] == "ok")
    if len(same_s) < 2:
        return 0.0
    (b0, m0), (b1, m1) = same_s[-2:]
    return m1 + (m1 - m0) / (b1 - b0) * (b - b1)


def model_fingerprint(module: torch.nn.Module) -> str:
    """sha256 of what decides the step's cost beyond the strategy: the class name, every
    parameter's name, shape and dtype, every submodule's class and any `forward` bound on an
    instance (module surgery swaps those, leaving classes and parameters alone), and the
    LightningModule's hyperparameters (e.g. activation checkpointing, which changes no parameter)."""
    lines = [f"{type(module).__module__}.{type(module).__qualname__}"]
    lines += [f"{n}:{tuple(p.shape)}:{p.dtype}" for n, p in module.named_parameters()]
    for name, sub in module.named_modules():
        patched = getattr(sub.__dict__.get("forward"), "__func__", sub.__dict__.get("forward"))
        lines.append(f"{name}:{type(sub).__qualname__}"
                     + (f":{patched.__module__}.{patched.__qualname__}" if patched is not None else ""))
    hparams = getattr(module, "hparams", None)
    if hparams:
        try:
            text = json.dumps(dict(hparams), sort_keys=True, default=str)
        except TypeError:  # a nested dict with keys of several types cannot be sorted
            text = str(sorted(hparams.items()))
        # no object addresses (a function's str has one): the same hparams give the same key every run
        lines.append(re.sub(r" at 0x[0-9a-fA-F]+", "", text))
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()


def _rng_state() -> dict:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state:
        torch.cuda.set_rng_state_all(state["cuda"])


class _SavedTensorBytes:
    """Bytes of distinct storages autograd saves for backward (activation memory), used as the
    peak-memory measure on CPU where no allocator statistics exist."""

    def __init__(self):
        self.storages: dict[int, int] = {}

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        self.storages[storage.data_ptr()] = storage.nbytes()
        return t

    @property
    def total(self) -> int:
        return sum(self.storages.values())


class CostModelCalibration(Callback):
    """Fit the step-time cost model t(B, S) on the real training step, then call
    `datamodule.set_cost_model(cost_model, m_mem)`.

    Args:
        num_seq_lens: bucket lengths S benchmarked (see `seq_len_grid`).
        batch_sizes: batch sizes B tried at each S (default powers of two 1..256); at each S the
            sizes after the first out-of-memory are skipped (memory grows with B and S).
        max_tokens: skip points with B*S above this (tokens); None probes until OOM.
        warmup, repeats: untimed and timed steps per point; the median time counts.
        time_budget_s: stop starting new points after this many seconds (agreed across ranks).
        m_mem: memory budget (tokens per batch) to hand to the DataModule instead of measuring.
        memory_margin: M_mem = floor(margin * largest feasible B*S) when some point did not fit.
        max_memory_fraction: on CUDA, a point whose peak memory, extrapolated linearly in B from
            the two previous points of its S, would exceed this fraction of the device's memory is
            recorded infeasible without running it (an OOM inside an FSDP collective on one rank
            cannot be agreed on without risking a hang; predicting it avoids most of them).
        form: cost-model form passed to `CostModel.fit`.
        cache_path: calibration JSON reused when its key (model fingerprint, strategy, precision,
            world size, device, grid) matches; default `<default_root_dir>/calibration_cache.json`.
    """

    def __init__(self, num_seq_lens: int = 4, batch_sizes: list[int] | None = None, max_tokens: int | None = None,
                 warmup: int = 1, repeats: int = 3, time_budget_s: float = 180.0, m_mem: int | None = None,
                 memory_margin: float = 0.9, max_memory_fraction: float = 0.9, form: str = "auto",
                 cache_path: str | None = None):
        if num_seq_lens < 1 or warmup < 0 or repeats < 1 or time_budget_s <= 0:
            raise ValueError("CostModelCalibration: need num_seq_lens >= 1, warmup >= 0, repeats >= 1, "
                             f"time_budget_s > 0; got {num_seq_lens}, {warmup}, {repeats}, {time_budget_s}")
        if not 0 < memory_margin <= 1 or not 0 < max_memory_fraction <= 1:
            raise ValueError("CostModelCalibration: memory_margin and max_memory_fraction must be in (0, 1]")
        self.num_seq_lens = num_seq_lens
        self.batch_sizes = list(batch_sizes) if batch_sizes else [2**i for i in range(9)]
        if any(int(b) != b or b < 1 for b in self.batch_sizes):
            raise ValueError(f"CostModelCalibration.batch_sizes must be integers >= 1, got {self.batch_sizes}")
        self.max_tokens = max_tokens
        self.warmup, self.repeats, self.time_budget_s = warmup, repeats, time_budget_s
        self.m_mem, self.memory_margin, self.max_memory_fraction = m_mem, memory_margin, max_memory_fraction
        self.form, self.cache_path = form, cache_path
        # Results, for the user and the tests.
        self.cost_model: CostModel | None = None
        self.measured_m_mem: int | None = None
        self.points: list[dict] = []
        self.from_cache = False
        self._restored_points: list[dict] | None = None  # from a checkpoint, see load_state_dict

    # ---------------------------------------------------------------- hook

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        datamodule = trainer.datamodule
        for method in ("synthetic_batch", "bucket_seq_lens", "set_cost_model"):
            if not callable(getattr(datamodule, method, None)):
                raise TypeError(f"CostModelCalibration needs a datamodule with {method}() (an "
                                f"AdaptiveLoadDataModule); got {type(datamodule).__name__}")
        if not pl_module.automatic_optimization:  # same module on every rank: every rank raises
            raise TypeError(f"CostModelCalibration needs automatic optimization; {type(pl_module).__name__} "
                            "steps its optimizers inside training_step (manual optimization), which would "
                            "change the parameters during the benchmark")
        start = time.perf_counter()
        seq_lens = seq_len_grid(datamodule.bucket_seq_lens(), self.num_seq_lens)
        grid = calibration_grid(seq_lens, self.batch_sizes, self.max_tokens)
        key = self._key(trainer, pl_module, grid)
        cache_path = Path(self.cache_path or os.path.join(trainer.default_root_dir, "calibration_cache.json"))

        if self._restored_points is not None:  # every rank loaded the same checkpoint
            self.points, self.from_cache, self._restored_points = self._restored_points, True, None
            rank_zero_info("CostModelCalibration: resuming with the calibration stored in the checkpoint; "
                           "no benchmark run")
        else:
            cached = trainer.strategy.broadcast(_read_cache(cache_path, key) if trainer.is_global_zero else None)
            if cached is not None:
                self.points, self.from_cache = cached["points"], True
                rank_zero_info(f"CostModelCalibration: reusing {cache_path} (same model, strategy, precision, "
                               "world size, device and grid); no benchmark run")
            else:
                self.points = self._benchmark(trainer, pl_module, datamodule, grid, start)

        feasible = [p for p in self.points if p["status"] == "ok"]
        infeasible = [p for p in self.points if p["status"] in ("oom", "predicted_oom")]
        if self.m_mem is not None:
            self.measured_m_mem = int(self.m_mem)
        elif infeasible and feasible:
            self.measured_m_mem = max(1, math.floor(self.memory_margin * max(p["batch_size"] * p["seq_len"]
                                                                             for p in feasible)))
        else:
            self.measured_m_mem = None  # the grid never hit the memory limit: keep the DataModule's

        # Rank 0 fits; every rank gets the same model (or the same error, so none waits alone).
        fit = self._fit(feasible) if trainer.is_global_zero else None
        self.cost_model, error = trainer.strategy.broadcast(fit)
        if error:
            raise RuntimeError(f"CostModelCalibration: {error}")
        datamodule.set_cost_model(self.cost_model, self.measured_m_mem)

        # trainer.log_dir is a collective (a broadcast): resolve it on every rank, not in rank 0 alone.
        log_dir = Path(trainer.log_dir or trainer.default_root_dir)
        write_error = None
        if trainer.is_global_zero:
            try:
                doc = self._document(trainer, key, time.perf_counter() - start)
                if not self.from_cache:
                    cache_path.parent.mkdir(parents=True, exist_ok=True)
                    cache_path.write_text(json.dumps(doc, indent=1) + "\n", encoding="utf-8")
                self._save_outputs(log_dir, doc, feasible)
                self._report(trainer, doc, max(seq_lens))
                if callable(getattr(datamodule, "bucket_table", None)):
                    rank_zero_info("bucket table after calibration\n" + datamodule.bucket_table().format())
            except Exception as e:  # raised below on every rank: the others must not train on alone
                write_error = e
        if self._agree(trainer.strategy, write_error is not None):
            detail = f": {type(write_error).__name__}: {write_error}" if write_error else ""
            raise RuntimeError(f"CostModelCalibration: rank 0 failed to write or report the calibration{detail}") \
                from write_error

    # A resumed fit must schedule with the cost model it started with: the sampler's resume state
    # holds m_mem, m_comp and p, and a new measurement (or a cache since overwritten) would differ.
    def state_dict(self) -> dict:
        return {"points": self.points}

    def load_state_dict(self, state_dict: dict) -> None:
        self._restored_points = state_dict.get("points") or None

    # ---------------------------------------------------------------- benchmark

    def _benchmark(self, trainer: Trainer, pl_module: LightningModule, datamodule, grid, start: float) -> list[dict]:
        strategy = trainer.strategy
        device = strategy.root_device
        rng = _rng_state()
        modes = {m: m.training for m in pl_module.modules()}
        buffers = {n: b.detach().clone() for n, b in pl_module.named_buffers()}
        # self.log is forbidden in on_fit_start and the calibration must not leave logged values.
        pl_module.log = pl_module.log_dict = lambda *args, **kwargs: None
        pl_module.train()
        memory_limit = (self.max_memory_fraction * torch.cuda.get_device_properties(device).total_memory
                        if device.type == "cuda" else None)
        points: list[dict] = []
        try:
            for i, (b, s) in enumerate(grid):
                point = {"batch_size": b, "seq_len": s}
                out_of_time = time.perf_counter() - start > self.time_budget_s
                if self._agree(strategy, out_of_time):
                    point["status"] = "skipped_budget"
                elif self._dominated(points, b, s):
                    point["status"] = "skipped_oom"  # a smaller (B, S) already did not fit
                elif memory_limit is not None and predicted_peak_bytes(points, b, s) > memory_limit:
                    point["status"] = "predicted_oom"
                else:
                    point.update(self._measure_point(trainer, pl_module, datamodule, b, s, points))
                points.append(point)
                rank_zero_info(f"calibration {i + 1}/{len(grid)}: B={b} S={s} " + (
                    f"{point['time_ms']:.2f} ms" if point["status"] == "ok" else point["status"]))
        finally:
            del pl_module.log, pl_module.log_dict
            for module, training in modes.items():
                module.training = training
            with torch.no_grad():
                for name, buffer in pl_module.named_buffers():
                    buffer.copy_(buffers[name])
            self._zero_grad(trainer, pl_module)
            _set_rng_state(rng)
            if device.type == "cuda":
                torch.cuda.empty_cache()
        return points

    def _measure_point(self, trainer: Trainer, pl_module: LightningModule, datamodule, b: int, s: int,
                       points: list[dict]) -> dict:
        strategy = trainer.strategy
        device = strategy.root_device
        out_of_memory = False
        try:
            batch = strategy.batch_to_device(datamodule.synthetic_batch(s, b))
            if device.type == "cuda":
                torch.cuda.synchronize(device)
                torch.cuda.reset_peak_memory_stats(device)
            if not any(p["status"] == "ok" for p in points):
                self._settle(trainer, pl_module, batch, device)
            times, saved_bytes = [], []
            for step in range(self.warmup + self.repeats):
                saved = _SavedTensorBytes()
                counting = (torch.autograd.graph.saved_tensors_hooks(saved.pack, lambda t: t)
                            if device.type == "cpu" else contextlib.nullcontext())
                with counting:
                    elapsed = self._timed_step(trainer, pl_module, batch, device)
                saved_bytes.append(saved.total)
                if step >= self.warmup:
                    times.append(elapsed)
            peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else max(saved_bytes)
            del batch
        except torch.OutOfMemoryError:
            out_of_memory = True
        if out_of_memory:  # outside the except block, so the traceback no longer pins activations
            self._zero_grad(trainer, pl_module)
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
        if self._agree(strategy, out_of_memory):
            return {"status": "oom"}
        # A step is as slow as its slowest rank; memory as high as the fullest.
        stats = torch.tensor([float(np.median(times)), float(peak)], dtype=torch.float64, device=device)
        stats = strategy.reduce(stats, reduce_op="max")
        return {"status": "ok", "time_ms": float(stats[0]), "peak_bytes": int(stats[1])}

    def _settle(self, trainer: Trainer, pl_module: LightningModule, batch, device: torch.device,
                max_steps: int = 10, tolerance: float = 0.25) -> None:
        """Untimed steps before the first point until two consecutive step times agree within
        `tolerance` on every rank (at most `max_steps`): lazy initialisation (allocator pools,
        kernel selection, page faults after the DataModule wrote its shards) can stretch the first
        steps by 100x and would otherwise land in the timings, and in the cache."""
        previous = None
        for _ in range(max_steps):
            elapsed = self._timed_step(trainer, pl_module, batch, device)
            settled = previous is not None and abs(elapsed - previous) <= tolerance * previous
            if not self._agree(trainer.strategy, not settled):  # every rank stops at the same step
                return
            previous = elapsed

    def _timed_step(self, trainer: Trainer, pl_module: LightningModule, batch, device: torch.device) -> float:
        """ms of one forward + backward, synchronized; gradients dropped afterwards."""
        strategy = trainer.strategy
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        # batch_idx is optional in training_step; pass it only if declared, as Lightning's loop does
        with_idx = is_param_in_hook_signature(pl_module.training_step, "batch_idx", min_args=2)
        begin = time.perf_counter()
        output = strategy.training_step(batch, 0) if with_idx else strategy.training_step(batch)
        loss = output["loss"] if isinstance(output, dict) else output
        # pre/post_backward of the strategy (DDP's reducer bookkeeping) without the precision
        # plugin's, which would run the user's on_before/after_backward callback hooks.
        strategy.pre_backward(loss)
        loss.backward()
        strategy.post_backward(loss)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        elapsed = (time.perf_counter() - begin) * 1e3
        del output, loss
        self._zero_grad(trainer, pl_module)
        return elapsed

    @staticmethod
    def _zero_grad(trainer: Trainer, pl_module: LightningModule) -> None:
        for optimizer in trainer.optimizers:
            optimizer.zero_grad(set_to_none=True)
        for param in pl_module.parameters():
            param.grad = None

    @staticmethod
    def _agree(strategy, flag: bool) -> bool:
        """True on every rank if `flag` is True on any rank (one all-reduce of a number)."""
        value = torch.tensor(float(flag), device=strategy.root_device)
        return bool(strategy.reduce(value, reduce_op="max") > 0)

    @staticmethod
    def _dominated(points: list[dict], b: int, s: int) -> bool:
        return any(p["status"] in ("oom", "predicted_oom", "skipped_oom") and p["batch_size"] <= b and p["seq_len"] <= s
                   for p in points)

    # ---------------------------------------------------------------- fit, files, report

    def _fit(self, feasible: list[dict]) -> tuple[CostModel | None, str | None]:
        b, s, t = (np.array([p[k] for p in feasible], dtype=np.float64) for k in ("batch_size", "seq_len", "time_ms"))
        try:
            return CostModel.fit(b, s, t, form=self.form), None
        except Exception as e:  # any error: the other ranks wait in the broadcast for its text
            return None, (f"cannot fit the cost model from {len(feasible)} feasible points ({type(e).__name__}: {e}); "
                          "widen the grid (num_seq_lens, batch_sizes, max_tokens) or raise time_budget_s")

    def _key(self, trainer: Trainer, pl_module: LightningModule, grid) -> dict:
        device = trainer.strategy.root_device
        return {
            "model": model_fingerprint(pl_module),
            "strategy": type(trainer.strategy).__name__,
            "precision": str(trainer.precision),
            "world_size": int(trainer.world_size),
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else device.type,
            "grid": [list(p) for p in grid],
            "warmup": self.warmup,
            "repeats": self.repeats,
        }

    def _document(self, trainer: Trainer, key: dict, seconds: float) -> dict:
        return {
            "format": FORMAT,
            "version": VERSION,
            "key": key,
            "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "versions": {"torch": torch.__version__, "lightning": lightning.__version__},
            "seconds": round(seconds, 3),
            "from_cache": self.from_cache,
            "m_mem": self.measured_m_mem,
            "peak_unit": ("bytes saved for backward (CPU estimate)" if key["device"] == "cpu"
                          else "bytes (CUDA max_memory_allocated)"),
            "cost_model": {"form": self.cost_model.form, "params": self.cost_model.params, "p": self.cost_model.p,
                           "quality": {k: (v if math.isfinite(v) else None) for k, v in self.cost_model.quality.items()}},
            # `measurements` holds feasible points only, the format cost_model.load_cost_model reads
            "measurements": [p for p in self.points if p["status"] == "ok"],
            "points": self.points,
        }

    def _save_outputs(self, log_dir: Path, doc: dict, feasible: list[dict]) -> None:
        log_dir.mkdir(parents=True, exist_ok=True)
        (log_dir / "calibration.json").write_text(json.dumps(doc, indent=1) + "\n", encoding="utf-8")
        self.cost_model.to_json(log_dir / "calibration_cost_model.json")
        b, s, t = ([p[k] for p in feasible] for k in ("batch_size", "seq_len", "time_ms"))
        plot_fit(self.cost_model, b, s, t, log_dir / "calibration_fit.png")

    def _report(self, trainer: Trainer, doc: dict, longest: int) -> None:
        cm = self.cost_model
        lines = [f"{'S':>8} {'B':>5} {'time ms':>10} {'pred ms':>10} {'peak MiB':>10}  status"]
        for p in self.points:
            ok = p["status"] == "ok"
            lines.append(f"{p['seq_len']:>8} {p['batch_size']:>5} "
                         + (f"{p['time_ms']:>10.2f} {cm.predict(p['batch_size'], p['seq_len']):>10.2f} "
                            f"{p['peak_bytes'] / 2**20:>10.1f}" if ok else f"{'':>10} {'':>10} {'':>10}")
                         + f"  {p['status']}")
        q = cm.quality
        lines.append(f"cost model {cm!r}; mean rel err {q['mean_rel_err']:.1%}, held-out "
                     f"{q['heldout_mean_rel_err']:.1%}; M_mem = {self.measured_m_mem or 'kept from the DataModule'}"
                     + (f", M_comp = {cm.m_comp(self.measured_m_mem, longest):.4g} (ref S = {longest})"
                        if self.measured_m_mem else "")
                     + f"; {doc['seconds']:.1f} s" + (" (from cache)" if self.from_cache else ""))
        rank_zero_info("CostModelCalibration\n" + "\n".join(lines))
        metrics = {"calibration/p": cm.p, "calibration/points": float(len(doc["measurements"])),
                   "calibration/infeasible": float(sum(p["status"] in ("oom", "predicted_oom") for p in self.points)),
                   "calibration/seconds": doc["seconds"], "calibration/from_cache": float(self.from_cache)}
        if math.isfinite(q["heldout_mean_rel_err"]):
            metrics["calibration/heldout_mean_rel_err"] = q["heldout_mean_rel_err"]
        if self.measured_m_mem:
            metrics["calibration/m_mem"] = float(self.measured_m_mem)
        for logger in trainer.loggers:  # self.log is not allowed in on_fit_start
            logger.log_metrics(metrics, step=0)


def _read_cache(path: Path, key: dict) -> dict | None:
    """The cached calibration at `path` if its key equals `key`, else None (missing, other key,
    or unreadable: a stale cache never stops training, it is just measured again)."""
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
                and p.get("status") in STATUSES):
            return None
        if p["status"] == "ok" and not (_positive_number(p.get("time_ms")) and isinstance(p.get("peak_bytes"), int)):
            return None
    return doc


def _positive_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0


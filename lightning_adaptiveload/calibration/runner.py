"""Real training steps for measurement, with no trace left on the run.

`StepRunner` runs the user's `training_step` + backward under the active strategy and precision
(`trainer.strategy.training_step`, the strategy's `pre_backward`/`post_backward` around
`loss.backward()`), never an optimizer step, so parameters and optimizer state are untouched; on
exit it restores gradients, buffers, train/eval modes and the python/numpy/torch/cuda RNG states.
Every decision that changes what a rank does next (stop for the time budget, an out-of-memory
point) goes through one all-reduce, so all ranks run the same steps and none waits alone inside a
collective: an out-of-memory error is agreed on after each forward and each backward. (An error
inside a sharded forward's own collective still leaves the other ranks waiting there; verification
does not run a shape predicted to exceed the device, for that reason.)

The steps hold what Lightning's training steps hold: under automatic optimization zero_grad runs
after training_step and before backward, so the previous step's gradients are allocated during the
forward (and, with accumulate_grad_batches > 1, through the backward too); a step here does the same.
"""
from __future__ import annotations

import contextlib
import gc
import random
import time

import numpy as np
import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.utilities.signature_utils import is_param_in_hook_signature


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


class AgreedOutOfMemory(Exception):
    """Raised on every rank at once when any rank ran out of memory in a measured step."""


def agree(strategy, flag: bool) -> bool:
    """True on every rank if `flag` is True on any rank (one all-reduce of a number)."""
    value = torch.tensor(float(flag), device=strategy.root_device)
    return bool(strategy.reduce(value, reduce_op="max") > 0)


class _SavedTensorBytes:
    """Bytes of distinct storages autograd saves for backward (activation memory), the peak-memory
    measure on CPU where no allocator statistics exist."""

    def __init__(self):
        self.storages: dict[int, int] = {}

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        self.storages[storage.data_ptr()] = storage.nbytes()
        return t

    @property
    def total(self) -> int:
        return sum(self.storages.values())


class StepRunner:
    """Context manager: inside it, `step`, `measure` and `settle` run real training steps of
    `pl_module` under `trainer`'s strategy; leaving it restores everything they touched."""

    def __init__(self, trainer: Trainer, pl_module: LightningModule):
        self.trainer, self.pl_module = trainer, pl_module
        self.strategy = trainer.strategy
        self.device = self.strategy.root_device
        # batch_idx is optional in training_step; pass it only if declared, as Lightning's loop does
        self._with_idx = is_param_in_hook_signature(pl_module.training_step, "batch_idx", min_args=2)
        self._stepped = False  # whether a step ran: measure() leaves the first one uncounted
        # ms of that uncounted first step, max over ranks (None before it): one-time allocations, and a
        # compiled model's first graphs (traced, then compiled or read from the compile cache)
        self.first_step_ms: float | None = None

    def __enter__(self) -> "StepRunner":
        module = self.pl_module
        # measure() collects garbage before each empty_cache (cycles that pin device memory): a full
        # collection of a process with torch and lightning loaded scans ~440,000 objects (250 ms on a
        # 2-core host, ~55 times per calibration). What exists now is collected once and frozen, so
        # each later collection scans only what the steps made; leaving unfreezes it (unless the
        # caller had frozen the heap itself: then it stays as the caller left it).
        self._froze_heap = gc.get_freeze_count() == 0
        if self._froze_heap:
            gc.collect()
            gc.freeze()
        self._rng = _rng_state()
        self._modes = {m: m.training for m in module.modules()}
        self._buffers = {n: b.detach().clone() for n, b in module.named_buffers()}
        # self.log is forbidden in on_fit_start, and measurement must not leave logged values.
        module.log = module.log_dict = lambda *args, **kwargs: None
        module.train()
        return self

    def __exit__(self, *exc) -> None:
        module = self.pl_module
        del module.log, module.log_dict
        for m, training in self._modes.items():
            m.training = training
        with torch.no_grad():
            for name, buffer in module.named_buffers():
                buffer.copy_(self._buffers[name])
        self.zero_grad()
        _set_rng_state(self._rng)
        if self._froze_heap:
            gc.unfreeze()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    # ---- collectives ------------------------------------------------------------------------
    @property
    def is_global_zero(self) -> bool:
        return self.trainer.is_global_zero

    def broadcast(self, obj):
        """Rank 0's `obj` on every rank (what rank 0 alone fitted, or read from a cache)."""
        return self.strategy.broadcast(obj)

    def agree(self, flag: bool) -> bool:
        return agree(self.strategy, flag)

    def max_over_ranks(self, *values: float) -> list[float]:
        """Each value's maximum over ranks (one all-reduce): a step is as slow as its slowest rank,
        memory as high as the fullest."""
        stats = torch.tensor(values, dtype=torch.float64, device=self.device)
        return self.strategy.reduce(stats, reduce_op="max").tolist()

    # ---- steps ------------------------------------------------------------------------------
    def zero_grad(self) -> None:
        for optimizer in self.trainer.optimizers:
            optimizer.zero_grad(set_to_none=True)
        for param in self.pl_module.parameters():
            param.grad = None

    def hold_gradients(self) -> None:
        """Give every trainable parameter without a gradient a zero one: what a training step's forward
        holds from the step before (the first step of a measurement has no step before)."""
        for param in self.pl_module.parameters():
            if param.requires_grad and param.grad is None:
                param.grad = torch.zeros_like(param)

    @property
    def accumulating(self) -> bool:
        """Whether training accumulates gradients over micro-batches (accumulate_grad_batches > 1)."""
        return int(getattr(self.trainer, "accumulate_grad_batches", 1)) > 1

    def _agreed_oom(self, oom: bool) -> None:
        """Raise AgreedOutOfMemory on every rank if any rank ran out of memory (one all-reduce; none on
        a single rank, whose own error is the agreement)."""
        if (self.agree(oom) if self.trainer.world_size > 1 else oom):
            raise AgreedOutOfMemory

    def training_step(self, batch):
        """The user's training_step of a batch already on the device, through the strategy (its
        wrapper and the precision's autocast), with batch_idx only if the hook declares it."""
        return self.strategy.training_step(batch, 0) if self._with_idx else self.strategy.training_step(batch)

    def step(self, batch) -> float:
        """ms of one training step as Lightning's automatic optimization runs it, without the optimizer
        step, synchronized: the forward (`training_step`) with the previous step's gradients still
        held, then, without gradient accumulation, the gradients set to None (Lightning's zero_grad
        runs after training_step, before backward), then backward (into the held gradients when
        accumulating: a micro-batch after the first). The gradients stay held after it, for the next
        step. Every rank agrees after the forward and after the backward whether any ran out of
        memory (AgreedOutOfMemory on all of them), so no rank goes on into a collective alone.

        On CPU the time is the process's CPU time (`time.process_time`), not the wall clock: with the
        one intra-op thread calibration measures with (loop.measurement_threads) it is the step's own
        work, while the wall clock adds whatever other processes take of the cores (on a busy 2-core
        machine, runs of steps about 2x slower: benchmarks/results/cpu_robustness_median.json)."""
        strategy, cuda = self.strategy, self.device.type == "cuda"
        clock = time.perf_counter if cuda else time.process_time
        if cuda:
            torch.cuda.synchronize(self.device)
        begin = clock()
        output = loss = None
        oom = False
        try:
            output = self.training_step(batch)
            loss = output["loss"] if isinstance(output, dict) else output
        except torch.OutOfMemoryError:
            oom = True
        self._agreed_oom(oom)
        if not self.accumulating:
            self.zero_grad()
        try:
            # pre/post_backward of the strategy (DDP's reducer bookkeeping) without the precision
            # plugin's, which would run the user's on_before/after_backward callback hooks.
            strategy.pre_backward(loss)
            loss.backward()
            strategy.post_backward(loss)
        except torch.OutOfMemoryError:
            oom = True
        del output, loss
        self._agreed_oom(oom)
        if cuda:
            torch.cuda.synchronize(self.device)
        self._stepped = True
        return (clock() - begin) * 1e3

    def settle(self, batch, max_steps: int = 10, tolerance: float = 0.25) -> int:
        """Untimed steps until two consecutive step times agree within `tolerance` on every rank (at
        most `max_steps`); returns the steps taken. Lazy initialisation (allocator pools, kernel
        selection, a first-use kernel build, page faults after the shards were written) can
        stretch the first steps by 100x and would otherwise land in the timings, and in the cache."""
        previous = None
        for taken in range(1, max_steps + 1):
            elapsed = self.step(batch)
            settled = previous is not None and abs(elapsed - previous) <= tolerance * previous
            if not self.agree(not settled):  # every rank stops at the same step
                return taken
            previous = elapsed
        return max_steps

    def measure(self, batch_fn, warmup: int, repeats: int, settle: bool = False, empty_cache: bool = False) -> dict:
        """Median time (ms) of `repeats` steps after `warmup` untimed ones (after `settle` first,
        if asked), the first step's time (first_ms: with the shape's kernel builds when it is new),
        and peak memory over all of them (bytes: peak_bytes CUDA max_memory_allocated,
        reserved_bytes max_memory_reserved, what the allocator held from the device; on CPU both the
        bytes autograd saves for backward), on the batch `batch_fn()` builds; each the maximum over
        ranks. Every step holds what a training step holds (`step`): the gradients are there from
        the first forward on (`hold_gradients`), so a single step's peak has them too. empty_cache:
        return the allocator's cached blocks to the device first, so the reserved peak is this
        batch's own and not what earlier, larger batches left cached. Before the runner's first
        measurement one step of its batch runs uncounted: a process's first step holds one-time
        allocations no later step holds (library workspaces, the allocator's first segments; on an H100
        the first grid point held 21.6 GiB reserved for 11.1 GiB allocated, the next ones 0.3-0.4 GiB
        over, and a cached run's first recheck 4.3 GiB more than the same shape in the first run:
        benchmarks/results/gpu_session9), which would count as the shape's own: fitted with that point,
        the H100's memory model had 3.8% held-out error, 1.4% with the point as a later step holds it
        (benchmarks/results/first_step_memory.json).
        {"status": "oom"} on every rank if any rank ran out of memory (freed before returning)."""
        device, cuda = self.device, self.device.type == "cuda"
        out_of_memory = False
        times, saved_bytes = [], []
        try:
            try:
                batch = self.strategy.batch_to_device(batch_fn())
                self.hold_gradients()
                failed = False
            except torch.OutOfMemoryError:
                failed = True
            self._agreed_oom(failed)
            if not self._stepped:
                self.first_step_ms = self.max_over_ranks(self.step(batch))[0]
            if settle:
                self.settle(batch)
            if cuda:
                torch.cuda.synchronize(device)
                if empty_cache:
                    gc.collect()
                    torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats(device)
            for i in range(warmup + repeats):
                saved = _SavedTensorBytes()
                counting = (torch.autograd.graph.saved_tensors_hooks(saved.pack, lambda t: t)
                            if not cuda else contextlib.nullcontext())
                with counting:
                    times.append(self.step(batch))
                saved_bytes.append(saved.total)
            if cuda:
                peak, reserved = torch.cuda.max_memory_allocated(device), torch.cuda.max_memory_reserved(device)
            else:
                peak = reserved = max(saved_bytes)
            del batch
        except AgreedOutOfMemory:
            out_of_memory = True
        if out_of_memory:  # outside the except block, so the traceback no longer pins activations
            self.zero_grad()
            gc.collect()
            if cuda:
                torch.cuda.empty_cache()
            return {"status": "oom"}
        time_ms, first_ms, peak_bytes, reserved_bytes = self.max_over_ranks(
            float(np.median(times[warmup:])), times[0], float(peak), float(reserved))
        return {"status": "ok", "time_ms": time_ms, "first_ms": first_ms, "peak_bytes": int(peak_bytes),
                "reserved_bytes": int(reserved_bytes)}

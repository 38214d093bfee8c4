"""Per-rank busy time of one training step from a short `torch.profiler` window.

Under DDP and FSDP a fast rank waits for the slowest one inside the gradient and parameter
collectives, so every rank's wall-clock step time is about the slowest rank's and their CV reads
~0 whatever the imbalance. What a rank actually computed is its time in ops/kernels outside
communication: that is busy time. Communication time (transfers plus the waits that happen inside
communication ops or kernels) is reported next to it.

- CUDA: busy_ms = summed duration of the step's device kernels (and memcpy/memset) that are not
  communication; comm_ms = summed duration of communication kernels (NCCL). Host-only work and
  kernels that overlap on different streams are counted as the kernels ran (two overlapping
  kernels count twice).
- CPU: busy_ms = summed self time (time not spent in nested ops) of the profiled CPU ops that are
  not communication; comm_ms = self time of communication ops (`c10d::allreduce_` and the like).
  With gloo the transfer itself runs on gloo's threads and a rank waits for a peer mostly outside
  any op, so comm_ms then holds only the calls into the collectives, and the wait is in neither.

User annotations (`record_function` ranges such as "DistributedDataParallel.forward",
"Optimizer.step#...") are not ops: their own time is Python between ops and is left out.
An op or kernel is communication when its lower-cased name contains one of COMM_PATTERNS.
"""
from __future__ import annotations

from collections.abc import Iterable

import torch
from torch.autograd import DeviceType

COMM_PATTERNS = ("nccl", "gloo", "c10d", "all_gather", "allgather", "reduce_scatter", "reducescatter",
                 "all_reduce", "allreduce", "broadcast", "all_to_all", "alltoall")


def is_communication(name: str) -> bool:
    """Whether an op or kernel name is a collective (COMM_PATTERNS, case-insensitive)."""
    lowered = name.lower()
    return any(pattern in lowered for pattern in COMM_PATTERNS)


def busy_and_comm_ms(op_times: Iterable[tuple[str, float]]) -> tuple[float, float]:
    """(busy_ms, comm_ms) from (name, microseconds) of the window's ops or kernels (op_times):
    communication is every name is_communication accepts, busy the rest."""
    busy_us = comm_us = 0.0
    for name, us in op_times:
        if is_communication(name):
            comm_us += us
        else:
            busy_us += us
    return busy_us / 1e3, comm_us / 1e3


def kineto_op_times(events: Iterable, device: str) -> list[tuple[str, float]]:
    """(name, microseconds) of what a step ran, from the profiler's raw kineto events
    (`profile.profiler.kineto_results.events()`; building torch's FunctionEvent tree from them
    costs ~50 us per event, this ~2): on "cuda" every device kernel, memcpy and memset (not
    annotations) with its duration; otherwise every host op (not user annotations) with its self
    time, its duration minus that of the events directly nested in it on the same thread."""
    if device == "cuda":
        return [(e.name(), e.duration_ns() / 1e3) for e in events
                if e.device_type() == DeviceType.CUDA and not e.is_user_annotation()]
    # (thread, start, -end) sorts a parent before the children it encloses.
    host = sorted((e.start_thread_id(), e.start_ns(), -e.end_ns(), e.name(), e.is_user_annotation())
                  for e in events if e.device_type() == DeviceType.CPU and not e.is_async())
    nested_ns = [0] * len(host)
    open_events: list[tuple[int, int]] = []  # (end_ns, index) of the enclosing events, innermost last
    thread = None
    for i, (tid, start, neg_end, _, _) in enumerate(host):
        if tid != thread:
            thread, open_events = tid, []
        while open_events and open_events[-1][0] <= start:
            open_events.pop()
        if open_events:
            nested_ns[open_events[-1][1]] += -neg_end - start
        open_events.append((-neg_end, i))
    return [(name, (-neg_end - start - nested) / 1e3)
            for (_, start, neg_end, name, annotation), nested in zip(host, nested_ns) if not annotation]


def function_event_op_times(events: Iterable, device: str) -> list[tuple[str, float]]:
    """kineto_op_times from torch's public FunctionEvents (`profile.events()`), for a torch
    release without `kineto_results`: slower, the same numbers."""
    if device == "cuda":
        return [(e.name, e.self_device_time_total) for e in events
                if e.device_type == DeviceType.CUDA and not getattr(e, "is_user_annotation", False)]
    return [(e.name, e.self_cpu_time_total) for e in events
            if e.device_type == DeviceType.CPU and not getattr(e, "is_user_annotation", False)]


class StepProfiler:
    """A torch.profiler window over one step: `start()` before it, `stop()` after it returns
    (busy_ms, comm_ms). `device`: "cuda" records device kernels (CUPTI) and host ops, anything else
    host ops only. The caller synchronizes the device before `stop()` so the step's kernels are in."""

    def __init__(self, device: str):
        self.device = "cuda" if device == "cuda" else "cpu"
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.device == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self._activities = activities
        self._profile: torch.profiler.profile | None = None

    @property
    def active(self) -> bool:
        return self._profile is not None

    def start(self) -> None:
        """Open the window. Raises RuntimeError if another profiler is already running in this
        process (torch allows one at a time)."""
        profile = torch.profiler.profile(activities=self._activities, record_shapes=False, with_stack=False)
        profile.__enter__()
        self._profile = profile

    def warm_up(self) -> None:
        """Open and close an empty window: the first window of a process initialises the profiler
        backend, far slower than later windows, and that must not land in a timed training step."""
        self.start()
        self.stop()

    def stop(self) -> tuple[float, float]:
        """Close the window and return (busy_ms, comm_ms) of what ran inside it."""
        profile, self._profile = self._profile, None
        if profile is None:
            raise RuntimeError("StepProfiler.stop() without start()")
        profile.__exit__(None, None, None)
        results = getattr(profile.profiler, "kineto_results", None)
        if results is not None:
            return busy_and_comm_ms(kineto_op_times(results.events(), self.device))
        return busy_and_comm_ms(function_event_op_times(profile.events(), self.device))

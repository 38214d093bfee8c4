"""Process settings that must be made before torch (or CUDA) starts, made once by the `adaptiveload`
command and offered to users' own scripts as `la.prepare_environment()`.

- PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True, unless the user set an allocator configuration.
  A run of many bucket shapes allocates and frees activation buffers of many sizes; the caching
  allocator keeps fixed-size segments, and on an H200 the shipped config died with 6.5-13.7 GiB
  reserved but unallocated (fragmentation) at its out-of-memory step. Expandable segments grow and
  shrink one mapping per stream instead, so freed memory is reused across sizes (diffusion-pipe's
  README reports the same for many buckets). The allocator reads the variable at its first CUDA
  allocation: set it before any tensor reaches a GPU. Verification measures reserved memory either
  way, so a plan never rests on this setting.
- KINETO_LOG_LEVEL=6 on a machine without an NVIDIA device node, unless set: the profiler library
  of a CUDA build of torch logs "ERROR ... gpuGetDeviceCount failed with code 35" and its start/stop
  trace lines when LoadBalanceMonitor opens a CPU profiler window there, which reads as a failure.
  Read when torch is imported.
"""
from __future__ import annotations

import glob
import os

ALLOCATOR_VARIABLES = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")  # the second: torch >= 2.9's name
EXPANDABLE_SEGMENTS = "expandable_segments:True"


def prepare_environment(environ: dict | None = None) -> dict[str, str]:
    """Set the variables above in `environ` (default os.environ) where the user has not; returns
    what was set. Call before importing torch in a script of your own (the `adaptiveload` command
    does it for you)."""
    environ = os.environ if environ is None else environ
    made = {}
    if not any(environ.get(name) for name in ALLOCATOR_VARIABLES):
        made["PYTORCH_CUDA_ALLOC_CONF"] = EXPANDABLE_SEGMENTS
    if "KINETO_LOG_LEVEL" not in environ and not glob.glob("/dev/nvidia[0-9]*"):
        made["KINETO_LOG_LEVEL"] = "6"
    environ.update(made)
    return made


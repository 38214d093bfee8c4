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

`quiet_console()` (also made by the `adaptiveload` command, for every subcommand) tidies what a
run prints, in the process it is called in:

- This package's warnings print as their message alone. Python shows a warning as
  `path:line: Category: message` and its source line; Lightning's replacement of
  `warnings.formatwarning` prints `path:line: message` for any file whose path contains
  "lightning", ours included (`lightning_adaptiveload/calibration/loop.py:110: CostModelCalibration:
  ...`). Our messages say what happened and what to do; a path into our code reads as a crash.
  Warnings of other packages keep Python's (or Lightning's) format.
- Notices of other libraries that are advice a user of this command cannot act on (NOTICES) are
  dropped: Lightning's "Tip:" lines advertising its cloud services (litlogger, litmodels), printed
  by every fit, and diffusers' "`accelerate` was not found" notice, printed by every
  `from_pretrained` without `accelerate` (the VAE of `adaptiveload encode`), which only says that
  loading takes the ordinary path.
"""
from __future__ import annotations

import glob
import logging
import os
import sys
import warnings
from pathlib import Path

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



PACKAGE_DIR = Path(__file__).resolve().parent
# (loggers, the start of the message): what quiet_console drops. The loggers are the ones the
# library logs these through (lightning_utilities' rank_zero_info logs to the rank_zero logger of
# whichever of lightning.pytorch and lightning.fabric was imported last); a logger filter sees only
# records logged on that logger itself, so each is named.
NOTICES = (
    (("lightning.pytorch.utilities.rank_zero", "lightning.fabric.utilities.rank_zero"), "💡 Tip:"),
    (("diffusers.models.modeling_utils", "diffusers.pipelines.pipeline_utils"),
     "Cannot initialize model with low cpu memory usage because `accelerate` was not found"),
)


class _DropNotice(logging.Filter):
    """Drops the records whose message starts with `prefix`."""

    def __init__(self, prefix: str):
        super().__init__()
        self.prefix = prefix

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(self.prefix)


def _show_package_warnings_without_source(show):
    """warnings.showwarning that writes a warning raised from this package's files as its message
    alone and hands every other warning to `show` (the function it replaces)."""

    def showwarning(message, category, filename, lineno, file=None, line=None):
        if PACKAGE_DIR not in Path(filename).resolve().parents:
            return show(message, category, filename, lineno, file, line)
        try:
            (sys.stderr if file is None else file).write(f"{message}\n")
        except OSError:  # as warnings.showwarning: a closed or broken stream loses the warning
            pass

    showwarning.adaptiveload_quiet = True
    return showwarning


def quiet_console() -> None:
    """Show this package's warnings without a source path and drop the library notices of NOTICES
    (module docstring); for the rest of the process. Calling it again changes nothing."""
    if not getattr(warnings.showwarning, "adaptiveload_quiet", False):
        warnings.showwarning = _show_package_warnings_without_source(warnings.showwarning)
    for names, prefix in NOTICES:
        for name in names:
            logger = logging.getLogger(name)
            if not any(isinstance(f, _DropNotice) and f.prefix == prefix for f in logger.filters):
                logger.addFilter(_DropNotice(prefix))

"""Find the compiled AdaLN kernels: prebuilt extension, else a cached JIT build, else none.

Nothing is compiled at import time. The decision is made once per process, by `ensure_extension()`
(callbacks call it in setup, so a JIT build never lands inside timed work) or else by the first
CUDA call. Set ADAPTIVELOAD_NO_JIT=1 to never JIT-build (the reference path runs instead). When a
GPU is visible but no kernels are found, that decision is also a RuntimeWarning: the reference
path is correct but much slower and keeps more memory, which should not go unnoticed.
How to compile (sources, flags, archs, include dirs) is ops/_build.py's business.
"""
from __future__ import annotations

import importlib
import os
import sys
import time
import warnings
from pathlib import Path
from types import ModuleType
from typing import Callable

import torch

from lightning_adaptiveload.ops._build import FLAGS_FILE, build_spec, find_csrc, why_no_cuda_build

PACKAGE_DIR = Path(__file__).resolve().parents[1]
# Installed packages carry the sources as lightning_adaptiveload/csrc (setup.py); a source checkout
# or editable install has them at the repository root.
CSRC_DIR = find_csrc(PACKAGE_DIR)
JIT_NAME = "adaptiveload_C_jit"  # module name in torch's extension cache
JIT_CACHE_HIT_S = 10.0  # a JIT "build" faster than this only loaded the cached module (a compile takes ~1 min)

_state: dict = {}


def jit_build(
    csrc_dir: Path = CSRC_DIR, name: str = JIT_NAME, build_directory: Path | None = None, verbose: bool = False
) -> ModuleType:
    """Compile the kernels in csrc_dir by torch.utils.cpp_extension.load and return the loaded module.

    Cached under `name` in torch's extension cache ($TORCH_EXTENSIONS_DIR, default
    ~/.cache/torch_extensions) or in `build_directory`, and rebuilt only when sources or flags
    change. Needs nvcc, not a GPU.
    """
    from torch.utils.cpp_extension import load

    spec = build_spec(csrc_dir)
    if build_directory is not None:
        Path(build_directory).mkdir(parents=True, exist_ok=True)
    return load(
        name=name,
        sources=spec.sources,
        extra_include_paths=spec.include_dirs,
        extra_cflags=spec.cxx_flags,
        extra_cuda_cflags=spec.nvcc_flags,
        build_directory=None if build_directory is None else str(build_directory),
        verbose=verbose,
    )


def jit_blocker() -> str | None:
    """Why a JIT build cannot run here (None when it can): a CPU torch, no nvcc, or no csrc/."""
    from torch.utils.cpp_extension import CUDA_HOME

    why = why_no_cuda_build(torch.version.cuda, CUDA_HOME)
    if why is None and not (CSRC_DIR / FLAGS_FILE).is_file():
        why = f"the CUDA sources are not installed (looked in {CSRC_DIR})"
    return why


def prebuilt_extension() -> tuple[ModuleType | None, str]:
    """(lightning_adaptiveload._C, its path) if it imports, else (None, the import error)."""
    try:  # import_module, not `from ... import _C`: it consults sys.modules, as tests rely on
        module = importlib.import_module("lightning_adaptiveload._C")
    except ImportError as error:
        return None, str(error)
    return module, str(getattr(module, "__file__", "lightning_adaptiveload._C"))


def _find(progress: Callable[[str], None] | None) -> tuple[ModuleType | None, str]:
    if not torch.cuda.is_available():
        return None, "reference: no CUDA device visible to torch"
    module, where = prebuilt_extension()
    if module is not None:
        return module, "cuda: prebuilt extension lightning_adaptiveload._C"
    missing = f"prebuilt extension missing ({where})"
    if os.environ.get("ADAPTIVELOAD_NO_JIT"):
        return None, f"reference: {missing}; ADAPTIVELOAD_NO_JIT is set"
    blocker = jit_blocker()
    if blocker is not None:
        return None, f"reference: {missing} and no JIT build possible: {blocker}"
    if progress:  # torch decides whether its cached build is current only inside the build call
        progress(f"JIT-building the AdaLN CUDA extension from {CSRC_DIR}, or loading it from torch's extension "
                 "cache if it is current (compiling takes minutes; `adaptiveload build-ext` does it ahead of time) ...")
    start = time.perf_counter()
    try:
        module = jit_build()
    except Exception as error:  # a failed build must not take training down
        return None, f"reference: JIT build failed: {error}"
    if progress:
        seconds = time.perf_counter() - start
        done = "compiled" if seconds > JIT_CACHE_HIT_S else "loaded from the cache"
        progress(f"AdaLN CUDA extension {done} in {seconds:.1f} s: {module.__file__}")
    return module, f"cuda: JIT-built from {CSRC_DIR} (cached by torch.utils.cpp_extension)"


def _decide(progress: Callable[[str], None] | None) -> tuple[ModuleType | None, str]:
    if "result" not in _state:
        result = _find(progress)
        if result[0] is None and torch.cuda.is_available():
            warnings.warn(f"lightning_adaptiveload.ops: CUDA tensors run the AdaLN {result[1]}", RuntimeWarning, stacklevel=3)
        _state["result"] = result
    return _state["result"]


def load_extension() -> tuple[ModuleType | None, str]:
    """(module or None, why). Cached: the search (and a JIT build, if needed) runs once per process."""
    return _decide(progress=None)


def ensure_extension(verbose: bool = True) -> str:
    """Load or build the AdaLN kernels now, before any timed work, and return `backend()`.

    Call it where a pause is expected (Lightning `setup`, the start of a script): without it
    the first CUDA call of the op would JIT-build the extension (minutes on a fresh machine)
    inside whatever it is part of. With verbose, prints to stderr that it JIT-builds (or loads
    from torch's cache), whether it compiled and how long it took, and the backend. Cheap after
    the first call. CPU-only: returns the reference backend.
    """
    def progress(message: str) -> None:
        print(f"lightning_adaptiveload.ops: {message}", file=sys.stderr, flush=True)

    _module, why = _decide(progress if verbose else None)
    if verbose:
        progress(f"AdaLN backend: {why}")
    return why

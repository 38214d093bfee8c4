"""Find the compiled AdaLN kernels: prebuilt extension, else a cached JIT build, else none.

Nothing is compiled at import time; the first CUDA call (or ops.backend()) decides once per
process. Set ADAPTIVELOAD_NO_JIT=1 to never JIT-build (the reference path runs instead). When a
GPU is visible but no kernels are found, that decision is also a RuntimeWarning: the reference
path is correct but much slower and keeps more memory, which should not go unnoticed.
"""
from __future__ import annotations

import json
import os
import warnings
from pathlib import Path
from types import ModuleType

import torch

_PACKAGE = Path(__file__).resolve().parents[1]
# Installed wheels carry the sources as lightning_adaptiveload/csrc (setup.py); a source checkout or
# editable install has them at the repository root.
CSRC_DIR = next((d for d in (_PACKAGE / "csrc", _PACKAGE.parent / "csrc") if (d / "build_flags.json").is_file()),
                _PACKAGE.parent / "csrc")
BUILD_FLAGS_FILE = CSRC_DIR / "build_flags.json"  # shared with setup.py

_state: dict = {}


def cuda_include_dirs() -> list[str]:
    """Extra include dirs: pip CUDA-13 wheels ship headers (cccl, cuda_runtime) under nvidia/cu13/include."""
    import site

    roots = list(site.getsitepackages()) + [site.getusersitepackages()]
    return [str(Path(r) / "nvidia" / "cu13" / "include") for r in roots if (Path(r) / "nvidia" / "cu13" / "include").is_dir()]


def jit_build(csrc_dir: Path = CSRC_DIR, name: str = "adaptiveload_C_jit") -> ModuleType:
    """Compile the kernels in csrc_dir (with its build_flags.json) by torch.utils.cpp_extension.load,
    cached under `name` and rebuilt when sources or flags change; returns the loaded module."""
    from torch.utils.cpp_extension import load

    flags = json.loads((csrc_dir / "build_flags.json").read_text())
    archs = os.environ.get("ADAPTIVELOAD_CUDA_ARCHS", ";".join(flags["cuda_archs"])).split(";")
    gencode = [f"-gencode=arch=compute_{a},code=sm_{a}" for a in archs]
    gencode.append(f"-gencode=arch=compute_{archs[-1]},code=compute_{archs[-1]}")  # PTX for newer GPUs
    return load(
        name=name,
        sources=[str(csrc_dir / s) for s in flags["sources"]],
        extra_include_paths=[str(csrc_dir)] + cuda_include_dirs(),
        extra_cflags=flags["cxx"],
        extra_cuda_cflags=flags["nvcc"] + gencode,
        verbose=False,
    )


def load_extension() -> tuple[ModuleType | None, str]:
    """(module or None, why). Cached: the search runs once per process."""
    if "result" in _state:
        return _state["result"]
    result: tuple[ModuleType | None, str]
    if not torch.cuda.is_available():
        result = (None, "reference: no CUDA device visible to torch")
    else:
        try:
            from lightning_adaptiveload import _C  # type: ignore[attr-defined]

            result = (_C, "cuda: prebuilt extension lightning_adaptiveload._C")
        except ImportError as prebuilt_error:
            from torch.utils.cpp_extension import CUDA_HOME

            if os.environ.get("ADAPTIVELOAD_NO_JIT"):
                result = (None, f"reference: prebuilt extension missing ({prebuilt_error}); ADAPTIVELOAD_NO_JIT is set")
            elif CUDA_HOME is None or not BUILD_FLAGS_FILE.is_file():
                result = (None, f"reference: prebuilt extension missing ({prebuilt_error}) and no nvcc/csrc for a JIT build")
            else:
                try:
                    result = (jit_build(), f"cuda: JIT-built from {CSRC_DIR} (cached by torch.utils.cpp_extension)")
                except Exception as jit_error:  # a failed build must not take training down
                    result = (None, f"reference: JIT build failed: {jit_error}")
            if result[0] is None:
                warnings.warn(f"lightning_adaptiveload.ops: CUDA tensors run the AdaLN {result[1]}", RuntimeWarning, stacklevel=2)
    _state["result"] = result
    return result

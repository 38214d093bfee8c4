"""How to compile the AdaLN CUDA extension: the one place for sources, flags, archs and include dirs.

Used by `setup.py` (the prebuilt `lightning_adaptiveload._C`), by `ops/extension.py` (the JIT build
on first use or by `adaptiveload build-ext`) and by `benchmarks/kernel/adaln_variants.py` (through the
JIT build). Standard library only: setup.py loads this file by path, so an install does not
import the package (nor torch a second time).

The declarative part lives next to the sources, in `csrc/build_flags.json` (sources, cxx and
nvcc flags, default archs), so a copied csrc/ directory (a kernel variant) carries its own
flags; everything computed from it is here.

Environment:
    ADAPTIVELOAD_CUDA_ARCHS   "90" or "80;90": SASS for each, PTX of the last (for newer GPUs).
"""
from __future__ import annotations

import json
import os
import re
import site
from pathlib import Path
from typing import Mapping, NamedTuple

FLAGS_FILE = "build_flags.json"
ARCHS_ENV = "ADAPTIVELOAD_CUDA_ARCHS"
_ARCH = re.compile(r"^[0-9]{2,3}[af]?$")  # "90", "100", "90a"


class BuildSpec(NamedTuple):
    """Absolute source paths, include dirs and compiler flags of one build of the extension."""

    sources: list[str]
    include_dirs: list[str]
    cxx_flags: list[str]
    nvcc_flags: list[str]
    archs: list[str]


def find_csrc(package_dir: Path) -> Path:
    """The csrc/ directory for a package at `package_dir`: inside an installed package
    (setup.py ships it as lightning_adaptiveload/csrc), else at the root of a source checkout."""
    candidates = (package_dir / "csrc", package_dir.parent / "csrc")
    return next((d for d in candidates if (d / FLAGS_FILE).is_file()), candidates[1])


def cuda_archs(default: list[str], env: Mapping[str, str] = os.environ) -> list[str]:
    """Compute capabilities to compile for: $ADAPTIVELOAD_CUDA_ARCHS (semicolon list) or `default`."""
    raw = env.get(ARCHS_ENV, "").strip()
    archs = [a.strip() for a in raw.split(";") if a.strip()] if raw else list(default)
    bad = [a for a in archs if not _ARCH.match(a)]
    if bad or not archs:
        raise ValueError(f"{ARCHS_ENV}={raw!r}: expected compute capabilities like '90' or '80;90', got {bad or 'none'}")
    return archs


def gencode_flags(archs: list[str]) -> list[str]:
    """nvcc -gencode flags: SASS for every arch, plus PTX of the last so newer GPUs can JIT it."""
    flags = [f"-gencode=arch=compute_{a},code=sm_{a}" for a in archs]
    return flags + [f"-gencode=arch=compute_{archs[-1]},code=compute_{archs[-1]}"]


def wheel_include_dirs() -> list[str]:
    """Toolkit headers (cccl, cuda_runtime) of pip's CUDA-13 wheels, under site-packages/nvidia/cu13/include.

    A CUDA torch from pip ships them there rather than in CUDA_HOME; nvcc needs them when the
    local toolkit is older or incomplete. Only directories that exist are returned.
    """
    roots = list(site.getsitepackages()) + [site.getusersitepackages()]
    dirs = [Path(r) / "nvidia" / "cu13" / "include" for r in roots]
    return list(dict.fromkeys(str(d) for d in dirs if d.is_dir()))


def build_spec(csrc_dir: Path, env: Mapping[str, str] = os.environ) -> BuildSpec:
    """Everything a build of the extension from `csrc_dir` needs (its build_flags.json, archs from env)."""
    flags_path = csrc_dir / FLAGS_FILE
    try:
        flags = json.loads(flags_path.read_text())
    except (OSError, ValueError) as error:
        raise ValueError(f"{flags_path}: cannot read the extension's build flags: {error}") from error
    missing = [k for k in ("sources", "cxx", "nvcc", "cuda_archs") if k not in flags]
    if missing:
        raise ValueError(f"{flags_path}: missing keys {missing}")
    archs = cuda_archs(flags["cuda_archs"], env)
    return BuildSpec(
        sources=[str(csrc_dir / s) for s in flags["sources"]],
        include_dirs=[str(csrc_dir)] + wheel_include_dirs(),
        cxx_flags=list(flags["cxx"]),
        nvcc_flags=list(flags["nvcc"]) + gencode_flags(archs),
        archs=archs,
    )


def why_no_cuda_build(torch_cuda_version: str | None, cuda_home: str | None) -> str | None:
    """Why the extension cannot be compiled here (None when it can): a CPU torch, or no nvcc."""
    if torch_cuda_version is None:
        return "torch is not a CUDA build (torch.version.cuda is None)"
    if cuda_home is None or not any((Path(cuda_home) / "bin" / n).is_file() for n in ("nvcc", "nvcc.exe")):
        return ("no CUDA toolkit found (set CUDA_HOME to the directory holding bin/nvcc, "
                f"matching torch's CUDA {torch_cuda_version})")
    return None


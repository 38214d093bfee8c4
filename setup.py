import json
import os
import site
from pathlib import Path

from setuptools import find_packages, setup

ROOT = Path(__file__).resolve().parent


def cuda_extension_kwargs() -> dict:
    """ext_modules/cmdclass for lightning_adaptiveload._C, or {} (pure-Python install).

    Built only when torch is a CUDA build, nvcc is found (CUDA_HOME) and
    ADAPTIVELOAD_NO_CUDA_BUILD is unset. Flags and archs come from csrc/build_flags.json;
    ADAPTIVELOAD_CUDA_ARCHS="90" (semicolon list) narrows the archs.
    """
    if os.environ.get("ADAPTIVELOAD_NO_CUDA_BUILD"):
        print("lightning-adaptiveload: ADAPTIVELOAD_NO_CUDA_BUILD is set, installing pure Python")
        return {}
    try:
        import torch
        from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CUDAExtension
    except ImportError:
        print("lightning-adaptiveload: torch not importable at build time, installing pure Python")
        return {}
    if torch.version.cuda is None or CUDA_HOME is None:
        print(f"lightning-adaptiveload: no CUDA build (torch.version.cuda={torch.version.cuda}, "
              f"CUDA_HOME={CUDA_HOME}), installing pure Python; the reference AdaLN path will run")
        return {}
    flags = json.loads((ROOT / "csrc" / "build_flags.json").read_text())
    archs = os.environ.get("ADAPTIVELOAD_CUDA_ARCHS", ";".join(flags["cuda_archs"])).split(";")
    gencode = [f"-gencode=arch=compute_{a},code=sm_{a}" for a in archs]
    gencode.append(f"-gencode=arch=compute_{archs[-1]},code=compute_{archs[-1]}")  # PTX for newer GPUs
    # pip's CUDA-13 wheels keep the toolkit headers (cccl, cuda_runtime) under nvidia/cu13/include.
    wheel_includes = [str(Path(p) / "nvidia" / "cu13" / "include") for p in site.getsitepackages()]
    extension = CUDAExtension(
        name="lightning_adaptiveload._C",
        sources=[f"csrc/{s}" for s in flags["sources"]],
        include_dirs=[str(ROOT / "csrc")] + [p for p in wheel_includes if Path(p).is_dir()],
        extra_compile_args={"cxx": flags["cxx"], "nvcc": flags["nvcc"] + gencode},
    )
    return {"ext_modules": [extension], "cmdclass": {"build_ext": BuildExtension}}


setup(
    name="lightning-adaptiveload",
    version="0.1.0",
    description="Load-balanced bucketing and a fused AdaLN CUDA kernel for video DiT training with PyTorch Lightning",
    python_requires=">=3.10",
    # csrc/ also ships inside the package, so an install without a prebuilt _C can JIT-build it.
    packages=find_packages(include=["lightning_adaptiveload", "lightning_adaptiveload.*"]) + ["lightning_adaptiveload.csrc"],
    package_dir={"lightning_adaptiveload.csrc": "csrc"},
    package_data={"lightning_adaptiveload": ["data/*.jsonl", "data/*.json"],
                  "lightning_adaptiveload.csrc": ["*.h", "*.cuh", "*.cu", "*.cpp", "*.json"]},
    install_requires=[
        "lightning>=2.4",
        "torch>=2.4",
        "webdataset>=0.2.86",
        "scipy>=1.10",
        "numpy>=1.24",
        "jsonargparse[signatures]>=4.27",
        "matplotlib>=3.7",
    ],
    extras_require={
        "dev": ["pytest>=7"],
        "diffusers": ["diffusers>=0.32"],
    },
    entry_points={"console_scripts": ["adaptiveload=lightning_adaptiveload.cli:main"]},
    **cuda_extension_kwargs(),
)

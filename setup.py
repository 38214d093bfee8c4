import importlib.util
import os
from pathlib import Path

from setuptools import find_packages, setup

ROOT = Path(__file__).resolve().parent


def load_build_module():
    """lightning_adaptiveload/ops/_build.py (stdlib only), loaded by path: the package itself is
    not importable before it is installed, and importing it would import torch a second time."""
    spec = importlib.util.spec_from_file_location("_adaptiveload_build", ROOT / "lightning_adaptiveload" / "ops" / "_build.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def cuda_extension_kwargs() -> dict:
    """ext_modules/cmdclass for lightning_adaptiveload._C, or {} (pure-Python install).

    Built only when torch is importable and a CUDA build, nvcc is found (CUDA_HOME) and
    ADAPTIVELOAD_NO_CUDA_BUILD is unset. pip's default build isolation hides the installed torch:
    install with `pip install --no-build-isolation .` (docs/kernel.md). Sources, flags, archs
    (ADAPTIVELOAD_CUDA_ARCHS) and include dirs come from lightning_adaptiveload/ops/_build.py,
    shared with the JIT build.
    """
    if os.environ.get("ADAPTIVELOAD_NO_CUDA_BUILD"):
        print("lightning-adaptiveload: ADAPTIVELOAD_NO_CUDA_BUILD is set, installing pure Python")
        return {}
    try:
        import torch
        from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CUDAExtension
    except ImportError:
        print("lightning-adaptiveload: torch not importable at build time (pip build isolation? use "
              "--no-build-isolation), installing pure Python")
        return {}
    build = load_build_module()
    why_not = build.why_no_cuda_build(torch.version.cuda, CUDA_HOME)
    if why_not:
        print(f"lightning-adaptiveload: {why_not}; installing pure Python, the reference AdaLN path will run")
        return {}
    spec = build.build_spec(ROOT / "csrc")
    extension = CUDAExtension(
        name="lightning_adaptiveload._C",
        sources=[str(Path(s).relative_to(ROOT)) for s in spec.sources],  # setuptools wants relative paths
        include_dirs=spec.include_dirs,
        extra_compile_args={"cxx": spec.cxx_flags, "nvcc": spec.nvcc_flags},
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
        # `adaptiveload encode`: PyAV decodes videos (FFmpeg in its wheels), diffusers has the Wan VAE
        # (AutoencoderKLWan, 0.33+), transformers the UMT5 encoder; sentencepiece reads a tokenizer
        # saved as spiece.model only (Wan's diffusers folders also ship tokenizer.json), and under
        # transformers 5 converting it needs protobuf. ftfy is optional (captions are fixed with it
        # if installed, as Wan's pipelines do): `pip install ftfy`
        "encode": ["av>=12", "diffusers>=0.33", "transformers>=4.46", "tokenizers>=0.20", "sentencepiece>=0.2",
                   "protobuf>=3.20", "pillow>=9"],
    },
    entry_points={"console_scripts": ["adaptiveload=lightning_adaptiveload.cli:main"]},
    **cuda_extension_kwargs(),
)

from setuptools import find_packages, setup

setup(
    name="lightning-adaptiveload",
    version="0.1.0",
    description="Load-balanced bucketing and a fused AdaLN CUDA kernel for video DiT training with PyTorch Lightning",
    python_requires=">=3.10",
    packages=find_packages(include=["lightning_adaptiveload", "lightning_adaptiveload.*"]),
    package_data={"lightning_adaptiveload": ["data/*.jsonl", "data/*.json"]},
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
)

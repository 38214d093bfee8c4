"""The optional packages of `adaptiveload encode` (PyAV, Pillow, diffusers, transformers), imported
when first used, so that `import lightning_adaptiveload` and `--help` need none of them."""
from __future__ import annotations

import importlib

EXTRA = 'pip install "lightning-adaptiveload[encode]"'


def require(module: str):
    """Import `module`, or raise an ImportError that names the extra to install."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise ImportError(f"adaptiveload encode needs the optional package {module.split('.')[0]!r} ({e}); "
                          f"install it with: {EXTRA}") from e

"""Tests of the benchmark scripts' pipelines (their long runs happen on the device, not here)."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

REPO = Path(__file__).resolve().parents[2]


def load_benchmark(relative_path: str, name: str) -> ModuleType:
    """The benchmark script at REPO/relative_path imported as module `name` (scripts are not a package);
    registered in sys.modules first (dataclasses look their module up there)."""
    spec = importlib.util.spec_from_file_location(name, REPO / relative_path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module

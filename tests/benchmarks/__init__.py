"""Tests of the benchmark scripts' pipelines (their long runs happen on the device, not here)."""
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

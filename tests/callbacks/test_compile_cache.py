"""The CompileCache callback: a second fit of the same config, in a fresh process with an empty
on-disk compile cache, reads every graph from the bundle the first fit saved and trains the same."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import lightning as L
import pytest
import torch

from lightning_adaptiveload.callbacks import CompileCache
from lightning_adaptiveload.calibration.record import model_fingerprint
from lightning_adaptiveload.compile_cache import INDUCTOR_CACHE_VARIABLE
from tests.callbacks.compile_cache_script import TinyModule

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tests" / "callbacks" / "compile_cache_script.py"


def _fit(root: Path, out: Path, inductor_dir: Path | None) -> tuple[dict, str]:
    env = {k: v for k, v in os.environ.items() if k != INDUCTOR_CACHE_VARIABLE}
    env["PYTHONPATH"] = str(ROOT)
    if inductor_dir is not None:
        env[INDUCTOR_CACHE_VARIABLE] = str(inductor_dir)
    done = subprocess.run([sys.executable, str(SCRIPT), str(root), str(out)], env=env, cwd=ROOT, timeout=300,
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(out.read_text()), done.stdout + done.stderr


@pytest.mark.slow  # two processes that each fit with inductor on CPU: 30-70 s
def test_a_second_fit_reads_every_graph_from_the_first_fits_bundle(tmp_path):
    root = tmp_path / "run"
    first, log = _fit(root, tmp_path / "first.json", inductor_dir=None)
    assert first["loaded"] is False and first["counts"]["fxgraph_misses"] > 0
    # nothing compiles before this module's first training step (no calibration here)
    assert "before training, 0 graphs read from the compile cache, 0 compiled by inductor" in log
    assert f"end of training, 0 graphs read from the compile cache, {first['counts']['fxgraph_misses']} compiled" in log
    assert list((root / "compile_cache").glob("compile_cache-*.bin")), "no bundle beside the run's default root dir"
    assert first["key"]["compile_mode"] == "auto"  # the module's hparams["compile"]

    second, log = _fit(root, tmp_path / "second.json", inductor_dir=tmp_path / "empty_inductor_cache")
    assert second["loaded"] is True
    assert second["counts"]["fxgraph_misses"] == 0 and second["counts"]["autograd_misses"] == 0
    assert second["counts"]["fxgraph_hits"] == first["counts"]["fxgraph_misses"]
    assert f"end of training, {second['counts']['fxgraph_hits']} graphs read from the compile cache, 0 compiled" in log
    assert "no new compile artifacts" in log
    # same weights, same data, same compiled code: the same losses
    assert second["losses"] == first["losses"]


def test_setup_keys_the_cache_by_the_module_and_the_compile_mode(tmp_path):
    trainer = L.Trainer(accelerator="cpu", devices=1, logger=False, default_root_dir=tmp_path)
    module = TinyModule(compile="dynamic")
    callback = CompileCache()
    callback.setup(trainer, module, "fit")
    assert callback.loaded is False
    assert callback.cache.directory == tmp_path / "compile_cache"
    assert callback.cache.key["compile_mode"] == "dynamic" and callback.cache.key["model"] == model_fingerprint(module)
    assert callback.cache.key["device"] == "cpu"
    named = CompileCache(directory=str(tmp_path / "elsewhere"), compile_mode="static")
    named.setup(trainer, module, "fit")
    assert named.cache.directory == tmp_path / "elsewhere" and named.cache.key["compile_mode"] == "static"
    assert named.cache.bundle_path != callback.cache.bundle_path
    validate_only = CompileCache()
    validate_only.setup(trainer, module, "validate")
    assert validate_only.cache is None

"""_environment.quiet_console: in a fresh process, the same script with and without it: the
library notices it drops are printed without it (so the test sees the real libraries emit them)
and gone with it; this package's warnings lose their source path, other warnings keep theirs."""
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

from lightning_adaptiveload._environment import PACKAGE_DIR

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = r'''
import sys, warnings
from lightning_adaptiveload._environment import PACKAGE_DIR, quiet_console
if sys.argv[1] == "quiet":
    quiet_console()
    quiet_console()  # twice: each message still printed once
import lightning.pytorch as pl
from lightning.pytorch.loggers import CSVLogger

# a Trainer with a logger other than LitLogger: Lightning's litlogger tip
pl.Trainer(accelerator="cpu", logger=CSVLogger(sys.argv[2]), enable_checkpointing=False, enable_progress_bar=False,
           enable_model_summary=False)
warnings.warn_explicit("CostModelCalibration: a test warning", UserWarning,
                       str(PACKAGE_DIR / "calibration" / "loop.py"), 110)
warnings.warn_explicit("elsewhere: a test warning", UserWarning, sys.argv[2] + "/user_script.py", 7)
if sys.argv[3] == "diffusers":  # from_pretrained without accelerate: diffusers' notice
    from diffusers import AutoencoderKLWan
    AutoencoderKLWan(base_dim=4, z_dim=4, dim_mult=[1, 1, 1, 1], num_res_blocks=1).save_pretrained(sys.argv[2] + "/vae")
    AutoencoderKLWan.from_pretrained(sys.argv[2] + "/vae")
print("done")
'''
ACCELERATE_NOTICE = "Cannot initialize model with low cpu memory usage because `accelerate` was not found"


def _run(mode: str, tmp_path: Path, diffusers: bool) -> str:
    tmp_path.mkdir()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", SCRIPT, mode, str(tmp_path), "diffusers" if diffusers else "-"],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and "done" in out.stdout, out.stderr[-3000:]
    return out.stdout + out.stderr


def test_quiet_console_drops_library_notices_and_our_source_paths(tmp_path):
    diffusers = (importlib.util.find_spec("diffusers") is not None
                 and importlib.util.find_spec("accelerate") is None)
    loud = _run("loud", tmp_path / "loud", diffusers)
    quiet = _run("quiet", tmp_path / "quiet", diffusers)
    ours = f"{PACKAGE_DIR / 'calibration' / 'loop.py'}:110"
    assert "💡 Tip:" in loud and ours in loud
    assert "💡 Tip:" not in quiet and ours not in quiet and str(PACKAGE_DIR) not in quiet
    assert quiet.splitlines().count("CostModelCalibration: a test warning") == 1
    for out in (loud, quiet):  # a warning of someone else's file keeps Python's format
        assert "user_script.py:7: UserWarning: elsewhere: a test warning" in out
    if diffusers:
        assert ACCELERATE_NOTICE in loud and ACCELERATE_NOTICE not in quiet
    else:
        pytest.skip("diffusers' accelerate notice not checked: diffusers missing or accelerate installed")

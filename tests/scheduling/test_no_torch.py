"""The scheduling core is tensor-free: importing every module of it loads neither torch nor
Lightning (checked in a fresh interpreter, where nothing imported them before)."""
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_scheduling_imports_no_torch():
    code = ("import importlib, pkgutil, sys\n"
            "import lightning_adaptiveload.scheduling as pkg\n"
            "names = [m.name for m in pkgutil.iter_modules(pkg.__path__)]\n"
            "for name in names:\n"
            "    importlib.import_module(f'lightning_adaptiveload.scheduling.{name}')\n"
            "loaded = sorted(k for k in sys.modules if k.split('.')[0] in ('torch', 'lightning'))\n"
            "print(len(names), loaded)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO,
                         env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"}).stdout.split(" ", 1)
    assert int(out[0]) >= 7 and out[1].strip() == "[]"

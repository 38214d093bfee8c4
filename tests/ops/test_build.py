"""The extension's build settings (ops/_build.py, shared by setup.py and the JIT build) and
`ensure_extension()` (load or build before timed work, with progress lines), on CPU."""
import json
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

from lightning_adaptiveload import ops
from lightning_adaptiveload.ops import _build, extension

ROOT = Path(__file__).resolve().parents[2]


def test_build_spec_names_existing_sources_and_default_archs():
    spec = _build.build_spec(extension.CSRC_DIR, env={})
    assert spec.sources and all(Path(s).is_file() for s in spec.sources)
    assert {Path(s).suffix for s in spec.sources} == {".cpp", ".cu"}
    assert spec.include_dirs[0] == str(extension.CSRC_DIR)
    assert spec.archs == ["80", "90"]
    # SASS for each arch, PTX for the last: what newer GPUs JIT from
    assert [f for f in spec.nvcc_flags if f.startswith("-gencode")] == [
        "-gencode=arch=compute_80,code=sm_80",
        "-gencode=arch=compute_90,code=sm_90",
        "-gencode=arch=compute_90,code=compute_90",
    ]


def test_archs_from_the_environment_and_bad_values_named():
    assert _build.build_spec(extension.CSRC_DIR, env={"ADAPTIVELOAD_CUDA_ARCHS": " 90a "}).archs == ["90a"]
    assert _build.cuda_archs(["80"], env={"ADAPTIVELOAD_CUDA_ARCHS": "80;100;"}) == ["80", "100"]
    with pytest.raises(ValueError, match=r"ADAPTIVELOAD_CUDA_ARCHS='sm_90': expected compute capabilities.*'sm_90'"):
        _build.cuda_archs(["80"], env={"ADAPTIVELOAD_CUDA_ARCHS": "sm_90"})


def test_build_flags_file_errors_name_the_file(tmp_path):
    with pytest.raises(ValueError, match="build_flags.json: cannot read"):
        _build.build_spec(tmp_path)
    (tmp_path / "build_flags.json").write_text(json.dumps({"sources": ["a.cu"]}))
    with pytest.raises(ValueError, match=r"build_flags.json: missing keys \['cxx', 'nvcc', 'cuda_archs'\]"):
        _build.build_spec(tmp_path)


def test_why_no_cuda_build(tmp_path):
    assert "not a CUDA build" in _build.why_no_cuda_build(None, "/usr/local/cuda")
    assert "no CUDA toolkit" in _build.why_no_cuda_build("13.0", None)
    assert "no CUDA toolkit" in _build.why_no_cuda_build("13.0", str(tmp_path))  # no bin/nvcc there
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "nvcc").write_text("")
    assert _build.why_no_cuda_build("13.0", str(tmp_path)) is None


@pytest.mark.skipif(torch.version.cuda is None, reason="setup.py configures the extension only with a CUDA torch")
def test_setup_py_and_jit_build_use_the_same_spec(tmp_path):
    """setup.py loads ops/_build.py by path (never the package) and gets the JIT build's spec."""
    nvcc = tmp_path / "bin" / "nvcc"
    nvcc.parent.mkdir()
    nvcc.write_text("")
    code = (
        "import json, runpy, sys, setuptools\n"
        "captured = {}\n"
        "setuptools.setup = lambda **kw: captured.update(kw)\n"
        "runpy.run_path('setup.py')\n"
        "ext = captured['ext_modules'][0]\n"
        "print(json.dumps({'name': ext.name, 'sources': ext.sources, 'include_dirs': ext.include_dirs,\n"
        "                  'args': ext.extra_compile_args,\n"
        "                  'package_imported': any(m.startswith('lightning_adaptiveload') for m in sys.modules)}))\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("ADAPTIVELOAD_NO_CUDA_BUILD", "PYTHONPATH")}
    env.update(CUDA_HOME=str(tmp_path), ADAPTIVELOAD_CUDA_ARCHS="90")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    spec = _build.build_spec(ROOT / "csrc", env={"ADAPTIVELOAD_CUDA_ARCHS": "90"})
    assert got["name"] == "lightning_adaptiveload._C" and not got["package_imported"]
    assert [str(ROOT / s) for s in got["sources"]] == spec.sources
    assert got["include_dirs"][: len(spec.include_dirs)] == spec.include_dirs
    assert got["args"]["nvcc"][-len(spec.nvcc_flags):] == spec.nvcc_flags
    assert got["args"]["cxx"] == spec.cxx_flags


def test_ensure_extension_on_a_cpu_machine_returns_the_reference(monkeypatch, capsys):
    monkeypatch.setattr(extension, "_state", {})
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert ops.ensure_extension(verbose=False) == "reference: no CUDA device visible to torch"
    assert capsys.readouterr().err == ""
    assert ops.ensure_extension() == ops.backend() == "reference: no CUDA device visible to torch"
    assert "AdaLN backend: reference: no CUDA device" in capsys.readouterr().err


def _gpu_without_prebuilt(monkeypatch):
    monkeypatch.setattr(extension, "_state", {})
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setitem(sys.modules, "lightning_adaptiveload._C", None)  # import fails
    monkeypatch.delenv("ADAPTIVELOAD_NO_JIT", raising=False)
    monkeypatch.setattr(extension, "jit_blocker", lambda: None)


@pytest.mark.parametrize("cache_hit_s, done", [(10.0, "loaded from the cache in"), (-1.0, "compiled in")])
def test_ensure_extension_jit_builds_once_with_progress_lines(monkeypatch, capsys, cache_hit_s, done):
    _gpu_without_prebuilt(monkeypatch)
    monkeypatch.setattr(extension, "JIT_CACHE_HIT_S", cache_hit_s)
    builds = []
    built = types.SimpleNamespace(__file__="/cache/adaptiveload_C_jit/adaptiveload_C_jit.so")
    monkeypatch.setattr(extension, "jit_build", lambda: builds.append(1) or built)
    why = ops.ensure_extension()
    err = capsys.readouterr().err
    assert why.startswith("cuda: JIT-built from") and builds == [1]
    assert "JIT-building the AdaLN CUDA extension" in err and "adaptiveload build-ext" in err
    assert done in err and built.__file__ in err and f"AdaLN backend: {why}" in err
    assert extension.load_extension() == (built, why) and ops.ensure_extension(verbose=False) == why
    assert builds == [1]  # decided once per process


def test_ensure_extension_survives_a_failed_build(monkeypatch, capsys):
    _gpu_without_prebuilt(monkeypatch)

    def failing_build():
        raise RuntimeError("nvcc fatal: unsupported gpu architecture 'compute_200'")

    monkeypatch.setattr(extension, "jit_build", failing_build)
    with pytest.warns(RuntimeWarning, match="CUDA tensors run the AdaLN reference: JIT build failed: nvcc fatal"):
        why = ops.ensure_extension()
    assert why.startswith("reference: JIT build failed: nvcc fatal")
    assert "JIT-building the AdaLN CUDA extension" in capsys.readouterr().err


def test_jit_is_impossible_without_a_toolkit(monkeypatch):
    _gpu_without_prebuilt(monkeypatch)
    monkeypatch.setattr(extension, "jit_blocker", lambda: "no CUDA toolkit found (set CUDA_HOME ...)")
    monkeypatch.setattr(extension, "jit_build", lambda: pytest.fail("must not build"))
    with pytest.warns(RuntimeWarning):
        why = ops.ensure_extension(verbose=False)
    assert why.startswith("reference: prebuilt extension missing") and "no JIT build possible: no CUDA toolkit" in why

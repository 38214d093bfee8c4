"""`adaptiveload build-ext` on CPU: every outcome with the compiler stubbed out (a real build is
`tools/check_cuda_build.sh`'s job), and its exit status as documented in cli/build_ext.py."""
import sys
import types

import pytest
import torch

from lightning_adaptiveload.cli import build_parser, main
from lightning_adaptiveload.ops import extension


@pytest.fixture
def no_prebuilt(monkeypatch):
    monkeypatch.setattr(extension, "_state", {})
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setitem(sys.modules, "lightning_adaptiveload._C", None)  # import fails


def test_listed_in_help():
    assert "build-ext" in build_parser().format_help()


def test_cpu_torch_is_a_clear_failure(no_prebuilt, monkeypatch, capsys):
    monkeypatch.setattr(torch.version, "cuda", None)
    monkeypatch.setattr(extension, "jit_build", lambda **kw: pytest.fail("must not build"))
    assert main(["build-ext"]) == 1
    out = capsys.readouterr().out
    assert "no prebuilt lightning_adaptiveload._C" in out
    assert "cannot build the CUDA extension here: torch is not a CUDA build" in out
    assert "reference PyTorch AdaLN path" in out


def test_missing_toolkit_is_a_clear_failure(no_prebuilt, monkeypatch, capsys):
    import torch.utils.cpp_extension as cpp_extension

    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(cpp_extension, "CUDA_HOME", None)
    assert main(["build-ext"]) == 1
    assert "cannot build the CUDA extension here: no CUDA toolkit found (set CUDA_HOME" in capsys.readouterr().out


def test_builds_into_the_torch_cache_and_reports_backend(no_prebuilt, monkeypatch, capsys):
    monkeypatch.setattr(extension, "jit_blocker", lambda: None)
    built = types.SimpleNamespace(__file__="/cache/py311_cu130/adaptiveload_C_jit/adaptiveload_C_jit.so")
    monkeypatch.setattr(extension, "jit_build", lambda verbose=False: built)
    assert main(["build-ext"]) == 0
    out = capsys.readouterr().out
    assert "into torch's extension cache" in out and f"built in 0 s: {built.__file__}" in out
    assert "ops.backend() = reference: no CUDA device visible to torch" in out  # a GPU-less build node


def test_builds_into_the_package(no_prebuilt, monkeypatch, tmp_path, capsys):
    """--package compiles module `_C` in a temp dir and copies it next to the package's modules."""
    monkeypatch.setattr(extension, "jit_blocker", lambda: None)
    monkeypatch.setattr(extension, "PACKAGE_DIR", tmp_path)

    def fake_build(name, build_directory, verbose):
        so = build_directory + f"/{name}.so"
        with open(so, "w") as f:
            f.write("compiled")
        return types.SimpleNamespace(__file__=so)

    monkeypatch.setattr(extension, "jit_build", fake_build)
    assert main(["build-ext", "--package"]) == 0
    copied = list(tmp_path.glob("_C.*"))
    assert len(copied) == 1 and copied[0].read_text() == "compiled" and copied[0].name.endswith(".so")
    assert f"built in 0 s: {copied[0]}" in capsys.readouterr().out


def test_compile_error_fails_with_the_message(no_prebuilt, monkeypatch, capsys):
    monkeypatch.setattr(extension, "jit_blocker", lambda: None)

    def failing_build(verbose=False):
        raise RuntimeError("Error building extension 'adaptiveload_C_jit': adaln_launch.cu(12): error")

    monkeypatch.setattr(extension, "jit_build", failing_build)
    assert main(["build-ext"]) == 1
    assert "build FAILED: Error building extension 'adaptiveload_C_jit'" in capsys.readouterr().out


def test_prebuilt_extension_is_left_alone(monkeypatch, capsys):
    monkeypatch.setattr(extension, "_state", {})
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    prebuilt = types.ModuleType("lightning_adaptiveload._C")
    prebuilt.__file__ = "/site-packages/lightning_adaptiveload/_C.cpython-311-x86_64-linux-gnu.so"
    monkeypatch.setitem(sys.modules, "lightning_adaptiveload._C", prebuilt)
    monkeypatch.setattr(extension, "jit_build", lambda **kw: pytest.fail("must not build"))
    assert main(["build-ext"]) == 0
    out = capsys.readouterr().out
    assert f"prebuilt extension present, nothing to build: {prebuilt.__file__}" in out
    assert "ops.backend() = " in out

"""lightning_adaptiveload/compile_cache.py: a bundle saved by one process (once or, as the callback does,
more than once) makes a fresh one (empty in-memory and on-disk caches) read every graph instead of
compiling it, with the same results; a later run's save keeps what only an earlier run compiled; a bad
bundle is a warning and a cold compile."""
from __future__ import annotations

import hashlib
import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lightning_adaptiveload.compile_cache import INDUCTOR_CACHE_VARIABLE, CompileCache, cache_key

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "helpers" / "compile_cache_script.py"


def _run(directory: Path, out: Path, inductor_dir: Path | None, *args: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k != INDUCTOR_CACHE_VARIABLE}
    env["PYTHONPATH"] = str(ROOT)
    if inductor_dir is not None:
        env[INDUCTOR_CACHE_VARIABLE] = str(inductor_dir)
    subprocess.run([sys.executable, str(SCRIPT), str(directory), str(out), *args], env=env, check=True, cwd=ROOT,
                   timeout=300)
    return json.loads(out.read_text())


def _assert_matches_reference(runs: list[dict]) -> None:
    for run in runs:
        for got, want in (("y", "y_ref"), ("grad", "grad_ref")):
            torch.testing.assert_close(torch.tensor(run[got], dtype=torch.float64), torch.tensor(run[want], dtype=torch.float64),
                                       rtol=1e-4, atol=1e-5)


@pytest.mark.slow  # two processes that each compile with inductor on CPU: 30-70 s
def test_a_fresh_process_reads_every_graph_from_a_bundle_saved_twice(tmp_path):
    directory = tmp_path / "compile_cache"
    # Saved after each of the two shapes: torch's bundle then holds two chunks of each kind, and its own
    # loader would read the second only (the second shape's graphs).
    first = _run(directory, tmp_path / "first.json", None, "3,5", "--save-each")
    # The first run compiled (the control: the counters do see compiles) into torch's caches, which
    # CompileCache routed under its directory, and bundled every graph.
    assert first["loaded"] is False
    assert first["counts"]["fxgraph_misses"] > 0 and first["counts"]["fxgraph_hits"] == 0
    assert any((directory / "inductor").rglob("*")), "torch's on-disk caches are not under the cache directory"
    saved = first["saved"]
    assert saved["artifacts"]["inductor"] == first["counts"]["fxgraph_misses"]
    bundle = directory / f"compile_cache-{CompileCache(directory, saved['key']).digest}.bin"
    assert saved["bytes"] == bundle.stat().st_size and saved["sha256"] == hashlib.sha256(bundle.read_bytes()).hexdigest()
    written = bundle.stat().st_mtime_ns
    _assert_matches_reference(first["runs"])

    # An empty on-disk cache elsewhere: only the bundle can supply the graphs.
    second = _run(directory, tmp_path / "second.json", tmp_path / "empty_inductor_cache")
    assert second["loaded"] is True
    assert second["counts"]["fxgraph_misses"] == 0
    assert second["counts"]["fxgraph_hits"] == first["counts"]["fxgraph_misses"]
    assert second["counts"]["autograd_misses"] == 0 and second["counts"]["autograd_hits"] == first["counts"]["autograd_misses"]
    assert second["saved"] is None and bundle.stat().st_mtime_ns == written  # nothing new: not rewritten
    _assert_matches_reference(second["runs"])


@pytest.mark.slow  # three processes that each compile with inductor on CPU: 45-100 s
def test_a_later_save_keeps_the_graphs_only_an_earlier_run_compiled(tmp_path):
    directory = tmp_path / "compile_cache"
    only_3 = _run(directory, tmp_path / "a.json", tmp_path / "inductor_a", "3")
    assert only_3["counts"]["fxgraph_misses"] > 0
    # A run that meets another shape only (torch's default compiles it static: graphs of its own), on an
    # empty on-disk cache: it reads nothing from the bundle and saves what it compiled.
    only_5 = _run(directory, tmp_path / "b.json", tmp_path / "inductor_b", "5")
    assert only_5["loaded"] is True and only_5["counts"]["fxgraph_misses"] > 0 and only_5["counts"]["fxgraph_hits"] == 0
    assert only_5["saved"]["artifacts"]["inductor"] == only_3["counts"]["fxgraph_misses"] + only_5["counts"]["fxgraph_misses"]
    # The first shape again, on another empty on-disk cache: its graphs came through the second save.
    again = _run(directory, tmp_path / "c.json", tmp_path / "inductor_c", "3")
    assert again["counts"]["fxgraph_misses"] == 0 and again["counts"]["fxgraph_hits"] == only_3["counts"]["fxgraph_misses"]
    assert again["saved"] is None
    _assert_matches_reference(only_3["runs"] + only_5["runs"] + again["runs"])


def _key(mode="auto"):
    return cache_key("model-hash", mode, torch.device("cpu"))


def _write(cache: CompileCache, data: bytes, **record) -> None:
    cache.directory.mkdir(parents=True, exist_ok=True)
    cache.bundle_path.write_bytes(data)
    doc = {"format": "adaptiveload.compile_cache", "version": 1, "key": cache.key,
           "sha256": hashlib.sha256(data).hexdigest(), **record}
    cache.record_path.write_text(json.dumps(doc))


def test_key_and_file_name_change_with_compile_mode_and_model():
    base = CompileCache("d", _key("auto"))
    assert base.key["compile_mode"] == "auto" and base.key["torch"] == torch.__version__
    others = [CompileCache("d", _key("dynamic")), CompileCache("d", cache_key("other-hash", "auto", torch.device("cpu")))]
    assert len({base.bundle_path, *(c.bundle_path for c in others)}) == 3
    assert CompileCache("d", _key("auto")).bundle_path == base.bundle_path


@pytest.mark.parametrize("case", ["corrupt", "torch_refuses", "other_key", "no_record"])
def test_a_bad_bundle_is_a_warning_and_a_cold_compile(tmp_path, caplog, case):
    cache = CompileCache(tmp_path, _key())
    data = os.urandom(256)
    if case == "corrupt":  # bytes changed after the record was written
        _write(cache, data)
        cache.bundle_path.write_bytes(data[:100])
    elif case == "torch_refuses":  # the recorded bytes, but not torch's format
        _write(cache, data)
    elif case == "other_key":
        _write(cache, data, key=_key("dynamic"))
    else:
        _write(cache, data)
        cache.record_path.unlink()
    with caplog.at_level(logging.WARNING, logger="lightning_adaptiveload.compile_cache"):
        assert cache.load() is False
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING
                and r.name == "lightning_adaptiveload.compile_cache"]
    assert len(warnings) == 1 and str(cache.bundle_path) in warnings[0], warnings
    expected = {"corrupt": "sha256", "torch_refuses": "torch could not load", "other_key": "another key",
                "no_record": "cannot read"}[case]
    assert expected in warnings[0]


def test_no_bundle_is_a_first_run_not_a_warning(tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger="lightning_adaptiveload.compile_cache"):
        assert CompileCache(tmp_path / "new", _key()).load() is False
    assert [r.levelno for r in caplog.records if r.name == "lightning_adaptiveload.compile_cache"] == [logging.INFO]


def test_torch_caches_follow_the_directory_unless_the_user_chose_one(tmp_path, monkeypatch):
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    monkeypatch.delenv(INDUCTOR_CACHE_VARIABLE, raising=False)
    made = CompileCache(tmp_path, _key()).use_for_torch_caches()
    assert os.environ[INDUCTOR_CACHE_VARIABLE] == made[INDUCTOR_CACHE_VARIABLE] == str((tmp_path / "inductor").resolve())
    # torch writes its default into the variable at first use: that is not the user's choice
    monkeypatch.setenv(INDUCTOR_CACHE_VARIABLE, default_cache_dir())
    assert CompileCache(tmp_path, _key()).use_for_torch_caches() == made
    monkeypatch.setenv(INDUCTOR_CACHE_VARIABLE, str(tmp_path / "mine"))
    assert CompileCache(tmp_path, _key()).use_for_torch_caches() == {}
    assert os.environ[INDUCTOR_CACHE_VARIABLE] == str(tmp_path / "mine")


@pytest.mark.parametrize("key", [{}, {"f": object()}, ["a"]])
def test_a_key_that_is_no_json_dict_is_refused(key):
    with pytest.raises(ValueError, match="key must be"):
        CompileCache("d", key)

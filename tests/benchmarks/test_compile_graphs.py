"""benchmarks/e2e/compile_graphs.py with dynamo's eager backend (its guards and recompiles are dynamo's;
inductor only makes each graph slow): a mixed-shape run compiles one graph per specialization that
regional_compile's docstring states, two fewer than nn.Module.compile alone, with the same losses."""

import pytest

from benchmarks.e2e import compile_graphs


@pytest.mark.parametrize("mode,expected", [("dynamic", 4), ("auto", 5)])
def test_a_mixed_shape_run_compiles_one_graph_per_stated_specialization(mode, expected):
    rows = compile_graphs.run_shapes(mode, "contiguous", backend="eager")
    # {B = 1, B >= 2} x {checkpointed, not} (and auto's first, static graph)
    assert sum(r["new_graphs"] for r in rows) == expected
    assert {(r["batch_size"] == 1, r["checkpointed"] > 0) for r in rows} == {(True, True), (True, False), (False, True),
                                                                             (False, False)}
    plain = compile_graphs.run_shapes(mode, "plain", backend="eager")
    assert sum(r["new_graphs"] for r in plain) == expected + 2  # the first block's view input: graphs of its own
    assert any("NoneType" in f for r in plain for f in r["guard_failures"])
    assert [r["loss"] for r in rows] == pytest.approx([r["loss"] for r in plain], rel=1e-6)


def test_the_calibration_grid_compiles_the_same_four_graphs_in_dynamic(monkeypatch):
    """The shipped calibration grid's order (B = 1 at each length with every, half and no block
    checkpointed, then the batches) needs no more graphs than the mixed shapes: the stated
    specializations only, each for the guard named in regional_compile. Latent heights and widths are
    scaled down (distinct sizes stay distinct; the full 21x90x160 takes minutes on a CPU: that size is the
    GPU run's, `--shapes grid`)."""
    small = {32: 8, 56: 10, 60: 10, 64: 12, 90: 14, 104: 14, 160: 16}
    grid = [(b, t, small[h], small[w], k) for b, t, h, w, k in compile_graphs.GRID]
    monkeypatch.setitem(compile_graphs.SHAPE_SETS, "grid", grid)
    rows = compile_graphs.run_shapes("dynamic", "contiguous", backend="eager", shapes="grid")
    assert len(rows) == len(grid)
    assert sum(r["new_graphs"] for r in rows) == 4
    compiled = [(r["batch_size"], r["checkpointed"]) for r in rows if r["new_graphs"]]
    assert compiled == [(1, 3), (1, 2), (2, 3), (2, 2)]  # B = 1, then B = 2, each checkpointed and plain
    failures = " ".join(f for r in rows for f in r["guard_failures"])
    assert "size mismatch at index 0. expected 1, actual 2" in failures and "checkpoint ==" in failures


def test_under_one_process_fsdp1_the_mixed_shapes_compile_the_same_four_graphs():
    """The blocks as the shipped config compiles them under FSDP1 (one unit per block, parameters as
    flat-parameter views, bf16 mixed precision, gradients kept through the next forward; gloo on the
    CPU, in a process of its own for its process group): dynamo adds no graph to the stated four."""
    import json
    import subprocess
    import sys

    command = [sys.executable, compile_graphs.__file__, "--out", "unused", "--child", "dynamic", "contiguous",
               "--backend=eager", "--fsdp"]
    proc = subprocess.run(command, cwd=compile_graphs.REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert len(rows) == len(compile_graphs.SHAPES)
    assert sum(r["new_graphs"] for r in rows) == 4
    assert all(r["loss"] == r["loss"] and r["loss"] > 0 for r in rows)  # finite, positive losses

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

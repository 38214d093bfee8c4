"""monitoring/compile_counters.py on real torch.compile runs (backend="eager": dynamo only, fast
on CPU): a recompile per new input shape, a graph break, the recompile limit, and counts that
survive torch._dynamo.reset()."""
from __future__ import annotations

import pytest
import torch
import torch._dynamo

from lightning_adaptiveload.monitoring.compile_counters import CompileCounter, read_dynamo_counts


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def test_this_torch_keeps_every_counter():
    assert all(isinstance(v, int) for v in read_dynamo_counts().values())


def test_recompiles_graph_breaks_and_the_limit():
    counter = CompileCounter()
    linear = torch.compile(torch.nn.Linear(4, 4), backend="eager", dynamic=False)
    shapes = (2, 3, 5)
    for n in shapes:
        linear(torch.randn(n, 4))
    assert counter.read() == {"recompiles": len(shapes) - 1, "graph_breaks": 0, "limit_hits": 0}

    def with_break(x):
        x = x * 2
        torch._dynamo.graph_break()
        return x + 1

    torch.compile(with_break, backend="eager")(torch.randn(3))
    assert counter.read()["graph_breaks"] == 1

    def shape_dependent(x):
        return x.sum() * x.shape[0]

    compiled = torch.compile(shape_dependent, backend="eager", dynamic=False)
    with torch._dynamo.config.patch(recompile_limit=2):
        for n in (1, 2, 3, 4):  # the third shape would be the second recompile: refused
            compiled(torch.randn(n))
    counts = counter.read()
    assert counts["limit_hits"] == 1
    assert counts["recompiles"] == len(shapes) - 1 + 2  # the refused attempt counts as a recompile


def test_counts_so_far_survive_a_dynamo_reset():
    counter = CompileCounter()
    linear = torch.compile(torch.nn.Linear(4, 4), backend="eager", dynamic=False)
    for n in (2, 3, 4):
        linear(torch.randn(n, 4))
    assert counter.read()["recompiles"] == 2
    torch._dynamo.reset()  # clears dynamo's process-wide counters: the total drops to 0
    linear = torch.compile(torch.nn.Linear(4, 4), backend="eager", dynamic=False)
    for n in (2, 3):
        linear(torch.randn(n, 4))
    assert counter.read()["recompiles"] == 3  # 2 before the reset, 1 after

"""monitoring/compile_counters.py on real torch.compile runs (backend="eager": dynamo only, fast
on CPU): a recompile per new input shape, a graph break, the recompile limit, and counts that
survive torch._dynamo.reset()."""
from __future__ import annotations

import pytest
import torch
import torch._dynamo

from lightning_adaptiveload.monitoring.compile_counters import (CompileCounter, RecompileReasons, describe_reasons,
                                                               read_dynamo_counts, with_recompile_reasons)


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


def test_recompile_reasons_are_read_once_each_and_again_after_a_reset():
    reasons = RecompileReasons()
    linear = torch.compile(torch.nn.Linear(4, 4), backend="eager", dynamic=False)
    linear(torch.randn(2, 4))
    assert reasons.read() == []  # a first compile is no recompile
    linear(torch.randn(3, 4))
    got = reasons.read()
    assert len(got) == 1 and "size mismatch at index 0. expected 2, actual 3" in got[0]
    assert reasons.read() == []
    linear(torch.randn(5, 4))  # misses both graphs: one failure per graph, one recompile
    got = reasons.read()
    assert sorted(r.split(": ", 1)[1] for r in got) == [
        "tensor 'args[0]' size mismatch at index 0. expected 2, actual 5",
        "tensor 'args[0]' size mismatch at index 0. expected 3, actual 5"]
    torch._dynamo.reset()  # empties dynamo's record: what comes after is read from its start
    linear = torch.compile(torch.nn.Linear(4, 4), backend="eager", dynamic=False)
    for n in (2, 7):
        linear(torch.randn(n, 4))
    got = reasons.read()
    assert len(got) == 1 and "expected 2, actual 7" in got[0]


def test_describe_reasons_counts_a_repeated_reason_once_without_the_compile_id():
    text = describe_reasons(["0/1: tensor 'x' size mismatch at index 1", "1/0: ___check_obj_id(f)",
                             "0/2: tensor 'x' size mismatch at index 1\nUser stack trace:\n..."], width=24)
    assert text == "2x tensor 'x' size mismatch | ___check_obj_id(f)"  # the first 24 characters of each


def test_lines_carry_the_guard_failures_since_the_line_before():
    lines = []
    info = with_recompile_reasons(lines.append)
    linear = torch.compile(torch.nn.Linear(4, 4), backend="eager", dynamic=False)
    for n in (2, 2, 3):
        linear(torch.randn(n, 4))
        info(f"n={n}")
    assert lines[:2] == ["n=2", "n=2"]
    assert lines[2] == ("n=3; compiled again, guards failed: "
                        "tensor 'args[0]' size mismatch at index 0. expected 2, actual 3")

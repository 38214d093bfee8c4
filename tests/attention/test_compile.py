"""torch.compile and the attention backend, on the CPU (torch has its flash and math kernels there).

What torch does by itself: the kernel enabled when dynamo traces is baked into the graph, and dynamo does
not guard on sdpa_kernel's state, so the graph keeps running it under another backend. What
attention_backend does: the graph is guarded on the router's state, recompiles once per backend and runs
the one asked for, with dynamic shapes one graph per backend (and none per shape), no graph break in the
example's DiT block, also under PerBucketCheckpointing's switch. Which kernel ran is read from the profiled
aten ops (backends_run)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from examples.video_dit.model import DiTBlock, rope_3d
from lightning_adaptiveload.attention import attention_backend, backends_run
from lightning_adaptiveload.checkpointing import BlockCheckpointing
from lightning_adaptiveload.monitoring.compile_counters import CompileCounter


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def attend(q, k, v):
    return F.scaled_dot_product_attention(q, k, v)


def fwd_bwd(fn, *inputs):
    out = fn(*inputs)
    out.sum().backward()
    return out


def qkv(s=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(2, s, 3, 8, generator=g).transpose(1, 2).requires_grad_() for _ in range(3)]


def test_torch_bakes_the_traced_kernel_in_and_does_not_guard_sdpa_kernel():
    compiled = torch.compile(attend, backend="inductor", dynamic=True)
    counter = CompileCounter()
    inputs = qkv()
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
        assert backends_run(lambda: fwd_bwd(compiled, *inputs)) == {"flash"}
    with sdpa_kernel([SDPBackend.MATH]):
        ran = backends_run(lambda: fwd_bwd(compiled, *inputs))
    assert ran == {"flash"}  # math was asked for; the graph traced under flash ran
    assert counter.read()["recompiles"] == 0


def test_attention_backend_recompiles_once_per_backend_and_runs_it():
    compiled = torch.compile(attend, backend="inductor", dynamic=True)
    counter = CompileCounter()
    ran = []
    for backend, s in [("flash", 16), ("math", 16), ("flash", 24), ("math", 40), (None, 24), ("flash", 40)]:
        inputs = qkv(s)
        with attention_backend(backend, strict=True):
            ran.append(backends_run(lambda: fwd_bwd(compiled, *inputs)))
        expected = attend(*(t.detach() for t in inputs))
        assert torch.allclose(compiled(*inputs), expected, atol=1e-5)
    assert ran == [{"flash"}, {"math"}, {"flash"}, {"math"}, {"flash"}, {"flash"}]
    # graphs: flash, math, torch's own choice (None); new shapes and returns to a backend reuse them
    assert counter.read()["recompiles"] == 2


def block_step(block, s):
    g = torch.Generator().manual_seed(s)
    x = torch.randn(2, s, 32, generator=g, requires_grad=True)
    e, context = torch.randn(2, 6, 32, generator=g), torch.randn(2, 5, 32, generator=g)
    out = block(x, e, context, rope_3d((1, 1, s), 8, x.device))
    out.sum().backward()
    return out


@pytest.mark.parametrize("checkpointed", [False, True])
def test_compiled_dit_block_one_graph_per_backend_no_graph_break(checkpointed):
    """checkpointed: the block under PerBucketCheckpointing's switch, compiled as training compiles it
    (the recomputation is traced into the graph's backward)."""
    torch.manual_seed(0)
    block = DiTBlock(32, 64, 4)
    if checkpointed:
        BlockCheckpointing([block]).set_checkpointed(1)
    block.compile(dynamic=True, backend="aot_eager")
    counter = CompileCounter()
    ran = []
    for backend, s in [("flash", 12), ("math", 20), ("flash", 28)]:
        with attention_backend(backend, strict=True):
            ran.append(backends_run(lambda: block_step(block, s)))
    assert ran == [{"flash"}, {"math"}, {"flash"}]
    counts = counter.read()
    assert counts["graph_breaks"] == 0
    assert counts["recompiles"] == 1  # the math graph; shapes are dynamic

"""compile_blocks' call: the compiled blocks get contiguous inputs of their own storage, gradients unchanged
(fp64 reference). How many graphs that saves: tests/benchmarks/test_compile_graphs.py."""
import gc
import weakref

import pytest
import torch
from torch import nn

from lightning_adaptiveload.regional_compile import _COPY, _ContiguousInputs, _own_contiguous, compile_blocks, guard_free_options

from benchmarks.e2e.fsdp_param_views import Block, as_flat_views


def test_the_compiled_call_gets_contiguous_tensors_of_its_own_and_the_same_gradients():
    rng = torch.Generator().manual_seed(0)
    base = torch.randn(2, 5, 7, dtype=torch.float64, generator=rng, requires_grad=True)
    view = base.transpose(1, 2)  # non-contiguous view
    flat = base.flatten(1)  # contiguous view
    plain = torch.randn(3, dtype=torch.float64, generator=rng, requires_grad=True)
    seen = []

    def fn(x, pair, scale=None, plain=None):
        seen.extend([x, *pair, scale, plain])
        return (x.sum(-1) ** 2).sum() + (pair[0] * pair[1].sum()).sum() + scale.sum() * plain.sum()

    out = _ContiguousInputs(fn, nn.Module())(view, (flat, plain), scale=view, plain=plain)
    x, first, second, scale, same = seen
    assert all(t._base is None and t.is_contiguous() for t in (x, first, scale))
    assert second is plain and same is plain  # not a view: handed over as it is
    assert scale is x  # one copy of a tensor, however many blocks (or arguments) take it
    assert torch.equal(x, view) and torch.equal(first, flat)
    grads = torch.autograd.grad(out, (base, plain))
    reference = torch.autograd.grad(fn(view, (flat, plain), scale=view, plain=plain), (base, plain))
    for got, want in zip(grads, reference):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)  # sums in another order


def test_compile_blocks_compiles_each_block_once_and_names_a_bad_mode():
    blocks = [torch.nn.Linear(3, 3), torch.nn.Linear(3, 3)]
    assert compile_blocks(blocks, "dynamic", backend="eager") == 2
    calls = [block._compiled_call_impl for block in blocks]
    assert compile_blocks(blocks, "dynamic", backend="eager") == 0  # already compiled: left alone
    assert [block._compiled_call_impl for block in blocks] == calls
    x = torch.randn(4, 3, dtype=torch.float64)
    blocks64 = [b.double() for b in blocks]
    torch.testing.assert_close(blocks64[0](x.t().contiguous().t()), x @ blocks64[0].weight.t() + blocks64[0].bias)
    with pytest.raises(ValueError, match="compile mode must be one of"):
        compile_blocks([torch.nn.Linear(3, 3)], "fast")


def test_blocks_share_one_copy_of_an_input_until_it_changes_or_dies():
    base = torch.randn(4, 6, requires_grad=True)
    context = (base * 2).view(2, 2, 6)  # a non-leaf view, as a linear's 3-D output is
    first = _own_contiguous(context)
    assert _own_contiguous(context) is first and first._base is None
    assert _own_contiguous({"c": [context]})["c"][0] is first  # through dicts and lists too
    with torch.no_grad():
        context.add_(1.0)  # modified in place: the copy is stale
    second = _own_contiguous(context)
    assert second is not first and torch.equal(second, context)
    strided_leaf = torch.randn(4, 6)[:, ::2].requires_grad_()  # a non-contiguous leaf: copied, not kept
    assert _own_contiguous(strided_leaf) is not _own_contiguous(strided_leaf)
    assert not hasattr(strided_leaf, _COPY)
    copy = weakref.ref(second)
    del context, first, second
    gc.collect()
    assert copy() is None  # the copy went with its original


def test_a_block_holding_flat_parameter_views_compiles_with_static_weight_sizes_and_the_same_math():
    """FSDP1's forward-time parameter views (plain tensors): compile_blocks marks their sizes static
    at every call, on the new tensor each forward brings too, and the compiled block computes what
    eager does (fp64), with one graph for both token counts."""
    torch.manual_seed(0)
    dim = 16
    block = Block(dim).double()
    reference = Block(dim).double()
    reference.load_state_dict(block.state_dict())
    as_flat_views(block)
    graphs = []

    def backend(gm, example_inputs):
        graphs.append({node.name: tuple(node.meta["example_value"].shape) for node in gm.graph.nodes
                       if node.op == "placeholder" and isinstance(node.meta.get("example_value"), torch.Tensor)})
        return gm.forward

    compile_blocks([block], "dynamic", backend=backend)
    for tokens in (5, 9):
        block.modulation = block.modulation.clone()  # a new plain tensor, as FSDP1 sets one at each forward
        x = torch.randn(1, tokens, dim, dtype=torch.float64)
        e = torch.randn(1, 6, dim, dtype=torch.float64)
        with torch.no_grad():
            torch.testing.assert_close(block(x, e), reference(x, e), rtol=1e-12, atol=1e-12)
    assert len(graphs) == 1
    modulation = next(shape for name, shape in graphs[0].items() if "modulation" in name)
    assert modulation == (1, 6, dim) and all(type(size) is int for size in modulation)


@pytest.mark.parametrize("mode", ["dynamic", "auto"])
def test_a_flat_parameter_whose_gradient_has_another_dtype_compiles_and_keeps_its_gradient(mode):
    """FSDP1 under bf16-mixed during a forward after the first step: the flat parameter holds bf16
    data (the views the block computes with) while its gradient, from the step before, stays fp32.
    torch's fake tensors refuse that pair; compile_blocks sets the gradient aside while it traces and
    puts the same tensor back. Two token counts; the block computes what the uncompiled one does."""
    torch.manual_seed(0)
    dim = 16
    block = Block(dim)
    params = list(block.named_parameters())
    as_flat_views(block)
    flat = block.modulation._base
    gradient = torch.randn(flat.shape)  # fp32, the previous step's
    flat.grad = gradient
    flat.data = flat.data.to(torch.bfloat16)  # as FSDP1 swaps in the compute dtype's copy

    def views():  # FSDP1 sets new views of the flat parameter at every forward
        offset = 0
        for name, p in params:
            owner, _, leaf = name.rpartition(".")
            setattr(block.get_submodule(owner) if owner else block, leaf,
                    flat[offset:offset + p.numel()].view(p.shape))
            offset += p.numel()

    expected = gradient.clone()
    compile_blocks([block], mode, backend=lambda gm, example_inputs: gm.forward)
    for tokens in (5, 9):
        views()
        x = torch.randn(1, tokens, dim, dtype=torch.bfloat16)
        e = torch.randn(1, 6, dim, dtype=torch.bfloat16)
        out = block(x, e)
        reference = Block.forward(block, x, e)
        assert out.dtype == torch.bfloat16
        torch.testing.assert_close(out, reference, rtol=0, atol=0)
        assert flat.grad is gradient and flat.grad.dtype == torch.float32 and torch.equal(gradient, expected)
        assert flat.dtype == torch.bfloat16


@pytest.mark.parametrize("mode, kwargs, expected", [
    ("dynamic", {}, {"triton.mix_order_reduction_non_strict_mode": True}),
    ("auto", {}, {"triton.mix_order_reduction_non_strict_mode": True}),
    ("dynamic", {"options": {"triton.mix_order_reduction_non_strict_mode": False, "max_autotune": True}},
     {"triton.mix_order_reduction_non_strict_mode": False, "max_autotune": True}),  # the caller's win
    ("static", {}, None),  # a graph per shape: its size decisions cost no recompile
    ("dynamic", {"backend": "eager"}, None),  # options are inductor's
])
def test_dynamic_inductor_blocks_get_the_guard_free_options(monkeypatch, mode, kwargs, expected):
    seen = []

    def compile(fn, **given):
        seen.append(given)
        return fn

    monkeypatch.setattr(torch, "compile", compile)
    compile_blocks([nn.Linear(3, 3), nn.Linear(3, 3)], mode, **kwargs)
    assert [given.get("options") for given in seen] == [expected, expected]


def test_guard_free_options_follow_what_this_torch_has():
    # this torch (2.13 here; 2.11 on the GPU machine guarded at the same checks) has the non-strict mode
    assert guard_free_options() == {"triton.mix_order_reduction_non_strict_mode": True}
    assert guard_free_options({"triton.mix_order_reduction", "max_autotune"}) == {"triton.mix_order_reduction": False}
    assert guard_free_options({"max_autotune"}) == {}


def test_inductor_accepts_the_options_and_the_compiled_block_computes_what_it_did():
    torch.manual_seed(0)
    block = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.LayerNorm(32))
    x = torch.randn(2, 5, 16, requires_grad=True)
    want = block(x)
    (want_grad,) = torch.autograd.grad(want.square().sum(), x)
    assert compile_blocks([block], "dynamic") == 1  # inductor, with guard_free_options()
    got = block(x)
    (got_grad,) = torch.autograd.grad(got.square().sum(), x)
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(got_grad, want_grad)


@pytest.mark.cuda
def test_one_dynamic_graph_for_a_wan_sized_block_across_the_mix_order_thresholds():
    """The shipped config's block sizes (D = 1536) at B = 1 for S = 256, 3,600 and 9,408 tokens, which
    straddle the mix-order reduction's row thresholds (3,072, 3,413 and 4,096 rows): one graph, no
    recompile (three without guard_free_options on torch 2.11, benchmarks/results/gpu_session15)."""
    import torch._dynamo

    from examples.video_dit.model import DiTBlock, rope_3d
    from lightning_adaptiveload.monitoring.compile_counters import RecompileReasons, read_dynamo_counts

    torch._dynamo.reset()
    torch.manual_seed(0)
    block = DiTBlock(1536, 8960, 12).cuda()
    compile_blocks([block], "dynamic")
    reasons, before = RecompileReasons(), read_dynamo_counts()["recompiles"]
    for s, grid in ((256, (1, 16, 16)), (3600, (1, 60, 60)), (9408, (3, 56, 56))):
        x = torch.randn(1, s, 1536, device="cuda", requires_grad=True)
        e = torch.randn(1, 6, 1536, device="cuda")
        context = torch.randn(1, 512, 1536, device="cuda")
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = block(x, e, context, rope_3d(grid, 128, x.device))
        out.float().square().mean().backward()
    assert read_dynamo_counts()["recompiles"] == before, reasons.read()
    torch._dynamo.reset()

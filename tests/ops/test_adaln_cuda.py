"""GPU tests of the compiled AdaLN kernels against an fp64 reference (F.layer_norm in fp64 with
autograd), on random inputs seeded from each case (tests/helpers/seeds.py: a failure replays), with
outputs poisoned (NaN) before every call.
Run on a GPU machine after building the extension: `bash benchmarks/gpu_kernel.sh`."""

import gc

import pytest
import torch
import torch.nn.functional as F

from lightning_adaptiveload import ops
from lightning_adaptiveload.ops.modules import FusedAdaLN
from lightning_adaptiveload.ops import adaln_modulate
from tests.helpers.seeds import stable_seed

pytestmark = pytest.mark.cuda

TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 1e-2}


def rel_err(out, ref):
    return ((out.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30)).item()


def poison_allocator(nbytes):
    """Fill memory the caching allocator will hand out next with NaN bits (0xFF bytes), so an
    output element the kernel never writes shows up as NaN."""
    gc.collect()  # tensors earlier tests left in reference cycles would keep unpoisoned fragments cached
    torch.cuda.empty_cache()  # so the poisoned blocks are the only cached ones
    blocks = [torch.empty(int(nbytes), dtype=torch.uint8, device="cuda")]
    blocks += [torch.empty(1 << 19, dtype=torch.uint8, device="cuda") for _ in range(32)]  # small pool
    for b in blocks:
        b.fill_(0xFF)
    del blocks


def make_inputs(batch, seq, dim, x_dtype, mod_kind, mod_dtype, affine, gen):
    """Leaf tensors and the (shift, scale) views a model would pass."""
    dev = "cuda"
    x = (torch.randn(batch, seq, dim, generator=gen, device=dev) * 2 + 0.5).to(x_dtype)
    if mod_kind == "per_sample":  # e[:, k] of a (B, 6, D) time embedding, Wan-style chunk views
        leaf = (0.5 * torch.randn(batch, 6, dim, generator=gen, device=dev)).to(mod_dtype)
        views = lambda t: (t.chunk(6, dim=1)[0], t.chunk(6, dim=1)[1])  # noqa: E731
    elif mod_kind == "per_sample_2d":
        leaf = (0.5 * torch.randn(batch, 6, dim, generator=gen, device=dev)).to(mod_dtype)
        views = lambda t: (t[:, 2], t[:, 4])  # noqa: E731
    elif mod_kind == "per_token":  # (B, N, 2D).chunk(2, -1): row stride 2D
        leaf = (0.5 * torch.randn(batch, seq, 2 * dim, generator=gen, device=dev)).to(mod_dtype)
        views = lambda t: t.chunk(2, dim=-1)  # noqa: E731
    elif mod_kind == "misaligned":  # row stride 3(D+1), offset 1: forces the generic path
        leaf = (0.5 * torch.randn(batch, 3, dim + 1, generator=gen, device=dev)).to(mod_dtype)
        views = lambda t: (t[:, 0:1, 1:], t[:, 1:2, 1:])  # noqa: E731
    else:
        raise AssertionError(mod_kind)
    weight = (1 + 0.3 * torch.randn(dim, generator=gen, device=dev)) if affine else None
    bias = 0.3 * torch.randn(dim, generator=gen, device=dev) if affine else None
    return x, leaf, views, weight, bias


def run_fused(x, leaf, views, weight, bias, dy):
    leaves = [t.detach().requires_grad_() for t in (x, leaf, weight, bias) if t is not None]
    xx, ll = leaves[0], leaves[1]
    w, b = (leaves[2], leaves[3]) if weight is not None else (None, None)
    out_bytes = 4 * (x.numel() * x.element_size() + leaf.numel() * leaf.element_size())
    poison_allocator(out_bytes)
    y = adaln_modulate(xx, *views(ll), w, b)
    poison_allocator(out_bytes)
    grads = torch.autograd.grad(y, leaves, dy)
    return y, grads


def run_reference(x, leaf, views, weight, bias, dy):
    leaves = [t.detach().double().requires_grad_() for t in (x, leaf, weight, bias) if t is not None]
    xx, ll = leaves[0], leaves[1]
    w, b = (leaves[2], leaves[3]) if weight is not None else (None, None)
    shift, scale = views(ll)
    if shift.dim() == 2:
        shift, scale = shift[:, None], scale[:, None]
    y = F.layer_norm(xx, (x.shape[-1],), w, b, 1e-6) * (1 + scale) + shift
    return y, torch.autograd.grad(y, leaves, dy.double())


def test_poisoning_reaches_fresh_allocations():
    poison_allocator(64 << 20)
    fresh = torch.empty(1 << 20, dtype=torch.float32, device="cuda")
    assert fresh.isnan().all(), "poison_allocator no longer poisons the caching allocator; tests below would be weak"


def test_backend_is_compiled_extension():
    assert ops.backend().startswith("cuda:"), ops.backend()


CASES = [
    # (B, N, D, x dtype, modulation, modulation dtype, affine)
    (1, 1, 1536, torch.bfloat16, "per_sample", torch.bfloat16, False),
    (2, 7, 1536, torch.float32, "per_sample", torch.float32, False),
    (1, 16384, 1536, torch.bfloat16, "per_sample", torch.bfloat16, False),
    (1, 65536, 1536, torch.bfloat16, "per_sample", torch.float32, False),
    (4, 4096, 3072, torch.bfloat16, "per_sample", torch.float32, True),
    (2, 3000, 3072, torch.float32, "per_sample_2d", torch.float32, True),
    (2, 32760, 5120, torch.bfloat16, "per_sample", torch.bfloat16, False),
    (1, 9999, 5120, torch.float32, "per_sample", torch.float32, False),
    (3, 2048, 5120, torch.float16, "per_token", torch.float16, True),
    (2, 1000, 8192, torch.bfloat16, "per_token", torch.float32, False),
    (1, 4096, 8192, torch.float32, "per_token", torch.float32, True),
    (8, 513, 8192, torch.bfloat16, "per_sample_2d", torch.bfloat16, True),
    (2, 300, 16384, torch.bfloat16, "per_sample", torch.bfloat16, True),
    (1, 257, 16384, torch.float32, "per_sample", torch.float32, False),  # fp32 beyond the fast path
    (2, 333, 999, torch.bfloat16, "per_sample", torch.float32, True),  # odd D: generic path
    (3, 100, 17, torch.float32, "per_token", torch.float32, True),
    (8, 1, 40, torch.float16, "per_sample", torch.float32, False),
    (2, 4097, 1536, torch.bfloat16, "misaligned", torch.bfloat16, False),
    (2, 4097, 1536, torch.float32, "misaligned", torch.float32, True),
    (1, 65536, 5120, torch.bfloat16, "per_token", torch.bfloat16, False),
    (8, 8192, 1000, torch.bfloat16, "per_sample", torch.bfloat16, False),
    # Warp-per-row forward: each vectors-per-lane instantiation (16-bit x: D <= 256, 512, 1024,
    # 1536, 2048; fp32: half those), rows not a multiple of the 4 rows per block, the last
    # warp-path D and the first block-path D for both vector widths.
    (3, 37, 256, torch.bfloat16, "per_token", torch.float32, True),  # 1 vector per lane
    (2, 129, 512, torch.float16, "per_sample", torch.float16, True),  # 2
    (2, 33, 1024, torch.bfloat16, "per_sample", torch.float32, False),  # 4
    (2, 555, 768, torch.float32, "per_sample", torch.float32, False),  # fp32, 6
    (2, 2050, 1536, torch.float16, "per_token", torch.float32, True),  # 6
    (1, 999, 1024, torch.float32, "per_sample_2d", torch.float32, True),  # fp32, 8: last fp32 warp D
    (2, 1001, 2048, torch.bfloat16, "per_token", torch.bfloat16, False),  # 8: last 16-bit warp D
    (2, 515, 2056, torch.bfloat16, "per_sample", torch.bfloat16, True),  # first 16-bit block-path D
    (2, 301, 1028, torch.float32, "per_token", torch.float32, False),  # first fp32 block-path D
    # Block kernels at <= 128 threads: 4 vectors per thread, N = 1, odd row counts.
    (1, 1, 3072, torch.bfloat16, "per_token", torch.float32, True),
    (3, 1023, 3072, torch.bfloat16, "per_sample", torch.bfloat16, False),
    (2, 300, 1540, torch.float32, "per_token", torch.float32, False),
    # Warp forward at 20 vectors per lane, for rows too wide for a 128-thread block (16-bit x:
    # D = 4104 ... 5120; fp32: 2052 ... 2560), and the block-path D on either side.
    (2, 777, 4096, torch.bfloat16, "per_sample", torch.float32, True),  # last block D below
    (2, 501, 4104, torch.bfloat16, "per_token", torch.bfloat16, False),  # first warp-20 D
    (3, 999, 5120, torch.bfloat16, "per_sample", torch.float32, False),  # Wan 14B
    (1, 333, 5128, torch.float16, "per_sample", torch.float16, True),  # first block D above
    (2, 301, 2052, torch.float32, "per_token", torch.float32, True),  # fp32 first warp-20 D
    (2, 403, 2560, torch.float32, "per_sample_2d", torch.float32, False),  # fp32 last warp-20 D
    (2, 257, 2564, torch.float32, "per_sample", torch.float32, False),  # fp32 first block D above
    # Backward rows in pairs: tiles of ceil(N / P) rows (P = resident blocks / B) and a shorter last
    # tile, so odd and even row counts per tile (a pair step and a lone-row step). On an H200
    # (132 SMs, nvcc 13.0 resources) the cases below have tiles of both parities (4 and 5 rows at
    # D = 5120; 1 and 4 at D = 16384); N = 1 has one row per tile.
    (2, 1195, 3072, torch.bfloat16, "per_sample", torch.bfloat16, False),
    (2, 799, 3080, torch.bfloat16, "per_token", torch.bfloat16, True),  # 3080: last vectors unowned
    (1, 1591, 3080, torch.bfloat16, "per_sample", torch.bfloat16, False),
    (1, 1199, 5120, torch.bfloat16, "per_sample", torch.bfloat16, False),
    (2, 205, 16384, torch.bfloat16, "per_token", torch.float32, False),
    (3, 799, 2056, torch.bfloat16, "per_token", torch.float32, False),
    (3, 799, 1028, torch.float32, "per_sample", torch.float32, True),
    (2, 799, 1540, torch.float32, "per_sample", torch.float32, False),
    (4, 1, 8192, torch.bfloat16, "per_sample_2d", torch.bfloat16, True),
    (3, 1, 1540, torch.float32, "per_token", torch.float32, False),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(str(v).replace("torch.", "") for v in c))
def test_fused_matches_fp64_reference(case):
    batch, seq, dim, x_dtype, mod_kind, mod_dtype, affine = case
    gen = torch.Generator(device="cuda").manual_seed(stable_seed(case))
    x, leaf, views, weight, bias = make_inputs(batch, seq, dim, x_dtype, mod_kind, mod_dtype, affine, gen)
    dy = torch.randn(batch, seq, dim, generator=gen, device="cuda").to(x_dtype)
    y, grads = run_fused(x, leaf, views, weight, bias, dy)
    y_ref, grads_ref = run_reference(x, leaf, views, weight, bias, dy)
    assert y.dtype == x_dtype and y.shape == x.shape
    errors = {"y": rel_err(y, y_ref)}
    for name, g, g_ref in zip(["dx", "dshift_dscale", "dweight", "dbias"], grads, grads_ref):
        errors[name] = rel_err(g, g_ref)
    tol = TOL[x_dtype]
    assert all(e <= tol for e in errors.values()), errors


def test_dshift_dscale_separately_per_sample():
    """dshift and dscale from separate leaves (not one chunked leaf), bf16 x with fp32 modulation."""
    gen = torch.Generator(device="cuda").manual_seed(5)
    x = torch.randn(2, 20000, 3072, generator=gen, device="cuda").bfloat16()
    shift = torch.randn(2, 1, 3072, generator=gen, device="cuda", requires_grad=True)
    scale = torch.randn(2, 1, 3072, generator=gen, device="cuda", requires_grad=True)
    dy = torch.randn_like(x)
    poison_allocator(1 << 28)
    dshift, dscale = torch.autograd.grad(adaln_modulate(x, shift, scale), (shift, scale), dy)
    rs, rc = shift.detach().double().requires_grad_(), scale.detach().double().requires_grad_()
    ref = F.layer_norm(x.double(), (3072,), eps=1e-6) * (1 + rc) + rs
    ref_dshift, ref_dscale = torch.autograd.grad(ref, (rs, rc), dy.double())
    assert rel_err(dshift, ref_dshift) <= 1e-5 and rel_err(dscale, ref_dscale) <= 1e-5


@pytest.mark.parametrize(
    "mod_kind, seq, dim", [("per_sample", 20000, 1536), ("per_token", 20000, 1536), ("per_sample", 3001, 5120)]
)
def test_gradients_are_bitwise_deterministic(mod_kind, seq, dim):
    """Two runs give bitwise-equal outputs and gradients at both backward block sizes (96 and 320 threads)."""
    gen = torch.Generator(device="cuda").manual_seed(23)
    x, leaf, views, weight, bias = make_inputs(2, seq, dim, torch.bfloat16, mod_kind, torch.float32, True, gen)
    dy = torch.randn_like(x)
    y1, g1 = run_fused(x, leaf, views, weight, bias, dy)
    y2, g2 = run_fused(x, leaf, views, weight, bias, dy)
    assert torch.equal(y1, y2)
    assert all(torch.equal(a, b) for a, b in zip(g1, g2))


def test_opcheck_compiled_kernels_including_row_strided_x():
    """The kernels' outputs have the shapes, strides and dtypes the fake kernels promise (a
    row-strided x is copied to contiguous rows first), and autograd/compile registration hold."""
    gen = torch.Generator(device="cuda").manual_seed(41)
    x = torch.randn(2, 64, 256, generator=gen, device="cuda")
    x_rows = torch.randn(64, 2, 256, generator=gen, device="cuda").transpose(0, 1)  # (B, N, D), row strides
    e = torch.randn(2, 6, 256, generator=gen, device="cuda")
    tok = torch.randn(2, 64, 512, generator=gen, device="cuda")
    w, b = torch.randn(256, generator=gen, device="cuda"), torch.randn(256, generator=gen, device="cuda")
    samples = [
        (x, e[:, 0:1], e[:, 1:2], None, None, 1e-6),
        (x_rows.bfloat16(), e[:, 0:1], e[:, 1:2], w, b, 1e-6),
        (x_rows, tok[..., :256], tok[..., 256:], w, None, 1e-5),
    ]
    for args in samples:
        leaves = tuple(a.clone().requires_grad_() if isinstance(a, torch.Tensor) else a for a in args)
        torch.library.opcheck(torch.ops.adaptiveload.adaln_fwd, leaves)
        xx, _, scale, ww, bb, _ = args
        _, mean, rstd = torch.ops.adaptiveload.adaln_fwd(*args)
        torch.library.opcheck(torch.ops.adaptiveload.adaln_bwd, (torch.randn_like(xx), xx, scale, ww, bb, mean, rstd))

def test_nan_in_x_stays_in_its_row():
    x = torch.randn(1, 64, 1536, device="cuda").bfloat16()
    x[0, 5, 100] = float("nan")
    y = adaln_modulate(x, torch.zeros(1, 1536, device="cuda"), torch.zeros(1, 1536, device="cuda"))
    assert y[0, 5].isnan().all() and not y[0, torch.arange(64) != 5].isnan().any()


def test_bad_device_raises_before_launch():
    x = torch.randn(2, 8, 64, device="cuda")
    with pytest.raises(ValueError, match="shift is on cpu"):
        adaln_modulate(x, torch.randn(2, 64), torch.randn(2, 64, device="cuda"))


class _Block(torch.nn.Module):
    """Wan-style: (B, 6, D) modulation from a time embedding, chunked views, fused AdaLN."""

    def __init__(self, dim):
        super().__init__()
        self.time_proj = torch.nn.Linear(dim, 6 * dim)
        self.norm = FusedAdaLN(dim, elementwise_affine=True)
        self.proj = torch.nn.Linear(dim, dim)

    def forward(self, x, t):
        e = self.time_proj(t).unflatten(-1, (6, -1)).float()
        shift, scale = e[:, 0:1], e[:, 1:2]
        return self.proj(self.norm(x, shift, scale))


def test_torch_compile_fullgraph_matches_eager():
    torch.manual_seed(31)
    block = _Block(1536).cuda()
    x = torch.randn(2, 4096, 1536, device="cuda").bfloat16().requires_grad_()
    t = torch.randn(2, 1536, device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        eager = block(x, t)
        (g_eager,) = torch.autograd.grad(eager.float().square().sum(), x)
        compiled = torch.compile(block, fullgraph=True)
        out = compiled(x, t)
        (g_comp,) = torch.autograd.grad(out.float().square().sum(), x)
    assert rel_err(out, eager) <= 1e-2 and rel_err(g_comp, g_eager) <= 1e-2


def test_inside_fsdp_with_bf16_mixed_precision():
    import torch.distributed as dist
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import MixedPrecision

    # An in-memory store: no TCP port, so concurrent runs on one host cannot collide.
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1)
    try:
        torch.manual_seed(37)
        reference = _Block(1024).cuda()
        sharded = _Block(1024).cuda()
        sharded.load_state_dict(reference.state_dict())
        bf16 = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, buffer_dtype=torch.bfloat16)
        sharded = FSDP(sharded, mixed_precision=bf16, use_orig_params=True)
        x = torch.randn(2, 2048, 1024, device="cuda")
        t = torch.randn(2, 1024, device="cuda")
        out = sharded(x, t)
        out.float().square().mean().backward()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            ref = reference(x, t)
        ref.float().square().mean().backward()
        assert rel_err(out, ref) <= 2e-2
        grads = {n.replace("_fsdp_wrapped_module.", ""): p.grad for n, p in sharded.named_parameters()}
        for name, p in reference.named_parameters():
            assert rel_err(grads[name], p.grad) <= 5e-2, name
    finally:
        dist.destroy_process_group()


# The eager path: adaln_modulate calls the extension's C++ autograd function (adaln_eager); the
# torch.library custom op serves torch.compile, tracers and dispatch modes. Same kernels on both.


def test_ensure_extension_reports_the_kernels(capsys):
    assert ops.ensure_extension().startswith("cuda:")
    assert "AdaLN backend: cuda:" in capsys.readouterr().err


def _is_cpp_node(y):
    node = y.grad_fn
    if y.dim() == 2:  # 2-D x: the op's (1, N, D) output is viewed back as (N, D)
        node = node.next_functions[0][0]
    return "AdaLNFunction" in node.name()


@pytest.mark.parametrize(
    "case",
    [
        (2, 777, 1536, torch.bfloat16, "per_sample", torch.float32, False),
        (2, 300, 5120, torch.float16, "per_sample_2d", torch.float16, True),
        (3, 100, 17, torch.float32, "per_token", torch.float32, True),
        (2, 4097, 1536, torch.bfloat16, "misaligned", torch.bfloat16, False),
    ],
    ids=lambda c: "-".join(str(v).replace("torch.", "") for v in c),
)
def test_cpp_autograd_path_matches_fp64_and_equals_the_custom_op_bitwise(case, monkeypatch):
    from lightning_adaptiveload.ops import adaln

    batch, seq, dim, x_dtype, mod_kind, mod_dtype, affine = case
    gen = torch.Generator(device="cuda").manual_seed(stable_seed(case))
    x, leaf, views, weight, bias = make_inputs(batch, seq, dim, x_dtype, mod_kind, mod_dtype, affine, gen)
    dy = torch.randn(batch, seq, dim, generator=gen, device="cuda").to(x_dtype)
    y, grads = run_fused(x, leaf, views, weight, bias, dy)
    assert _is_cpp_node(y)
    y_ref, grads_ref = run_reference(x, leaf, views, weight, bias, dy)
    errors = [rel_err(y, y_ref)] + [rel_err(g, r) for g, r in zip(grads, grads_ref)]
    assert all(e <= TOL[x_dtype] for e in errors), errors
    monkeypatch.setattr(adaln, "_eager_kernels", lambda x: None)  # force the custom op
    y_op, grads_op = run_fused(x, leaf, views, weight, bias, dy)
    assert not _is_cpp_node(y_op)
    assert torch.equal(y, y_op) and all(torch.equal(a, b) for a, b in zip(grads, grads_op))


def test_cpp_autograd_path_2d_x():
    gen = torch.Generator(device="cuda").manual_seed(43)
    x = torch.randn(300, 1536, generator=gen, device="cuda").bfloat16().requires_grad_()
    shift, scale = (torch.randn(1536, generator=gen, device="cuda").requires_grad_() for _ in range(2))
    y = adaln_modulate(x, shift, scale)
    assert y.shape == x.shape and _is_cpp_node(y)
    dy = torch.randn_like(x)
    grads = torch.autograd.grad(y, (x, shift, scale), dy)
    leaves = [t.detach().double().requires_grad_() for t in (x, shift, scale)]
    ref = F.layer_norm(leaves[0], (1536,), eps=1e-6) * (1 + leaves[2]) + leaves[1]
    grads_ref = torch.autograd.grad(ref, leaves, dy.double())
    assert rel_err(y, ref) <= 1e-2 and all(rel_err(g, r) <= 1e-2 for g, r in zip(grads, grads_ref))


def test_compiled_fullgraph_and_eager_cpp_path_match_fp64():
    """Values and every gradient, eager (C++ autograd) and torch.compile(fullgraph=True) (custom op)."""
    torch._dynamo.reset()
    gen = torch.Generator(device="cuda").manual_seed(47)
    dim = 1536
    x = torch.randn(2, 2048, dim, generator=gen, device="cuda").bfloat16()
    e = 0.5 * torch.randn(2, 6, dim, generator=gen, device="cuda")
    w, b = 1 + 0.3 * torch.randn(dim, generator=gen, device="cuda"), 0.3 * torch.randn(dim, generator=gen, device="cuda")
    dy = torch.randn(x.shape, generator=gen, device="cuda").bfloat16()

    def f(x, e, w, b):
        shift, scale = e.chunk(6, dim=1)[:2]
        return adaln_modulate(x, shift, scale, w, b)

    leaves_ref = [t.detach().double().requires_grad_() for t in (x, e, w, b)]
    shift, scale = leaves_ref[1].chunk(6, dim=1)[:2]
    ref = F.layer_norm(leaves_ref[0], (dim,), leaves_ref[2], leaves_ref[3], 1e-6) * (1 + scale) + shift
    grads_ref = torch.autograd.grad(ref, leaves_ref, dy.double())
    for fn in (f, torch.compile(f, fullgraph=True)):  # fullgraph: a graph break would raise
        leaves = [t.detach().clone().requires_grad_() for t in (x, e, w, b)]
        y = fn(*leaves)
        assert _is_cpp_node(y) == (fn is f)
        grads = torch.autograd.grad(y, leaves, dy)
        errors = [rel_err(y, ref)] + [rel_err(g, r) for g, r in zip(grads, grads_ref)]
        assert all(err <= 1e-2 for err in errors), (fn, errors)


def test_create_graph_then_double_backward_raises():
    gen = torch.Generator(device="cuda").manual_seed(53)
    x = torch.randn(2, 64, 256, generator=gen, device="cuda", requires_grad=True)
    e = torch.randn(2, 6, 256, generator=gen, device="cuda", requires_grad=True)
    dy = torch.randn(2, 64, 256, generator=gen, device="cuda")
    plain = torch.autograd.grad(adaln_modulate(x, e[:, 0], e[:, 1]), (x, e), dy)
    y = adaln_modulate(x, e[:, 0], e[:, 1])
    assert _is_cpp_node(y)
    graphed = torch.autograd.grad(y, (x, e), dy, create_graph=True)
    assert all(torch.equal(a, b) for a, b in zip(plain, graphed))
    with pytest.raises(NotImplementedError, match="no second derivative"):
        graphed[0].sum().backward()


def test_dispatch_mode_takes_the_custom_op_with_the_same_results():
    from torch.utils.flop_counter import FlopCounterMode

    gen = torch.Generator(device="cuda").manual_seed(59)
    x = torch.randn(2, 64, 512, generator=gen, device="cuda", requires_grad=True)
    e = torch.randn(2, 6, 512, generator=gen, device="cuda")
    y = adaln_modulate(x, e[:, 0:1], e[:, 1:2])
    with FlopCounterMode(display=False):
        y_mode = adaln_modulate(x, e[:, 0:1], e[:, 1:2])
    assert _is_cpp_node(y) and not _is_cpp_node(y_mode) and torch.equal(y, y_mode)


def test_activation_checkpointing_on_the_cpp_path():
    from torch.utils.checkpoint import checkpoint

    gen = torch.Generator(device="cuda").manual_seed(61)
    x = torch.randn(2, 256, 1536, generator=gen, device="cuda").bfloat16().requires_grad_()
    e = torch.randn(2, 6, 1536, generator=gen, device="cuda", requires_grad=True)
    dy = torch.randn(2, 256, 1536, generator=gen, device="cuda")  # f returns fp32

    def f(x, e):
        return adaln_modulate(x, *e.chunk(6, dim=1)[:2]).float().sin()

    def grads(out):
        x.grad = e.grad = None
        out.backward(dy)  # reentrant checkpointing supports .backward() only
        return x.grad, e.grad

    plain = grads(f(x, e))
    for reentrant in (False, True):
        ckpt = grads(checkpoint(f, x, e, use_reentrant=reentrant))
        assert all(torch.equal(a, b) for a, b in zip(plain, ckpt)), reentrant


def test_cuda_graph_capture_and_replay_of_forward_backward():
    gen = torch.Generator(device="cuda").manual_seed(67)
    x = torch.randn(1, 4096, 1536, generator=gen, device="cuda").bfloat16().requires_grad_()
    e = torch.randn(1, 6, 1536, generator=gen, device="cuda", requires_grad=True)
    dy = torch.randn(1, 4096, 1536, generator=gen, device="cuda").bfloat16()

    def step():
        y = adaln_modulate(x, *e.chunk(6, dim=1)[:2])
        return (y,) + torch.autograd.grad(y, (x, e), dy)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # warm-up outside capture, as CUDA graphs require
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    with torch.no_grad():
        x.copy_(torch.randn(x.shape, generator=gen, device="cuda"))
        e.copy_(torch.randn(e.shape, generator=gen, device="cuda"))
    graph.replay()
    expected = step()
    assert all(torch.equal(a, b) for a, b in zip(captured, expected))

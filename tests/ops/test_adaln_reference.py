"""CPU tests of the AdaLN op (reference path): values and gradients against an independent fp64
formula (F.layer_norm in fp64), fp64 gradcheck, layouts/dtypes/strides, custom-op registration
(opcheck, fake tensors, torch.compile) and input validation."""
import pytest
import torch
import torch.nn.functional as F

from lightning_adaptiveload.ops.modules import FusedAdaLN
from lightning_adaptiveload.ops import adaln_modulate, backend
from tests.helpers.seeds import stable_seed


def formula_fp64(x, shift, scale, weight, bias, eps):
    """Independent formula: torch's LayerNorm in fp64, then modulate with broadcasting."""
    d = x.shape[-1]
    w = None if weight is None else weight.double()
    b = None if bias is None else bias.double()
    if x.dim() == 3 and shift.dim() == 2:  # per-sample (B, D) broadcasts over the sequence
        shift, scale = shift[:, None], scale[:, None]
    return F.layer_norm(x.double(), (d,), w, b, eps) * (1 + scale.double()) + shift.double()


def rel_err(a, ref):
    return ((a.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30)).item()


def make_leaf(kind, batch, seq, dim, gen):
    """Random tensor the model would produce; views_of(kind, leaf) gives (shift, scale)."""
    if kind in ("per_sample_2d", "per_sample_chunk"):  # a (B, 6, D) time embedding
        return torch.randn(batch, 6, dim, generator=gen)
    if kind == "per_token_chunk":
        return torch.randn(batch, seq, 2 * dim, generator=gen)
    return torch.randn(2, batch, seq, dim, generator=gen)


def views_of(kind, leaf):
    if kind == "per_sample_2d":  # e[:, k]: (B, D), row stride 6D
        return leaf[:, 0], leaf[:, 1]
    if kind == "per_sample_chunk":  # Wan: e.chunk(6, dim=1): (B, 1, D) views
        chunks = leaf.chunk(6, dim=1)
        return chunks[0], chunks[1]
    if kind == "per_token_chunk":  # (B, N, 2D).chunk(2, -1): row stride 2D
        return leaf.chunk(2, dim=-1)
    return leaf[0], leaf[1]  # per token, contiguous


MOD_KINDS = ["per_sample_2d", "per_sample_chunk", "per_token_chunk", "per_token_contiguous"]


@pytest.mark.parametrize("kind", MOD_KINDS)
@pytest.mark.parametrize("affine", [False, True])
@pytest.mark.parametrize("shape", [(2, 7, 33), (3, 1, 16), (1, 20, 8)])
def test_fp32_values_and_grads_match_fp64_formula(kind, affine, shape):
    gen = torch.Generator().manual_seed(stable_seed((kind, affine, shape)))
    batch, seq, dim = shape
    x = (torch.randn(shape, generator=gen) * 3 + 1).requires_grad_()
    leaf = make_leaf(kind, batch, seq, dim, gen).requires_grad_()
    shift, scale = views_of(kind, leaf)
    weight = (torch.randn(dim, generator=gen) + 1).requires_grad_() if affine else None
    bias = torch.randn(dim, generator=gen).requires_grad_() if affine else None
    dy = torch.randn(shape, generator=gen)

    y = adaln_modulate(x, shift, scale, weight, bias, eps=1e-5)
    inputs = [t for t in (x, leaf, weight, bias) if t is not None]
    grads = torch.autograd.grad(y, inputs, dy)

    ref_inputs = [t.detach().double().requires_grad_() for t in inputs]
    rx, rleaf = ref_inputs[0], ref_inputs[1]
    rshift, rscale = views_of(kind, rleaf)
    rw, rb = (ref_inputs[2], ref_inputs[3]) if affine else (None, None)
    ref = formula_fp64(rx, rshift, rscale, rw, rb, 1e-5)
    ref_grads = torch.autograd.grad(ref, ref_inputs, dy.double())

    assert y.dtype == torch.float32 and y.shape == x.shape
    assert rel_err(y, ref) <= 1e-5
    for name, g, rg in zip(["dx", "dmod", "dweight", "dbias"], grads, ref_grads):
        assert rel_err(g, rg) <= 1e-5, name


@pytest.mark.parametrize("x_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("mod_dtype", ["x", torch.float32])
@pytest.mark.parametrize("affine", [False, True])
def test_low_precision_matches_fp64_formula(x_dtype, mod_dtype, affine):
    gen = torch.Generator().manual_seed(7)
    batch, seq, dim = 2, 9, 40
    mod_dtype = x_dtype if mod_dtype == "x" else mod_dtype
    x = torch.randn(batch, seq, dim, generator=gen).to(x_dtype).requires_grad_()
    leaf = (0.5 * torch.randn(batch, 6, dim, generator=gen)).to(mod_dtype).requires_grad_()
    weight = (torch.randn(dim, generator=gen) + 1).to(x_dtype).requires_grad_() if affine else None
    bias = torch.randn(dim, generator=gen).to(x_dtype).requires_grad_() if affine else None
    dy = torch.randn(batch, seq, dim, generator=gen).to(x_dtype)

    y = adaln_modulate(x, leaf[:, 0], leaf[:, 1], weight, bias)
    inputs = [t for t in (x, leaf, weight, bias) if t is not None]
    grads = torch.autograd.grad(y, inputs, dy)
    ref_inputs = [t.detach().double().requires_grad_() for t in inputs]
    rw, rb = (ref_inputs[2], ref_inputs[3]) if affine else (None, None)
    ref = formula_fp64(ref_inputs[0], ref_inputs[1][:, 0], ref_inputs[1][:, 1], rw, rb, 1e-6)
    ref_grads = torch.autograd.grad(ref, ref_inputs, dy.double())

    assert y.dtype == x_dtype
    assert rel_err(y, ref) <= 1e-2
    for g, t, rg in zip(grads, inputs, ref_grads):
        assert g.dtype == t.dtype
        assert rel_err(g, rg) <= 1e-2


def test_wan_style_fp32_modulation_matches_within_one_rounding():
    """bf16 x, fp32 (B,1,D) chunk views: Wan 2.1's (norm_fp32(x.float())*(1+scale)+shift).type_as(x)."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(2, 50, 64, generator=gen).bfloat16()
    e = torch.randn(2, 6, 64, generator=gen)
    shift, scale = e.chunk(6, dim=1)[:2]
    y = adaln_modulate(x, shift, scale)
    wan = (F.layer_norm(x.float(), (64,), eps=1e-6) * (1 + scale) + shift).type_as(x)
    exact = formula_fp64(x, shift, scale, None, None, 1e-6)
    ulp = torch.finfo(torch.bfloat16).eps * exact.abs() + 1e-6
    assert ((y.double() - wan.double()).abs() <= ulp).all()
    assert (y != wan).float().mean() < 0.02  # only rounding-boundary ties differ


@pytest.mark.parametrize("mod_shape", ["d", "1d", "nd"])
def test_2d_x(mod_shape):
    gen = torch.Generator().manual_seed(5)
    n, d = 6, 24
    x = torch.randn(2 * n, d, generator=gen)[::2]  # row-strided view, unit inner stride
    shapes = {"d": (d,), "1d": (1, d), "nd": (n, d)}
    shift = torch.randn(shapes[mod_shape], generator=gen)
    scale = torch.randn(shapes[mod_shape], generator=gen)
    y = adaln_modulate(x, shift, scale)
    assert y.shape == (n, d)
    assert rel_err(y, formula_fp64(x, shift, scale, None, None, 1e-6)) <= 1e-5


def test_mixed_modulation_dtypes_are_upcast_exactly():
    gen = torch.Generator().manual_seed(9)
    x = torch.randn(2, 5, 16, generator=gen)
    shift = torch.randn(2, 16, generator=gen).bfloat16()
    scale = torch.randn(2, 16, generator=gen).half()
    y = adaln_modulate(x, shift, scale)
    ref = formula_fp64(x, shift, scale, None, None, 1e-6)
    assert rel_err(y, ref) <= 1e-5


@pytest.mark.parametrize("per_token", [False, True])
@pytest.mark.parametrize("affine", [False, True])
def test_gradcheck_fp64(per_token, affine):
    """Analytic backward (adaln_bwd) against finite differences, through the registered op."""
    gen = torch.Generator().manual_seed(11)
    b, n, d = 2, 3, 5
    x = torch.randn(b, n, d, generator=gen, dtype=torch.float64, requires_grad=True)
    m = n if per_token else 1
    shift = torch.randn(b, m, d, generator=gen, dtype=torch.float64, requires_grad=True)
    scale = torch.randn(b, m, d, generator=gen, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(d, generator=gen, dtype=torch.float64, requires_grad=True) if affine else None
    bias = torch.randn(d, generator=gen, dtype=torch.float64, requires_grad=True) if affine else None

    def fn(x, shift, scale, *params):
        w, bb = params if affine else (None, None)
        return torch.ops.adaptiveload.adaln_fwd(x, shift, scale, w, bb, 1e-5)[0]

    args = (x, shift, scale) + ((weight, bias) if affine else ())
    assert torch.autograd.gradcheck(fn, args)


def _op_samples():
    gen = torch.Generator().manual_seed(13)
    x = torch.randn(2, 4, 8, generator=gen)
    e = torch.randn(2, 6, 8, generator=gen)
    w, bias = torch.randn(8, generator=gen), torch.randn(8, generator=gen)
    tok = torch.randn(2, 4, 16, generator=gen)
    # row-strided (B, N, D) views, e.g. a (N, B, D) buffer transposed: the kernels return
    # contiguous outputs, so must the reference (the fake kernels say so)
    x_rows = torch.randn(4, 2, 8, generator=gen).transpose(0, 1)
    tok_rows = torch.randn(4, 2, 16, generator=gen).transpose(0, 1)
    return [
        (x, e[:, 0:1], e[:, 1:2], None, None, 1e-6),
        (x.bfloat16(), e[:, 0:1], e[:, 1:2], w, bias, 1e-6),
        (x, tok[..., :8], tok[..., 8:], w, None, 1e-5),
        (x_rows, e[:, 0:1], e[:, 1:2], None, bias, 1e-6),
        (x_rows.bfloat16(), tok_rows[..., :8], tok_rows[..., 8:], w, bias, 1e-6),
    ]


def test_opcheck_forward_and_backward():
    """Schema, fake (meta) kernels, autograd registration and dispatch consistency."""
    for args in _op_samples():
        args = tuple(a.clone().requires_grad_() if isinstance(a, torch.Tensor) else a for a in args)
        torch.library.opcheck(torch.ops.adaptiveload.adaln_fwd, args)
        x, shift, scale, w, bias, eps = (a.detach() if isinstance(a, torch.Tensor) else a for a in args)
        y, mean, rstd = torch.ops.adaptiveload.adaln_fwd(x, shift, scale, w, bias, eps)
        dy = torch.randn_like(x)  # x's strides: row-strided for the row-strided samples
        torch.library.opcheck(torch.ops.adaptiveload.adaln_bwd, (dy, x, scale, w, bias, mean, rstd))


def test_fake_tensor_shape_propagation():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        x = torch.empty(3, 1000, 64, dtype=torch.bfloat16)
        e = torch.empty(3, 6, 64)
        y = adaln_modulate(x, *e.chunk(6, dim=1)[:2])
        assert y.shape == (3, 1000, 64) and y.dtype == torch.bfloat16
        y2 = adaln_modulate(x[0], torch.empty(64), torch.empty(64))
        assert y2.shape == (1000, 64)


class _Block(torch.nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.mod = torch.nn.Linear(dim, 2 * dim)
        self.norm = FusedAdaLN(dim, elementwise_affine=True)
        self.proj = torch.nn.Linear(dim, dim)

    def forward(self, x, t):
        shift, scale = self.mod(t).unsqueeze(1).chunk(2, dim=-1)
        return self.proj(self.norm(x, shift, scale))


def test_torch_compile_fullgraph_matches_eager():
    torch.manual_seed(17)
    block = _Block(16)
    x, t = torch.randn(2, 5, 16, requires_grad=True), torch.randn(2, 16)
    eager = block(x, t)
    (g_eager,) = torch.autograd.grad(eager.square().sum(), x)
    compiled = torch.compile(block, fullgraph=True)
    out = compiled(x, t)
    (g_comp,) = torch.autograd.grad(out.square().sum(), x)
    assert rel_err(out, eager) <= 1e-6 and rel_err(g_comp, g_eager) <= 1e-6


def test_fused_adaln_loads_layernorm_state_dict():
    gen = torch.Generator().manual_seed(19)
    ln = torch.nn.LayerNorm(12, eps=1e-6)
    with torch.no_grad():
        ln.weight.copy_(torch.randn(12, generator=gen))
        ln.bias.copy_(torch.randn(12, generator=gen))
    fused = FusedAdaLN(12, eps=1e-6, elementwise_affine=True)
    fused.load_state_dict(ln.state_dict())
    x, shift, scale = (torch.randn(2, 3, 12, generator=gen) for _ in range(3))
    ref = ln(x) * (1 + scale) + shift
    assert rel_err(fused(x, shift, scale), ref) <= 1e-6
    assert set(FusedAdaLN(12).state_dict()) == set()


def test_fused_adaln_meta_device_init_like_layernorm():
    """FSDP materializes meta-device modules with to_empty + reset_parameters (as for nn.LayerNorm)."""
    with torch.device("meta"):
        fused = FusedAdaLN(12, elementwise_affine=True)
    fused.to_empty(device="cpu")
    with torch.no_grad():
        fused.weight.fill_(float("nan"))  # what uninitialized memory could hold
    fused.reset_parameters()
    ln = torch.nn.LayerNorm(12, eps=1e-6)
    gen = torch.Generator().manual_seed(23)
    x, shift, scale = (torch.randn(2, 3, 12, generator=gen) for _ in range(3))
    assert rel_err(fused(x, shift, scale), ln(x) * (1 + scale) + shift) <= 1e-6
    FusedAdaLN(12).reset_parameters()  # no parameters: nothing to do, no error

def test_backend_reports_reference_on_cpu_only_machine():
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    assert backend().startswith("reference:")


@pytest.mark.parametrize(
    "x_shape, shift_shape, scale_shape, match",
    [
        ((2, 3, 8, 1), (2, 8), (2, 8), "x must be"),
        ((8,), (8,), (8,), "x must be"),
        ((2, 3, 0), (2, 0), (2, 0), r"last dim \(D\) >= 1"),
        ((2, 3, 8), (2, 7), (2, 8), r"shift has shape \(2, 7\)"),
        ((2, 3, 8), (2, 8), (3, 8), r"scale has shape \(3, 8\)"),
        ((2, 3, 8), (2, 2, 8), (2, 2, 8), r"shift has shape \(2, 2, 8\)"),
        ((2, 3, 8), (2, 8), (2, 3, 8), "same shape"),
        ((3, 8), (2, 8), (2, 8), r"shift has shape \(2, 8\)"),
    ],
)
def test_bad_shapes_raise_naming_argument(x_shape, shift_shape, scale_shape, match):
    with pytest.raises(ValueError, match=match):
        adaln_modulate(torch.randn(x_shape), torch.randn(shift_shape), torch.randn(scale_shape))


def test_bad_strides_dtypes_devices_and_params():
    x = torch.randn(2, 3, 8)
    shift, scale = torch.randn(2, 8), torch.randn(2, 8)
    with pytest.raises(ValueError, match="x must have unit stride"):
        adaln_modulate(torch.randn(2, 8, 3).transpose(1, 2), shift, scale)
    with pytest.raises(ValueError, match="scale must have unit stride"):
        adaln_modulate(x, shift, torch.randn(8, 2).t())
    with pytest.raises(ValueError, match="x has dtype torch.int64"):
        adaln_modulate(x.long(), shift, scale)
    with pytest.raises(ValueError, match=r"weight has shape \(7,\)"):
        adaln_modulate(x, shift, scale, weight=torch.randn(7))
    with pytest.raises(ValueError, match="shift is on meta"):
        adaln_modulate(x, shift.to("meta"), scale)
    with pytest.raises(ValueError, match="eps must be > 0"):
        adaln_modulate(x, shift, scale, eps=0.0)
    with pytest.raises(ValueError, match="shift must be a torch.Tensor, got NoneType"):
        adaln_modulate(x, None, scale)
    with pytest.raises(ValueError, match="x must be a torch.Tensor, got list"):
        adaln_modulate([[1.0]], shift, scale)


def test_nan_in_x_propagates_to_its_row_only():
    x = torch.randn(1, 4, 8)
    x[0, 2, 3] = float("nan")
    y = adaln_modulate(x, torch.randn(1, 8), torch.randn(1, 8))
    assert y[0, 2].isnan().all() and not y[0, [0, 1, 3]].isnan().any()


def test_loader_falls_back_to_reference_with_a_reason(monkeypatch):
    """With a GPU but neither the prebuilt module nor JIT allowed, backend() says why."""
    import sys

    from lightning_adaptiveload.ops import extension

    monkeypatch.setattr(extension, "_state", {})
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setitem(sys.modules, "lightning_adaptiveload._C", None)  # import fails
    monkeypatch.setenv("ADAPTIVELOAD_NO_JIT", "1")
    with pytest.warns(RuntimeWarning, match="CUDA tensors run the AdaLN reference: prebuilt extension missing"):
        module, why = extension.load_extension()
    assert module is None
    assert why.startswith("reference: prebuilt extension missing") and "ADAPTIVELOAD_NO_JIT" in why
    assert extension.load_extension() == (module, why)  # decided once: no second warning, same answer


def test_eager_calls_take_the_extension_path_and_compile_takes_the_custom_op(monkeypatch):
    """Routing of adaln_modulate: with kernels for x's device, eager calls go to the extension's
    adaln_eager (C++ autograd); when it declines (returns None: a tracer or mode is active) the
    custom op runs; torch.compile never calls it and traces the custom op without a graph break."""
    from lightning_adaptiveload.ops import adaln

    calls = []

    class FakeExtension:
        decline = False

        @staticmethod
        def adaln_eager(x, shift, scale, weight, bias, eps):
            calls.append((tuple(x.shape), tuple(shift.shape), weight is None, eps))
            if FakeExtension.decline:
                return None
            return torch.ops.adaptiveload.adaln_fwd(x, shift, scale, weight, bias, eps)[0]

    monkeypatch.setattr(adaln, "_eager_kernels", lambda x: FakeExtension)
    gen = torch.Generator().manual_seed(29)
    x, e = torch.randn(2, 5, 16, generator=gen), torch.randn(2, 6, 16, generator=gen)
    ref = formula_fp64(x, e[:, 0], e[:, 1], None, None, 1e-6)
    y = adaln_modulate(x, e[:, 0], e[:, 1])  # (B, D) views arrive as (B, 1, D), eps as a float
    assert calls == [((2, 5, 16), (2, 1, 16), True, 1e-6)] and rel_err(y, ref) <= 1e-6
    y2 = adaln_modulate(x[0], e[0, 0], e[0, 1])  # 2-D x: called as (1, N, D), returned as (N, D)
    assert calls[-1][:2] == ((1, 5, 16), (1, 1, 16)) and y2.shape == (5, 16)
    FakeExtension.decline = True
    y3 = adaln_modulate(x, e[:, 0], e[:, 1])
    assert len(calls) == 3 and rel_err(y3, ref) <= 1e-6

    calls.clear()
    torch._dynamo.reset()
    block = _Block(16)
    xx, t = torch.randn(2, 5, 16, generator=gen, requires_grad=True), torch.randn(2, 16, generator=gen)
    compiled = torch.compile(block, fullgraph=True)  # fullgraph: a graph break would raise
    out = compiled(xx, t)
    (g_comp,) = torch.autograd.grad(out.square().sum(), xx)
    assert calls == []
    monkeypatch.setattr(adaln, "_eager_kernels", lambda x: None)
    eager = block(xx, t)
    (g_eager,) = torch.autograd.grad(eager.square().sum(), xx)
    assert rel_err(out, eager) <= 1e-6 and rel_err(g_comp, g_eager) <= 1e-6


def test_create_graph_gives_first_order_grads_and_double_backward_raises():
    """The C++ eager path (GPU tests) mirrors this: no silent zero second derivative."""
    gen = torch.Generator().manual_seed(31)
    x = torch.randn(2, 3, 8, generator=gen, requires_grad=True)
    shift, scale = (torch.randn(2, 8, generator=gen) for _ in range(2))
    y = adaln_modulate(x, shift, scale)
    (g,) = torch.autograd.grad(y.square().sum(), x, create_graph=True)
    xr = x.detach().double().requires_grad_()
    (g_ref,) = torch.autograd.grad(formula_fp64(xr, shift, scale, None, None, 1e-6).square().sum(), xr)
    assert rel_err(g, g_ref) <= 1e-5
    with pytest.raises(RuntimeError, match="no autograd formula"):
        g.sum().backward()

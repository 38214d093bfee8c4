"""The idiom recogniser on DiT blocks written as users write them (one idiom per block) and on
look-alikes that are not AdaLN: exactly the AdaLN sites are fused, outputs and gradients equal
eager (fp32) and an fp64 run of the original; first-call verification, RNG and fallbacks.

The forwards below contain no `assert`: pytest rewrites asserts in test modules, and the
recogniser refuses code whose source is not what was loaded."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from tests.helpers.surgery import Attention, cast_inputs, check_fp32, grad_floor, patched_copy, rel_err, run

from lightning_adaptiveload.surgery import apply_fused_adaln, core, verify

D, HEADS = 16, 2


def attention() -> Attention:
    return Attention(D, HEADS)


def mlp(dim: int = D) -> nn.Sequential:
    return nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(approximate="tanh"), nn.Linear(2 * dim, dim))


# --- the AdaLN idioms ----------------------------------------------------------------------------------
class PlainBlock(nn.Module):
    """`norm(x) * (1 + scale) + shift`, shift/scale from `chunk` of an embedding, both operand orders,
    a non-affine and an affine norm (eps 1e-6 and the default 1e-5)."""

    def __init__(self):
        super().__init__()
        self.norm1 = nn.LayerNorm(D, elementwise_affine=False, eps=1e-6)
        self.norm2 = nn.LayerNorm(D)
        self.attn, self.mlp = attention(), mlp()
        self.ada = nn.Sequential(nn.SiLU(), nn.Linear(D, 6 * D))

    def forward(self, x, c):
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = self.ada(c).chunk(6, dim=1)
        h = self.norm1(x) * (1 + scale_msa.unsqueeze(1)) + shift_msa.unsqueeze(1)
        x = x + gate_msa.unsqueeze(1) * self.attn(h)
        h = shift_mlp[:, None] + (1.0 + scale_mlp[:, None]) * self.norm2(x)
        return x + gate_mlp[:, None] * self.mlp(h)


class AddcmulBlock(nn.Module):
    """`torch.addcmul(shift, norm(x), 1 + scale)` and the method form `shift.addcmul(...)`."""

    def __init__(self):
        super().__init__()
        self.norm1 = nn.LayerNorm(D, elementwise_affine=False, eps=1e-6)
        self.norm2 = nn.LayerNorm(D, elementwise_affine=False, eps=1e-6)
        self.attn, self.mlp = attention(), mlp()
        self.ada = nn.Linear(D, 4 * D)

    def forward(self, x, c):
        shift1, scale1, shift2, scale2 = self.ada(c)[:, None].chunk(4, dim=-1)
        x = x + self.attn(torch.addcmul(shift1, self.norm1(x), 1 + scale1))
        return x + self.mlp(shift2.addcmul(1 + scale2, self.norm2(x)))


def modulate(x, shift, scale):
    """The original DiT's helper."""
    return x * (1 + scale.unsqueeze(1)) + shift.unsqueeze(1)


class HelperBlock(nn.Module):
    """A `modulate()` helper (positional and keyword calls) and a method helper."""

    def __init__(self):
        super().__init__()
        self.norm1 = nn.LayerNorm(D, elementwise_affine=False, eps=1e-6)
        self.norm2 = nn.LayerNorm(D, elementwise_affine=False, eps=1e-6)
        self.norm3 = nn.LayerNorm(D, elementwise_affine=False, eps=1e-6)
        self.attn, self.mlp, self.out = attention(), mlp(), nn.Linear(D, D)
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(D, 8 * D))

    def _modulate(self, h, shift, scale):
        return h * (1 + scale[:, None]) + shift[:, None]

    def forward(self, x, c):
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp, shift, scale = (
            self.adaLN_modulation(c).chunk(8, dim=1))
        x = x + gate_msa.unsqueeze(1) * self.attn(modulate(self.norm1(x), shift_msa, scale_msa))
        x = x + gate_mlp.unsqueeze(1) * self.mlp(modulate(self.norm2(x), scale=scale_mlp, shift=shift_mlp))
        return self.out(self._modulate(self.norm3(x), shift, scale))


class WanStyleBlock(nn.Module):
    """Wan 2.1's fp32 modulation: `(norm(x.float()) * (1 + scale) + shift).type_as(x)`, `.to(torch.float32)`
    / `.to(x.dtype)`, a norm output kept in a variable, and `F.layer_norm` with a closure eps."""

    def __init__(self):
        super().__init__()
        self.norm1 = nn.LayerNorm(D, elementwise_affine=False, eps=1e-6)
        self.norm2 = nn.LayerNorm(D, elementwise_affine=False, eps=1e-6)
        self.attn, self.ffn = attention(), mlp()
        self.modulation = nn.Parameter(torch.randn(1, 6, D) / D**0.5)

    def forward(self, x, e):
        e = (self.modulation + e.float()).chunk(6, dim=1)  # fp32 (B, 1, D) each
        h = (self.norm1(x.float()) * (1 + e[1]) + e[0]).type_as(x)
        x = (x.float() + self.attn(h).float() * e[2]).type_as(x)
        y = self.norm2(x.to(torch.float32))
        y = (y * (1 + e[4]) + e[3]).to(x.dtype)
        x = (x.float() + self.ffn(y).float() * e[5]).type_as(x)
        h = F.layer_norm(x.float(), (D,), eps=1e-6)
        return (h * (1 + e[1]) + e[0]).type_as(x)


class PerTokenBlock(nn.Module):
    """Per-token (B, N, D) modulation (Wan 2.2 TI2V style), with `unbind` of an embedding."""

    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(D, elementwise_affine=False, eps=1e-6)
        self.proj = nn.Linear(D, 3 * D)
        self.ffn = mlp()

    def forward(self, x, t):
        shift, scale, gate = self.proj(t).unflatten(-1, (3, D)).unbind(2)  # t (B, N, D) -> 3 x (B, N, D)
        return x + gate * self.ffn(self.norm(x) * (1 + scale) + shift)


class WanLayerNorm(nn.LayerNorm):
    """As in the Wan2.1 repository (wan/modules/model.py)."""

    def __init__(self, dim, eps=1e-6, elementwise_affine=False):
        super().__init__(dim, elementwise_affine=elementwise_affine, eps=eps)

    def forward(self, x):
        return super().forward(x.float()).type_as(x)


class WanRepoBlock(nn.Module):
    """The Wan2.1 repository's block: WanLayerNorm, `self.norm1(x).float() * (1 + e[1]) + e[0]`,
    a nested function for cross-attention + FFN, and `super()` in the norm."""

    def __init__(self):
        super().__init__()
        self.norm1, self.norm2 = WanLayerNorm(D), WanLayerNorm(D)
        self.self_attn, self.ffn = attention(), mlp()
        self.modulation = nn.Parameter(torch.randn(1, 6, D) / D**0.5)

    def forward(self, x, e):
        e = (self.modulation + e).chunk(6, dim=1)
        y = self.self_attn(self.norm1(x).float() * (1 + e[1]) + e[0])
        x = x + y * e[2]

        def ffn_part(x, e):
            y = self.ffn(self.norm2(x).float() * (1 + e[4]) + e[3])
            return x + y * e[5]

        return ffn_part(x, e)


# --- look-alikes that are not AdaLN (or not fusable), and must be left alone --------------------------------
class LookAlikes(nn.Module):
    """`- shift`, `* scale` without `1 +`, RMSNorm, a LayerNorm over two dims, a norm output used
    twice, a Linear in the norm's place, a norm input changed before the modulation, a norm output
    modulated in a loop (only its first pass is AdaLN)."""

    def __init__(self, tokens: int):
        super().__init__()
        self.norm = nn.LayerNorm(D, elementwise_affine=False, eps=1e-6)
        self.rms = nn.RMSNorm(D, eps=1e-6)
        self.norm2d = nn.LayerNorm((tokens, D), elementwise_affine=False)
        self.proj = nn.Linear(D, D)
        self.ada = nn.Linear(D, 2 * D)

    def forward(self, x, c):
        shift, scale = self.ada(c)[:, None].chunk(2, dim=-1)
        a = self.norm(x) * (1 + scale) - shift
        b = self.norm(x) * scale + shift
        r = self.rms(x) * (1 + scale) + shift
        t = self.norm2d(x) * (1 + scale) + shift
        h = self.norm(x)
        u = h * (1 + scale) + shift
        u = u + h
        p = self.proj(x) * (1 + scale) + shift
        n = self.norm(x)
        x = x * 2
        n = n * (1 + scale) + shift
        m = self.norm(x)
        for _ in range(2):
            m = m * (1 + scale) + shift
        return a + b + r + t + u + p + n + m + x


def block_inputs(block: nn.Module, batch: int = 2, tokens: int = 5, seed: int = 0) -> tuple:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, tokens, D, generator=gen)
    if isinstance(block, (WanStyleBlock, WanRepoBlock)):
        cond = torch.randn(batch, 6, D, generator=gen)  # Wan's (B, 6, D) time projection
    elif isinstance(block, PerTokenBlock):
        cond = torch.randn(batch, tokens, D, generator=gen)
    else:
        cond = torch.randn(batch, D, generator=gen)
    return x, cond


def randomized(cls: type, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    block = cls()
    with torch.no_grad():  # affine norms start at (1, 0): move them so weight and bias are exercised
        for p in block.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return block


SITES = {  # class -> the expressions fused, as the report quotes them
    PlainBlock: ["self.norm1(x) * (1 + scale_msa.unsqueeze(1)) + shift_msa.unsqueeze(1)",
                 "shift_mlp[:, None] + (1.0 + scale_mlp[:, None]) * self.norm2(x)"],
    AddcmulBlock: ["torch.addcmul(shift1, self.norm1(x), 1 + scale1)",
                   "shift2.addcmul(1 + scale2, self.norm2(x))"],
    HelperBlock: ["modulate(self.norm1(x), shift_msa, scale_msa)",
                  "modulate(self.norm2(x), scale=scale_mlp, shift=shift_mlp)",
                  "self._modulate(self.norm3(x), shift, scale)"],
    WanStyleBlock: ["(self.norm1(x.float()) * (1 + e[1]) + e[0]).type_as(x)",
                    "(y * (1 + e[4]) + e[3]).to(x.dtype)",
                    "(h * (1 + e[1]) + e[0]).type_as(x)"],
    PerTokenBlock: ["self.norm(x) * (1 + scale) + shift"],
    WanRepoBlock: ["self.norm1(x).float() * (1 + e[1]) + e[0]",
                   "self.norm2(x).float() * (1 + e[4]) + e[3]"],
}


def _texts(report, name: str) -> list[str]:
    return [site.split(": ", 1)[1] for site in report.sites[name]]


@pytest.mark.parametrize("cls", list(SITES), ids=lambda c: c.__name__)
def test_each_idiom_is_fused_exactly_and_matches_eager(cls):
    block = randomized(cls)
    report = check_fp32(block, block_inputs(block), expected_replaced=1)
    assert report.counts() == {f"idiom:{cls.__qualname__}": 1}
    assert _texts(report, f"idiom:{cls.__qualname__}") == SITES[cls]
    assert report.left_alone == []


@pytest.mark.parametrize("cls", list(SITES), ids=lambda c: c.__name__)
def test_each_idiom_against_an_fp64_run(cls):
    """The fused fp32 block is as close to the original run in fp64 as the eager fp32 block is."""
    block = randomized(cls)
    inputs = block_inputs(block, tokens=7, seed=1)
    patched, _ = patched_copy(block)
    outs, grads = run(block, inputs)
    outs_p, grads_p = run(patched, inputs)
    reference = copy.deepcopy(block).double()
    outs_ref, grads_ref = run(reference, cast_inputs(inputs, torch.float64))
    floor = grad_floor(grads_ref)
    for o, o_p, o_ref in zip(outs, outs_p, outs_ref, strict=True):
        assert rel_err(o_p, o_ref) <= 2 * rel_err(o, o_ref) + 1e-6
    for name in grads_ref:
        assert rel_err(grads_p[name], grads_ref[name], floor) <= 2 * rel_err(grads[name], grads_ref[name], floor) + 1e-6, name


def test_bf16_wan_style_fuses_and_stays_within_rounding():
    """bf16 activations with fp32 modulation cast back once: the op's own math, so the fused block
    equals eager bf16 up to a few ulps of fp32 summation order."""
    block = randomized(WanStyleBlock).bfloat16()
    patched, report = patched_copy(block)
    x, e = block_inputs(block)
    with torch.no_grad():
        assert rel_err(patched(x.bfloat16(), e), block(x.bfloat16(), e)) <= 2**-7
    assert report.verification == {"": "verified on its first call (bfloat16 outputs)"}


def test_look_alikes_are_left_alone_with_reasons():
    block = LookAlikes(tokens=5)
    x, c = block_inputs(PlainBlock())
    expected = block(x, c)
    report = apply_fused_adaln(block)
    assert report.num_replaced == 0 and "forward" not in block.__dict__
    torch.testing.assert_close(block(x, c), expected, rtol=0, atol=0)
    (name, cls, reason), = report.left_alone
    assert (name, cls) == ("", "LookAlikes")
    # listed: the sites that are AdaLN in form but not fusable; not listed: `- shift`, `* scale`, the Linear
    assert "self.rms(x) * (1 + scale) + shift: rms is RMSNorm, not a LayerNorm" in reason
    assert "self.norm2d(x) * (1 + scale) + shift: norm2d normalizes over (5, 16)" in reason
    assert "h * (1 + scale) + shift: the norm output `h` is used again at line" in reason
    assert "n * (1 + scale) + shift: the norm input of `n` is used or changed before line" in reason
    assert "m * (1 + scale) + shift: the norm output `m` is read inside a loop or nested function" in reason
    assert reason.count("line ") == 8 and "proj" not in reason and "- shift" not in reason


def test_unsupported_forwards_are_listed_not_rewritten():
    def logged(fn):
        def wrapper(*args, **kwargs):
            return fn(*args, **kwargs)
        wrapper.__wrapped__ = fn
        return wrapper

    class Decorated(PlainBlock):
        @logged
        def forward(self, x, c):
            return self.norm1(x) * (1 + c[:, None]) + c[:, None]

    class Mangled(PlainBlock):
        def forward(self, x, c):
            self.__seen = True
            return self.norm1(x) * (1 + c[:, None]) + c[:, None]

    class SubclassNorm(nn.LayerNorm):
        def forward(self, x):
            return super().forward(x) * 2

    class CustomNorm(PlainBlock):
        def __init__(self):
            super().__init__()
            self.norm1 = SubclassNorm(D)

    for cls, why in ((Decorated, "forward is wrapped by a decorator"),
                     (Mangled, "forward uses class-private (name-mangled) names ['__seen']")):
        report = apply_fused_adaln(cls())
        assert report.num_replaced == 0
        (name, _, reason), = report.left_alone
        assert name == "" and "not rewritten: " + why in reason
    # a LayerNorm subclass we have not checked: that site is listed, the other one is fused
    report = apply_fused_adaln(CustomNorm())
    (pattern, modules), = report.replaced.items()
    assert pattern.startswith(f"idiom:{CustomNorm.__qualname__} (lines ") and modules == [""]
    assert _texts(report, pattern) == [SITES[PlainBlock][1]]
    assert "norm1 is SubclassNorm, a LayerNorm subclass with a forward we have not checked" in report.left_alone[0][2]


class RenamedDiTBlock(nn.Module):
    """The original DiT's DiTBlock (facebookresearch/DiT models.py) copied under another name."""

    def __init__(self):
        super().__init__()
        self.norm1 = nn.LayerNorm(D, elementwise_affine=False, eps=1e-6)
        self.attn = attention()
        self.norm2 = nn.LayerNorm(D, elementwise_affine=False, eps=1e-6)
        self.mlp = mlp()
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(D, 6 * D, bias=True))

    def forward(self, x, c):
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = self.adaLN_modulation(c).chunk(6, dim=1)
        x = x + gate_msa.unsqueeze(1) * self.attn(modulate(self.norm1(x), shift_msa, scale_msa))
        x = x + gate_mlp.unsqueeze(1) * self.mlp(modulate(self.norm2(x), shift_mlp, scale_mlp))
        return x


def test_renamed_copy_of_a_library_block_is_fused_or_listed():
    """issue 15: a renamed copy of a known block. The pattern matches it by its forward's
    fingerprint (the code it was checked against, under another class name); without that pattern
    the idiom pass fuses it; with neither it is listed under left_alone, with the reason."""
    block = randomized(RenamedDiTBlock)
    inputs = block_inputs(block)
    assert check_fp32(block, inputs, expected_replaced=1).counts() == {"dit.DiTBlock": 1}
    report = check_fp32(block, inputs, expected_replaced=1, patterns=[])
    assert report.counts() == {"idiom:RenamedDiTBlock": 1}
    report = apply_fused_adaln(copy.deepcopy(block), patterns=[], idioms=False)
    assert report.left_alone == [("", "RenamedDiTBlock", "pattern(s) dit.DiTBlock not selected")]


def test_first_call_check_restores_the_original_on_mismatch(monkeypatch):
    """A rewrite whose fused result differs (here: a broken op, patched in after surgery) is
    caught on the first call: that call and later ones run the original forward, and the
    report and a warning say why."""
    block = randomized(PlainBlock)
    x, c = block_inputs(block)
    expected = block(x, c)
    report = apply_fused_adaln(block)
    monkeypatch.setattr(core, "adaln_modulate", lambda *args: args[0] + 1.0)
    with pytest.warns(RuntimeWarning, match="failed its first-call check"):
        out = block(x, c)
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    assert "forward" not in block.__dict__ and verify.CHECK_ATTR not in block.__dict__
    assert report.replaced == {} and report.verification[""].startswith("failed on its first call")
    assert "rewrite failed its first-call check: output 0 differs by" in report.left_alone[0][2]
    torch.testing.assert_close(block(x, c), expected, rtol=0, atol=0)


def test_first_call_check_keeps_rng_and_buffers_honest():
    class DropoutBlock(PlainBlock):
        def __init__(self):
            super().__init__()
            self.drop = nn.Dropout(0.5)

        def forward(self, x, c):
            shift, scale = self.ada(c)[:, :2 * D].chunk(2, dim=1)
            return self.drop(self.attn(self.norm1(x) * (1 + scale[:, None]) + shift[:, None]))

    class CountingBlock(PlainBlock):
        def __init__(self):
            super().__init__()
            self.register_buffer("calls", torch.zeros(()))

        def forward(self, x, c):
            self.calls += 1
            return self.norm1(x) * (1 + c[:, None]) + c[:, None]

    torch.manual_seed(0)
    block = DropoutBlock().train()
    patched, report = patched_copy(block)
    x, c = block_inputs(block)
    torch.manual_seed(5)
    expected = block(x, c)
    state_after_eager = torch.get_rng_state()
    torch.manual_seed(5)
    out = patched(x, c)  # three forwards, but the RNG advances as for one, with the same dropout mask
    assert torch.equal(torch.get_rng_state(), state_after_eager)
    assert rel_err(out, expected) <= 1e-6 and report.verification[""].startswith("verified")

    counting = CountingBlock()
    report = apply_fused_adaln(counting)
    with pytest.warns(RuntimeWarning, match="failed its first-call check"):
        counting(x, c)
    assert "changes the module's parameters or buffers" in report.verification[""]
    assert float(counting.calls) == 1  # the check's run was undone; the original forward from now on


def test_example_inputs_run_the_first_call_checks_at_surgery():
    block = randomized(HelperBlock)
    report = apply_fused_adaln(block, example_inputs=block_inputs(block))
    assert report.verification == {"": "verified on its first call (float32 outputs)"}
    assert verify.CHECK_ATTR not in block.__dict__
    dry = apply_fused_adaln(randomized(HelperBlock), dry_run=True, example_inputs=block_inputs(block))
    assert dry.counts() == {"idiom:HelperBlock": 1} and dry.verification == {}


def test_runtime_fallback_is_the_original_expression_exactly():
    """fp64 blocks (the op computes in fp32) and 2-D x run each site's eager expression."""
    block = randomized(PlainBlock).double()
    patched, _ = patched_copy(block)
    x, c = (t.double() for t in block_inputs(block))
    with pytest.warns(RuntimeWarning, match=r"eager fallback at PlainBlock.forward line \d+ for x dtype torch.float64"):
        out = patched(x, c)
    assert torch.equal(out, block(x, c))


def test_site_check_refuses_a_site_the_op_computes_differently(monkeypatch):
    """The per-site numeric check at surgery time: a site whose fused result differs is not rewritten."""
    monkeypatch.setattr(core, "adaln_modulate", lambda x, shift, scale, *rest: x * (1 + scale) + shift)
    report = apply_fused_adaln(randomized(PerTokenBlock))
    assert report.num_replaced == 0
    assert "numeric check failed: x torch.float32" in report.left_alone[0][2]


def test_state_dict_classes_and_idempotence():
    block = randomized(WanStyleBlock)
    before = {k: v.clone() for k, v in block.state_dict().items()}
    report = apply_fused_adaln(block)
    assert type(block) is WanStyleBlock and list(block.state_dict()) == list(before)
    assert all(torch.equal(block.state_dict()[k], v) for k, v in before.items())
    second = apply_fused_adaln(block)
    assert second.num_replaced == 0 and second.already_fused == report.replaced
    twin = copy.deepcopy(block)
    assert twin.forward.__self__ is twin

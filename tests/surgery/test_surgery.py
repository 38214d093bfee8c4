"""Module surgery on the original-DiT pattern (a faithful DiTBlock/FinalLayer below), the project's
example video DiT (its patterns registered through the public API, and the idiom recogniser on the
same blocks), the pattern API itself, a model without AdaLN, runtime fallbacks, torch.compile and
the Lightning callback."""
from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

import lightning as L
from lightning.pytorch.loggers import CSVLogger
import pytest
import torch
from torch import nn
from tests.helpers.surgery import (
    Attention,
    check_bf16_noise,
    check_fp32,
    check_idempotent,
    check_state_dict_round_trip,
    patched_copy,
    rel_err,
    run,
)

from examples.video_dit import surgery as video_dit
from examples.video_dit.model import DiTConfig, VideoDiT
from examples.video_dit.module import VideoDiTModule
from lightning_adaptiveload import surgery
from lightning_adaptiveload.callbacks import FusedAdaLNSurgery
from lightning_adaptiveload.surgery import apply_fused_adaln, core, dit, registry

VIDEO_DIT_PATH = "examples.video_dit.surgery.VIDEO_DIT_PATTERNS"


# --- the original DiT (facebookresearch/DiT models.py): forward and modulate verbatim, attention
# and MLP equivalent to timm's Attention(qkv_bias=True) and Mlp(GELU tanh) ---------------------
def modulate(x, shift, scale):
    return x * (1 + scale.unsqueeze(1)) + shift.unsqueeze(1)


class DiTBlock(nn.Module):
    def __init__(self, hidden_size, num_heads, mlp_ratio=4.0):
        super().__init__()
        self.norm1 = nn.LayerNorm(hidden_size, elementwise_affine=False, eps=1e-6)
        self.attn = Attention(hidden_size, num_heads)
        self.norm2 = nn.LayerNorm(hidden_size, elementwise_affine=False, eps=1e-6)
        hidden = int(hidden_size * mlp_ratio)
        self.mlp = nn.Sequential(nn.Linear(hidden_size, hidden), nn.GELU(approximate="tanh"), nn.Linear(hidden, hidden_size))
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(hidden_size, 6 * hidden_size, bias=True))

    def forward(self, x, c):
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = self.adaLN_modulation(c).chunk(6, dim=1)
        x = x + gate_msa.unsqueeze(1) * self.attn(modulate(self.norm1(x), shift_msa, scale_msa))
        x = x + gate_mlp.unsqueeze(1) * self.mlp(modulate(self.norm2(x), shift_mlp, scale_mlp))
        return x


class FinalLayer(nn.Module):
    def __init__(self, hidden_size, out_features):
        super().__init__()
        self.norm_final = nn.LayerNorm(hidden_size, elementwise_affine=False, eps=1e-6)
        self.linear = nn.Linear(hidden_size, out_features, bias=True)
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(hidden_size, 2 * hidden_size, bias=True))

    def forward(self, x, c):
        shift, scale = self.adaLN_modulation(c).chunk(2, dim=1)
        x = modulate(self.norm_final(x), shift, scale)
        x = self.linear(x)
        return x


class TinyDiT(nn.Module):
    """Random weights everywhere (no adaLN-Zero init), so shift/scale/order errors show up."""

    def __init__(self, dim: int = 32, depth: int = 2, heads: int = 2, out: int = 8):
        super().__init__()
        self.blocks = nn.ModuleList(DiTBlock(dim, heads) for _ in range(depth))
        self.final_layer = FinalLayer(dim, out)

    def forward(self, x, c):
        for block in self.blocks:
            x = block(x, c)
        return self.final_layer(x, c)


def dit_inputs(batch=2, tokens=7, dim=32):
    gen = torch.Generator().manual_seed(1)
    return torch.randn(batch, tokens, dim, generator=gen), torch.randn(batch, dim, generator=gen)


def tiny_video_dit() -> VideoDiT:
    torch.manual_seed(0)
    model = VideoDiT(DiTConfig(in_channels=4, out_channels=4, dim=48, num_layers=2, num_heads=2, ffn_dim=64,
                               text_dim=16, freq_dim=16, patch=(1, 2, 2)))
    with torch.no_grad():  # Wan init zeroes biases; randomize so every term is exercised
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model


def video_dit_inputs(batch=2):
    gen = torch.Generator().manual_seed(2)
    return (torch.randn(batch, 4, 2, 4, 6, generator=gen), torch.rand(batch, generator=gen),
            torch.randn(batch, 5, 16, generator=gen))


# --- pattern 2: original DiT ---------------------------------------------------------------------
def test_dit_fp32_outputs_and_grads_match():
    torch.manual_seed(0)
    check_fp32(TinyDiT(), dit_inputs(), expected_replaced=3)


def test_dit_bf16_within_model_noise():
    torch.manual_seed(0)
    check_bf16_noise(TinyDiT(), dit_inputs(tokens=64), expected_replaced=3)


def test_dit_state_dict_idempotence_and_report():
    torch.manual_seed(0)
    model = TinyDiT()
    check_state_dict_round_trip(model)
    check_idempotent(model)
    patched, report = patched_copy(model)
    assert report.counts() == {"dit.DiTBlock": 2, "dit.FinalLayer": 1}
    assert report.replaced["dit.DiTBlock"] == ["blocks.0", "blocks.1"]
    assert report.left_alone == [] and not report.dry_run
    text = str(report)
    assert "replaced 3 module(s)" in text and "dit.FinalLayer" in text and "final_layer" in text
    assert type(patched.blocks[0]) is DiTBlock  # class unchanged for FSDP / checkpointing policies
    assert patched.blocks[0].forward.__func__ is dit.dit_block_forward
    twin = copy.deepcopy(patched)  # the bound forward follows the copy
    assert twin.blocks[0].forward.__self__ is twin.blocks[0]


def test_dry_run_changes_nothing():
    model = TinyDiT()
    report = apply_fused_adaln(model, dry_run=True)
    assert report.dry_run and report.num_replaced == 3 and "would replace 3" in str(report)
    assert all("forward" not in m.__dict__ for m in model.modules())


def test_pattern_selection():
    model = TinyDiT()
    report = apply_fused_adaln(model, patterns=["dit.FinalLayer"], idioms=False)
    assert report.counts() == {"dit.FinalLayer": 1}
    assert [(m, r) for m, _, r in report.left_alone] == [
        ("blocks.0", "pattern(s) dit.DiTBlock not selected"),
        ("blocks.1", "pattern(s) dit.DiTBlock not selected"),
    ]
    # with the idiom recogniser on, the blocks no selected pattern fuses are rewritten instead
    report = apply_fused_adaln(TinyDiT(), patterns=["dit.FinalLayer"])
    assert report.counts() == {"dit.FinalLayer": 1, "idiom:DiTBlock": 2} and report.left_alone == []
    with pytest.raises(ValueError, match="unknown pattern.*'nope'"):
        apply_fused_adaln(model, patterns=["nope"])
    with pytest.raises(TypeError, match="torch.nn.Module"):
        apply_fused_adaln("not a model")
    assert "diffusers.WanTransformerBlock" in surgery.PATTERN_NAMES


def swapped_modulate(x, shift, scale):  # a DiT copy with shift and scale exchanged
    return x * (1 + shift.unsqueeze(1)) + scale.unsqueeze(1)


def test_unrecognised_variants_are_left_alone(monkeypatch):
    class OverriddenBlock(DiTBlock):
        def forward(self, x, c):
            return super().forward(x, c) * 2

    model = nn.Sequential(OverriddenBlock(16, 2))
    report = apply_fused_adaln(model)
    assert report.num_replaced == 0
    (name, cls, reason), = report.left_alone
    assert (name, cls) == ("0", "OverriddenBlock") and "not the code pattern" in reason

    monkeypatch.setattr(sys.modules[__name__], "modulate", swapped_modulate)
    report = apply_fused_adaln(TinyDiT(), idioms=False)
    assert report.counts() == {}
    assert len(report.left_alone) == 3 and all("`modulate`" in r for _, _, r in report.left_alone)
    # The idiom recogniser reads the swapped helper as what it is, an AdaLN with the roles of its
    # arguments exchanged, and fuses it with the original's numerics.
    torch.manual_seed(0)
    report = check_fp32(TinyDiT(), dit_inputs(), expected_replaced=3)
    assert report.counts() == {"idiom:DiTBlock": 2, "idiom:FinalLayer": 1}

    block = DiTBlock(16, 2)
    block.norm1 = nn.LayerNorm(16, elementwise_affine=False, eps=1e-6)
    block.norm1.register_forward_hook(lambda *args: None)
    report = apply_fused_adaln(block, idioms=False)
    assert report.num_replaced == 0 and "forward hooks" in report.left_alone[0][2]
    report = apply_fused_adaln(block)  # the idiom pass fuses only the site whose norm has no hook
    (pattern, modules), = report.replaced.items()
    assert pattern.startswith("idiom:DiTBlock (lines ") and modules == [""]
    assert report.sites[pattern] == [f"line {_line_of('self.norm2(x), shift_mlp')}: "
                                     "modulate(self.norm2(x), shift_mlp, scale_mlp)"]
    assert "modulate(self.norm1(x), shift_msa, scale_msa): norm1 has forward hooks" in report.left_alone[0][2]


def _line_of(text: str, path: str | Path = __file__) -> int:
    """Line number of `text` in `path` (the report cites source lines)."""
    return next(i for i, line in enumerate(Path(path).read_text().splitlines(), 1) if text in line)


def test_model_without_adaln_is_untouched():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.GELU(), nn.Linear(16, 4))
    before = copy.deepcopy(model.state_dict())
    report = apply_fused_adaln(model)
    assert report.num_replaced == 0 and report.left_alone == [] and report.already_fused == {}
    assert all("forward" not in m.__dict__ for m in model.modules())
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert "replaced 0 module(s)" in str(report)


def test_runtime_fallback_fp64_and_promotion():
    torch.manual_seed(0)
    model = TinyDiT().double()
    patched, _ = patched_copy(model)
    x, c = (t.double() for t in dit_inputs())
    with pytest.warns(RuntimeWarning, match="eager fallback for x dtype torch.float64"):
        out = patched(x, c)
    assert torch.equal(out, model(x, c))  # the original expression, bit for bit
    # bf16 activations with fp32 modulation: eager's result would be fp32, the op writes bf16.
    # Only the first AdaLN falls back; its output makes the residual stream fp32 and norm2 fuses.
    block = DiTBlock(32, 2)
    fused, _ = patched_copy(block)
    xb = dit_inputs()[0].to(torch.bfloat16)
    with pytest.warns(RuntimeWarning, match="result dtype torch.float32 differs from x dtype torch.bfloat16"):
        y = fused(xb, dit_inputs()[1])
    y_ref = block(xb, dit_inputs()[1])
    assert y.dtype == y_ref.dtype == torch.float32 and rel_err(y, y_ref) <= 1e-5


def test_compile_patched_block():
    torch.manual_seed(0)
    block = DiTBlock(32, 2)
    patched, _ = patched_copy(block)
    compiled = torch.compile(patched, fullgraph=True, backend="aot_eager")
    x, c = dit_inputs()
    x.requires_grad_(True)
    y = compiled(x, c)
    y.square().sum().backward()
    x_ref = x.detach().clone().requires_grad_(True)
    y_ref = block(x_ref, c)
    y_ref.square().sum().backward()
    assert rel_err(y, y_ref) <= 1e-5 and rel_err(x.grad, x_ref.grad) <= 1e-5


# --- the project's example video DiT: its patterns through the public API, and the idioms ---------
def test_video_dit_fp32_and_bf16():
    check_fp32(tiny_video_dit(), video_dit_inputs(), expected_replaced=3, extra_patterns=video_dit.VIDEO_DIT_PATTERNS)
    check_bf16_noise(tiny_video_dit(), video_dit_inputs(), expected_replaced=3, mixed=True,
                     extra_patterns=VIDEO_DIT_PATH)


def test_video_dit_report_state_dict_idempotence():
    model = tiny_video_dit()
    check_state_dict_round_trip(model, extra_patterns=VIDEO_DIT_PATH)
    check_idempotent(model, extra_patterns=VIDEO_DIT_PATH)
    report = apply_fused_adaln(model, extra_patterns=VIDEO_DIT_PATH)
    assert report.counts() == {"video_dit.DiTBlock": 2, "video_dit.Head": 1}
    assert model.blocks[1].forward.__func__ is video_dit.block_forward


def test_video_dit_patterns_and_idioms_give_the_same_numerics():
    """Without its patterns the example is fused by the idiom recogniser, through the same op calls:
    outputs and gradients equal bit for bit, and the report says which path fused what."""
    model = tiny_video_dit()
    by_pattern, pattern_report = patched_copy(model, extra_patterns=video_dit.VIDEO_DIT_PATTERNS)
    by_idiom, idiom_report = patched_copy(model)
    assert idiom_report.counts() == {"idiom:DiTBlock": 2, "idiom:Head": 1}
    assert pattern_report.counts() == {"video_dit.DiTBlock": 2, "video_dit.Head": 1}
    model_file = Path(video_dit.__file__).with_name("model.py")
    assert idiom_report.sites["idiom:DiTBlock"] == [
        f"line {_line_of('self.norm1(x.to(acc))', model_file)}: "
        "(self.norm1(x.to(acc)) * (1 + scale_msa) + shift_msa).type_as(x)",
        f"line {_line_of('self.norm2(x.to(acc))', model_file)}: "
        "(self.norm2(x.to(acc)) * (1 + scale_ffn) + shift_ffn).type_as(x)",
    ]
    outs_p, grads_p = run(by_pattern, video_dit_inputs())
    outs_i, grads_i = run(by_idiom, video_dit_inputs())
    assert all(torch.equal(a, b) for a, b in zip(outs_p, outs_i, strict=True))
    assert grads_p.keys() == grads_i.keys() and all(torch.equal(grads_p[k], grads_i[k]) for k in grads_p)
    assert set(idiom_report.verification.values()) == {"verified on its first call (float32 outputs)"}


def test_pattern_api_registration_and_import_paths(monkeypatch):
    monkeypatch.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))  # registrations undone after the test
    assert "video_dit.DiTBlock" not in surgery.PATTERN_NAMES
    assert registry.register_adaln_patterns(VIDEO_DIT_PATH) == ["video_dit.DiTBlock", "video_dit.Head"]
    assert registry.register_adaln_patterns(video_dit.VIDEO_DIT_PATTERNS) == []  # the same objects again: no-op
    assert {"video_dit.DiTBlock", "video_dit.Head"} <= set(surgery.PATTERN_NAMES)  # read at access, not at import
    report = apply_fused_adaln(tiny_video_dit(), idioms=False)  # registered: used without extra_patterns
    assert report.counts() == {"video_dit.DiTBlock": 2, "video_dit.Head": 1}
    impostor = core.AdaLNPattern("video_dit.Head", "Head", video_dit.head_forward, {"0": "nowhere"}, lambda m: None)
    with pytest.raises(ValueError, match="two different AdaLN patterns are named 'video_dit.Head'"):
        registry.register_adaln_patterns(impostor)
    with pytest.raises(ValueError, match="two different AdaLN patterns are named 'video_dit.Head'"):
        apply_fused_adaln(tiny_video_dit(), extra_patterns=[impostor])
    with pytest.raises(ValueError, match="has no 'NOPE'"):
        apply_fused_adaln(tiny_video_dit(), extra_patterns="examples.video_dit.surgery.NOPE")
    with pytest.raises(TypeError, match="names a str, not an AdaLNPattern"):
        registry.resolve_patterns("examples.video_dit.surgery.CHECKED_AT")
    with pytest.raises(ValueError, match="no .module.NAME. in it"):
        registry.resolve_patterns("no_such_package.PATTERNS")
    with pytest.raises(ValueError, match="checked must be a non-empty dict"):
        core.AdaLNPattern("x", "X", video_dit.head_forward, {}, lambda m: None)



@pytest.mark.parametrize("by", ["pattern", "idiom"])
def test_video_dit_head_broadcast_time_embedding_falls_back_exactly(by):
    head = tiny_video_dit().head
    patched, _ = patched_copy(head, extra_patterns=video_dit.VIDEO_DIT_PATTERNS if by == "pattern" else None)
    gen = torch.Generator().manual_seed(4)
    x, time_emb = torch.randn(2, 6, 48, generator=gen), torch.randn(1, 48, generator=gen)
    with pytest.warns(RuntimeWarning, match=r"eager fallback (at Head.forward line \d+ )?for shift of shape \(1, 1, 48\)"):
        out = patched(x, time_emb)
    assert torch.equal(out, head(x, time_emb))

# --- the Lightning callback --------------------------------------------------------------------
def _loader(batches=2):
    gen = torch.Generator().manual_seed(3)
    data = [{"latents": torch.randn(4, 2, 4, 4, generator=gen), "text": torch.randn(3, 16, generator=gen)}
            for _ in range(2 * batches)]
    return torch.utils.data.DataLoader(data, batch_size=2)


TINY = dict(in_channels=4, dim=48, num_layers=2, num_heads=2, ffn_dim=64, text_dim=16, freq_dim=16)


def _trainer(tmp_path, callback, logger=False):
    return L.Trainer(accelerator="cpu", devices=1, max_steps=2, logger=logger, enable_checkpointing=False,
                     enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path,
                     callbacks=[callback])


def test_callback_fuses_in_setup(tmp_path):
    module = VideoDiTModule(**TINY)
    callback = FusedAdaLNSurgery(extra_patterns=[VIDEO_DIT_PATH], require_replacement=True)
    trainer = _trainer(tmp_path, callback, logger=CSVLogger(tmp_path))
    trainer.fit(module, train_dataloaders=_loader())
    assert callback.report.counts() == {"video_dit.DiTBlock": 2, "video_dit.Head": 1}
    assert module.dit.blocks[0].forward.__func__ is video_dit.block_forward
    saved = json.loads((Path(trainer.log_dir) / "fused_adaln_surgery.json").read_text())
    assert saved["replaced"] == callback.report.replaced


def test_callback_idioms_report_first_call_checks(tmp_path):
    """Without patterns the callback fuses the example by idiom; after the first batch its JSON
    holds every block's first-call verification."""
    module = VideoDiTModule(**TINY)
    callback = FusedAdaLNSurgery(require_replacement=True)
    trainer = _trainer(tmp_path, callback, logger=CSVLogger(tmp_path))
    trainer.fit(module, train_dataloaders=_loader())
    assert callback.report.counts() == {"idiom:DiTBlock": 2, "idiom:Head": 1}
    saved = json.loads((Path(trainer.log_dir) / "fused_adaln_surgery.json").read_text())
    assert saved["verification"] == {name: "verified on its first call (float32 outputs)"
                                     for name in ("dit.blocks.0", "dit.blocks.1", "dit.head")}
    with pytest.raises(ValueError, match="AdaLN pattern path 'examples.nope.X'"):
        FusedAdaLNSurgery(extra_patterns=["examples.nope.X"])


def test_callback_require_replacement_flags_configure_model_builds(tmp_path):
    module = VideoDiTModule(**TINY, build_in_configure_model=True)
    with pytest.raises(RuntimeError, match="call apply_fused_adaln there"):
        _trainer(tmp_path, FusedAdaLNSurgery(require_replacement=True)).fit(module, train_dataloaders=_loader())


def test_surgery_inside_configure_model(tmp_path):
    class Module(VideoDiTModule):
        def configure_model(self):
            super().configure_model()
            apply_fused_adaln(self.dit)

    module = Module(**TINY, build_in_configure_model=True)
    _trainer(tmp_path, FusedAdaLNSurgery()).fit(module, train_dataloaders=_loader())
    assert module.dit.head.forward.__func__._fused_adaln_name == "idiom:Head"


def test_callback_builds_the_extension_in_setup_on_cuda_only_when_it_fused(monkeypatch):
    import lightning_adaptiveload.callbacks.surgery as surgery_callback
    from examples.video_dit.model import DiTConfig, VideoDiT
    from examples.video_dit.surgery import VIDEO_DIT_PATTERNS

    calls = []
    monkeypatch.setattr(surgery_callback, "ensure_extension", lambda verbose: calls.append(verbose) or "cuda: test")

    class Strategy:
        root_device = torch.device("cuda", 0)

    class FakeTrainer:
        strategy, is_global_zero, loggers, log_dir = Strategy(), True, [], None

    class Holder(torch.nn.Module):
        def __init__(self, layers):
            super().__init__()
            self.dit = VideoDiT(DiTConfig(in_channels=4, out_channels=4, dim=32, num_layers=layers, num_heads=2,
                                          ffn_dim=64, text_dim=16, freq_dim=16))

    callback = surgery_callback.FusedAdaLNSurgery(extra_patterns=VIDEO_DIT_PATTERNS, idioms=False)
    callback.setup(FakeTrainer(), Holder(1), "fit")
    assert calls == [True]
    callback.setup(FakeTrainer(), torch.nn.Linear(2, 2), "fit")  # nothing to fuse: nothing to build
    assert calls == [True]

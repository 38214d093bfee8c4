"""Recording a step's SDPA calls and rebuilding them for any (B, S): the recorded signatures against the
example model's own layout, aliases and compiled regions, inputs with the recorded strides, and templates
from two probes against a direct recording."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch.nn.functional import scaled_dot_product_attention as bound_at_import

from lightning_adaptiveload.attention import CallTemplate, Probe, SdpaCall, TemplateError, make_inputs, record_sdpa_calls
from tests.attention.helpers import CONFIG, TEXT_LEN, forward, tiny_dit, tokens

H, D = CONFIG.num_heads, CONFIG.dim // CONFIG.num_heads


def test_records_self_and_cross_attention_of_every_block_with_the_models_layout():
    model = tiny_dit()
    calls = record_sdpa_calls(forward(model, 2, (2, 8, 12)))
    s = tokens((2, 8, 12))
    assert [c.count for c in calls] == [CONFIG.num_layers, CONFIG.num_layers]
    self_attn, cross = calls
    # self-attention: q, k rotated by RoPE (contiguous (B, h, S, d)); v a transposed (B, S, h, d) view
    assert self_attn.q_shape == self_attn.k_shape == self_attn.v_shape == (2, H, s, D)
    assert self_attn.q_stride == (H * s * D, s * D, D, 1)
    assert self_attn.v_stride == (s * H * D, D, H * D, 1)
    # cross-attention: all three transposed views; keys are the text tokens
    assert cross.q_shape == (2, H, s, D) and cross.k_shape == cross.v_shape == (2, H, TEXT_LEN, D)
    assert cross.q_stride == (s * H * D, D, H * D, 1) and cross.k_stride == (TEXT_LEN * H * D, D, H * D, 1)
    for c in calls:
        assert (c.dtype, c.device_type, c.is_causal, c.has_mask, c.scale, c.enable_gqa) == \
            ("float32", "cpu", False, False, None, False)


def test_records_aliases_flags_and_compiled_regions():
    q, k, v = (torch.randn(2, 3, 5, 4) for _ in range(3))
    mask = torch.ones(5, 5, dtype=torch.bool).tril()

    def fn():
        bound_at_import(q, k, v)
        F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.5)
        F.scaled_dot_product_attention(q, k, v, mask)
        F.scaled_dot_product_attention(q, k, v)

    calls = record_sdpa_calls(fn)
    assert [c.count for c in calls] == [2, 1, 1]
    assert calls[1].is_causal and calls[1].scale == 0.5
    assert calls[2].mask_shape == (5, 5) and calls[2].mask_dtype == "bool"

    compiled = torch.compile(lambda: F.scaled_dot_product_attention(q, k, v), backend="eager")
    compiled()  # a traced graph would hide the call: recording runs it eagerly
    assert [c.count for c in record_sdpa_calls(compiled)] == [1]


def test_make_inputs_reproduces_strides_gaps_and_overlaps():
    base = torch.randn(2, 7, 3, 4 * 5)  # q of a fused qkv projection: (B, S, 3 [q,k,v] ... ) with a gap
    q = base[:, :, 0].unflatten(-1, (4, 5)).transpose(1, 2)
    k = torch.randn(2, 1, 7, 5).expand(2, 4, 7, 5)  # stride 0 over heads
    v = torch.randn(2, 4, 7, 5)
    call = record_sdpa_calls(lambda: F.scaled_dot_product_attention(q, k, v))[0]
    args = make_inputs(call, "cpu", seed=3)
    for name, t in zip(("query", "key", "value"), (q, k, v)):
        assert args[name].shape == t.shape and args[name].stride() == t.stride(), name
        assert args[name].is_leaf and args[name].requires_grad
    assert args["query"].std() > 0.5  # random, not zeros
    out = F.scaled_dot_product_attention(**args)
    assert torch.allclose(out, F.scaled_dot_product_attention(*(args[n].contiguous() for n in ("query", "key", "value"))),
                          atol=1e-6)


def test_sdpa_call_checks_fields_and_states_flops():
    good = dict(q_shape=(2, 3, 5, 4), q_stride=(60, 20, 4, 1), k_shape=(2, 3, 7, 4), k_stride=(84, 28, 4, 1),
                v_shape=(2, 3, 7, 6), v_stride=(126, 42, 6, 1), dtype="bfloat16", device_type="cuda")
    call = SdpaCall(**good, count=3)
    assert call.forward_flops == 2 * 2 * 3 * 5 * 7 * (4 + 6)
    assert SdpaCall(**good, is_causal=True).forward_flops == call.forward_flops / 2
    assert call.with_batch(1).q_shape == (1, 3, 5, 4) and call.with_batch(1).q_stride == call.q_stride
    assert SdpaCall.from_dict(call.to_dict()) == call
    for change, message in [(dict(dtype="int8"), "dtype"), (dict(q_shape=(5, 4)), "q_shape"),
                            (dict(count=0), "count"), (dict(dropout_p=1.0), "dropout_p"),
                            (dict(mask_shape=(5, 7)), "mask_shape, mask_stride and mask_dtype")]:
        with pytest.raises(ValueError, match=message):
            SdpaCall(**{**good, **change})
    with pytest.raises(ValueError, match="where: unknown keys"):
        SdpaCall.from_dict({**call.to_dict(), "extra": 1}, "where")


PROBES = ((2, (1, 8, 8)), (3, (2, 8, 16)))  # (B, latent): S = 16 and 64, ratios B 3/2, S 4


def probe(model, batch, latent, seed=0):
    return Probe(batch, tokens(latent), record_sdpa_calls(forward(model, batch, latent, seed)))


@pytest.mark.parametrize("batch, latent", [(1, (3, 8, 16)), (5, (1, 6, 10)), (4, (5, 12, 14))])
def test_template_instantiates_what_the_model_records(batch, latent):
    model = tiny_dit()
    template = CallTemplate.from_probes(*(probe(model, b, thw) for b, thw in PROBES))
    direct = record_sdpa_calls(forward(model, batch, latent, seed=1))
    assert template.instantiate(batch, tokens(latent)) == direct


def test_template_scales_a_mask_as_s_squared():
    def calls(b, s):
        q = torch.randn(b, 2, s, 4)
        mask = torch.ones(b, 1, s, s, dtype=torch.bool)
        return record_sdpa_calls(lambda: F.scaled_dot_product_attention(q, q, q, mask))

    template = CallTemplate.from_probes(Probe(2, 8, calls(2, 8)), Probe(3, 24, calls(3, 24)))
    assert template.instantiate(5, 30) == calls(5, 30)


def test_templates_fail_clearly_where_the_probes_do_not_determine_the_calls():
    model = tiny_dit()
    a = probe(model, 2, (1, 8, 8))
    with pytest.raises(TemplateError, match="cannot tell B from S"):
        CallTemplate.from_probes(a, probe(model, 2, (2, 8, 16)))  # same B
    with pytest.raises(TemplateError, match="cannot tell B from S"):
        CallTemplate.from_probes(a, probe(model, 4, (2, 8, 8)))  # S and B doubled together
    one_call = Probe(3, 64, probe(model, 3, (2, 8, 16)).calls[:1])
    with pytest.raises(TemplateError, match="made 2 distinct attention calls"):
        CallTemplate.from_probes(a, one_call)

    def register_token(b, s):  # S + 1 keys: no monomial in S
        q, kv = torch.randn(b, 2, s, 4), torch.randn(b, 2, s + 1, 4)
        return Probe(b, s, record_sdpa_calls(lambda: F.scaled_dot_product_attention(q, kv, kv)))

    with pytest.raises(TemplateError, match=r"attention call 0 k_shape\[2\] is 9 .* and 25"):
        CallTemplate.from_probes(register_token(2, 8), register_token(3, 24))

    def causal_at(b, s, causal):
        q = torch.randn(b, 2, s, 4)
        return Probe(b, s, record_sdpa_calls(lambda: F.scaled_dot_product_attention(q, q, q, is_causal=causal)))

    with pytest.raises(TemplateError, match="differs in .*is_causal"):
        CallTemplate.from_probes(causal_at(2, 8, False), causal_at(3, 24, True))


def test_template_flops_grow_as_b_s_squared():
    model = tiny_dit()
    template = CallTemplate.from_probes(*(probe(model, b, thw) for b, thw in PROBES))
    self_attn = [c.forward_flops for c in (template.instantiate(1, 100)[0], template.instantiate(2, 300)[0])]
    assert math.isclose(self_attn[1] / self_attn[0], 2 * 9)

"""The reference attention a backend is checked against: plain softmax(q k^T * scale + mask) v in
fp32 (or fp64), written here without SDPA, forward and backward, in blocks of queries.

At S = 75,600 one head's score matrix alone is 23 GB in fp32, so the queries are cut into blocks
whose scores (B x h x block x S_k) stay under `block_bytes`: each block's output is computed with
autograd, its backward gives the block's dq and adds its part of dk and dv, and its graph is freed
before the next block. Exact (no online softmax): every block sees all keys.
"""
from __future__ import annotations

import math

import torch


def _expand_heads(t: torch.Tensor, heads: int) -> torch.Tensor:
    """GQA: k, v of h_k heads repeated to the queries' h heads (head i uses k head i // (h / h_k))."""
    return t if t.size(-3) == heads else t.repeat_interleave(heads // t.size(-3), dim=-3)


def reference_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, grad_out: torch.Tensor, *,
                        attn_mask: torch.Tensor | None = None, is_causal: bool = False, scale: float | None = None,
                        enable_gqa: bool = False, dtype: torch.dtype = torch.float32,
                        block_bytes: int = 2 ** 28, **_ignored) -> tuple[torch.Tensor, ...]:
    """(out, dq, dk, dv) in `dtype` of attention over q (..., h, S_q, d), k (..., h_k, S_k, d), v
    (..., h_k, S_k, d_v), backward of grad_out (..., h, S_q, d_v). Inputs are upcast to `dtype`
    first (so the reference sees the same rounded values as the kernel under test). is_causal masks
    key j > query i (top-left aligned, as SDPA does); a bool mask keeps True, a float mask is added;
    masks broadcast like SDPA's. block_bytes bounds one block's score matrix. Extra keyword
    arguments (make_inputs' dropout_p) are accepted and ignored: the caller checks dropout is 0."""
    heads = query.size(-3)
    if key.size(-3) != heads and not enable_gqa:
        raise ValueError(f"query has {heads} heads, key {key.size(-3)}: needs enable_gqa=True")
    q = query.detach().to(dtype)
    k = key.detach().to(dtype).requires_grad_()
    v = value.detach().to(dtype).requires_grad_()
    g = grad_out.detach().to(dtype)
    s_q, s_k = q.size(-2), k.size(-2)
    scale = 1.0 / math.sqrt(q.size(-1)) if scale is None else scale
    rows_per_score = math.prod(q.shape[:-2]) * s_k * torch.finfo(dtype).bits // 8
    block = max(1, min(s_q, block_bytes // max(rows_per_score, 1)))
    out = torch.empty(*q.shape[:-1], v.size(-1), dtype=dtype, device=q.device)
    dq = torch.empty_like(q)
    dk = torch.zeros_like(k)
    dv = torch.zeros_like(v)
    for start in range(0, s_q, block):
        stop = min(start + block, s_q)
        qb = q[..., start:stop, :].detach().requires_grad_()
        scores = (qb @ _expand_heads(k, heads).transpose(-2, -1)) * scale
        if is_causal:
            rows = torch.arange(start, stop, device=q.device)[:, None]
            scores = scores.masked_fill(torch.arange(s_k, device=q.device)[None, :] > rows, float("-inf"))
        if attn_mask is not None:
            m = attn_mask[..., start:stop, :] if attn_mask.size(-2) == s_q else attn_mask
            scores = scores.masked_fill(~m, float("-inf")) if m.dtype == torch.bool else scores + m.to(dtype)
        ob = torch.softmax(scores, dim=-1) @ _expand_heads(v, heads)
        gqb, gk, gv = torch.autograd.grad(ob, (qb, k, v), g[..., start:stop, :])
        out[..., start:stop, :] = ob.detach()
        dq[..., start:stop, :] = gqb
        dk += gk
        dv += gv
        del scores, ob
    return out, dq, dk.detach(), dv.detach()


def relative_error(got: torch.Tensor, ref: torch.Tensor) -> float:
    """||got - ref|| / ||ref|| (Frobenius, differences in ref's dtype, sums in fp64); inf where got has
    a NaN or infinity."""
    ref = ref.detach()
    diff = torch.linalg.vector_norm(got.detach().to(ref.dtype) - ref, dtype=torch.float64)
    norm = torch.linalg.vector_norm(ref, dtype=torch.float64).clamp_min(1e-30)
    value = float(diff / norm)
    return value if math.isfinite(value) else math.inf

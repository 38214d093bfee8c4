"""What a model asks of attention: every `F.scaled_dot_product_attention` call of a step, recorded.

An `SdpaCall` is one distinct call's signature (q, k, v shapes and strides, dtype, flags) with the
number of times a step makes it; a Wan-style DiT of L blocks makes two per step, self-attention
(S x S) and cross-attention (S x L_text), each L times. Strides are kept because the kernels care:
the example model hands SDPA views of (B, S, h, d) projections transposed to (B, h, S, d), and a
backend may copy or refuse a layout that a contiguous test tensor would not show.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, fields, replace

import torch
from torch.overrides import TorchFunctionMode

from lightning_adaptiveload._validation import is_finite_number, require_int

# torch's own function, also while lightning_adaptiveload.attention.backends has put its router in
# torch.nn.functional's place (the router calls this one)
SDPA = torch._C._nn.scaled_dot_product_attention
# its parameters in order (a builtin: no inspectable signature)
SDPA_PARAMETERS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
_DTYPES = {"float32", "float16", "bfloat16", "float64"}


def _dims(name: str, value) -> tuple[int, ...]:
    if not isinstance(value, (tuple, list)) or not value:
        raise ValueError(f"{name} must be a non-empty sequence of integers, got {value!r}")
    return tuple(require_int(f"{name} entries", v, minimum=0) for v in value)


@dataclass(frozen=True)
class SdpaCall:
    """One distinct scaled-dot-product-attention call and how often a step makes it.

    q_shape (..., h_q, S_q, d), k_shape (..., h_k, S_k, d), v_shape (..., h_k, S_k, d_v), each with
    its strides in elements; dtype: the tensors' torch dtype name ("bfloat16"); device_type: "cuda",
    "cpu"; mask_shape / mask_stride / mask_dtype: the attn_mask's, None without one; count: calls of
    this signature per step (forward). Everything but count is the signature (`key`)."""

    q_shape: tuple[int, ...]
    q_stride: tuple[int, ...]
    k_shape: tuple[int, ...]
    k_stride: tuple[int, ...]
    v_shape: tuple[int, ...]
    v_stride: tuple[int, ...]
    dtype: str
    device_type: str
    is_causal: bool = False
    scale: float | None = None
    enable_gqa: bool = False
    dropout_p: float = 0.0
    mask_shape: tuple[int, ...] | None = None
    mask_stride: tuple[int, ...] | None = None
    mask_dtype: str | None = None
    count: int = 1

    def __post_init__(self):
        for t in "qkv":
            shape = _dims(f"{t}_shape", getattr(self, f"{t}_shape"))
            stride = _dims(f"{t}_stride", getattr(self, f"{t}_stride"))
            if len(shape) < 3 or len(stride) != len(shape):
                raise ValueError(f"{t}_shape must have >= 3 dims (..., heads, seq, dim) and {t}_stride as many, "
                                 f"got {shape} and {stride}")
            object.__setattr__(self, f"{t}_shape", shape)
            object.__setattr__(self, f"{t}_stride", stride)
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {self.dtype!r}")
        if not isinstance(self.device_type, str) or not self.device_type:
            raise ValueError(f"device_type must be a device type name such as 'cuda', got {self.device_type!r}")
        if (self.mask_shape is None) != (self.mask_stride is None) or (self.mask_shape is None) != (self.mask_dtype is None):
            raise ValueError("mask_shape, mask_stride and mask_dtype are given together or not at all")
        if self.mask_shape is not None:
            object.__setattr__(self, "mask_shape", _dims("mask_shape", self.mask_shape))
            object.__setattr__(self, "mask_stride", _dims("mask_stride", self.mask_stride))
            if self.mask_dtype not in _DTYPES | {"bool"}:
                raise ValueError(f"mask_dtype must be bool or a float dtype name, got {self.mask_dtype!r}")
        for name in ("is_causal", "enable_gqa"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if self.scale is not None and not is_finite_number(self.scale):
            raise ValueError(f"scale must be a finite number or None, got {self.scale!r}")
        if not is_finite_number(self.dropout_p) or not 0 <= self.dropout_p < 1:
            raise ValueError(f"dropout_p must be a number in [0, 1), got {self.dropout_p!r}")
        require_int("count", self.count)

    @property
    def has_mask(self) -> bool:
        return self.mask_shape is not None

    @property
    def key(self) -> tuple:
        """The signature: every field but count (two calls with one key are the same call)."""
        return tuple(getattr(self, f.name) for f in fields(self) if f.name != "count")

    @property
    def forward_flops(self) -> float:
        """Useful FLOPs of one forward: 2 * B*h * S_q * S_k * (d + d_v) (the two matmuls, 4*B*h*S_q*S_k*d
        for d_v = d), halved for is_causal (half the scores are masked); backward is 2.5x this."""
        *batch_heads, s_q, d = self.q_shape
        s_k, d_v = self.v_shape[-2], self.v_shape[-1]
        flops = 2.0 * math.prod(batch_heads) * s_q * s_k * (d + d_v)
        return flops / 2 if self.is_causal else flops

    @classmethod
    def of_projections(cls, batch_size: int, heads: int, seq_q: int, seq_k: int, head_dim: int, dtype: str,
                       device_type: str = "cuda", count: int = 1) -> "SdpaCall":
        """The call a Wan-style model makes: q (B, S_q, h, d), k and v (B, S_k, h, d) projections
        transposed to (B, h, S, d) views (what the example model and diffusers' Wan hand SDPA for
        cross-attention, and for v of self-attention)."""
        def layout(seq):
            return (batch_size, heads, seq, head_dim), (seq * heads * head_dim, head_dim, heads * head_dim, 1)

        (q_shape, q_stride), (k_shape, k_stride) = layout(seq_q), layout(seq_k)
        return cls(q_shape, q_stride, k_shape, k_stride, k_shape, k_stride, dtype=dtype, device_type=device_type,
                   count=count)

    def with_batch(self, batch_size: int) -> "SdpaCall":
        """The call with its leading dim set to `batch_size` (strides kept: the same layout, fewer samples)."""
        require_int("batch_size", batch_size)
        changes = {f"{t}_shape": (batch_size, *getattr(self, f"{t}_shape")[1:]) for t in "qkv"}
        if self.mask_shape is not None and self.mask_shape[0] != 1:  # a broadcast mask keeps its 1
            changes["mask_shape"] = (batch_size, *self.mask_shape[1:])
        return replace(self, **changes)

    def to_dict(self) -> dict:
        doc = asdict(self)
        return {k: (list(v) if isinstance(v, tuple) else v) for k, v in doc.items()}

    @classmethod
    def from_dict(cls, doc: Mapping, where: str = "call") -> "SdpaCall":
        """The call of a `to_dict` document; ValueError naming `where` for anything malformed."""
        if not isinstance(doc, Mapping):
            raise ValueError(f"{where}: must be an object, got {type(doc).__name__}")
        unknown = sorted(set(doc) - {f.name for f in fields(cls)})
        if unknown:
            raise ValueError(f"{where}: unknown keys {unknown}")
        try:
            return cls(**doc)
        except (TypeError, ValueError) as e:
            raise ValueError(f"{where}: {e}") from e


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def bind_sdpa_arguments(args: tuple, kwargs: Mapping) -> dict:
    """F.scaled_dot_product_attention's arguments by name, defaults filled in."""
    bound = dict(zip(SDPA_PARAMETERS, args))
    bound.update(kwargs)
    defaults = {"attn_mask": None, "dropout_p": 0.0, "is_causal": False, "scale": None, "enable_gqa": False}
    return {**defaults, **bound}


def call_of(args: tuple, kwargs: Mapping) -> SdpaCall:
    """The SdpaCall of one F.scaled_dot_product_attention(*args, **kwargs)."""
    a = bind_sdpa_arguments(args, kwargs)
    q, k, v, mask = a["query"], a["key"], a["value"], a["attn_mask"]
    return SdpaCall(
        q_shape=tuple(q.shape), q_stride=tuple(q.stride()), k_shape=tuple(k.shape), k_stride=tuple(k.stride()),
        v_shape=tuple(v.shape), v_stride=tuple(v.stride()), dtype=dtype_name(q.dtype), device_type=q.device.type,
        is_causal=bool(a["is_causal"]), scale=None if a["scale"] is None else float(a["scale"]),
        enable_gqa=bool(a["enable_gqa"]), dropout_p=float(a["dropout_p"]),
        mask_shape=None if mask is None else tuple(mask.shape),
        mask_stride=None if mask is None else tuple(mask.stride()),
        mask_dtype=None if mask is None else dtype_name(mask.dtype))


class _Recorder(TorchFunctionMode):
    """Counts every F.scaled_dot_product_attention call by signature, in order of first sight."""

    def __init__(self):
        super().__init__()
        self.counts: dict[tuple, list] = {}  # key -> [first call, count]

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is SDPA:
            call = call_of(args, kwargs)
            self.counts.setdefault(call.key, [call, 0])[1] += 1
        return func(*args, **kwargs)


def record_sdpa_calls(fn: Callable[[], object]) -> list[SdpaCall]:
    """Run fn() and return its distinct scaled-dot-product-attention calls with counts, in the order
    each was first made.

    A TorchFunctionMode sees every call however the code reached the function (F.sdpa, an alias
    bound at import, a library's dispatcher). Compiled regions run eagerly meanwhile
    (`torch.compiler.set_stance("force_eager")`): a compiled graph would hide its calls. Record a
    forward (the step's backward makes no new calls unless activation checkpointing recomputes the
    forward, which would count each call twice)."""
    recorder = _Recorder()
    with torch.compiler.set_stance("force_eager"), recorder:
        fn()
    return [replace(call, count=n) for call, n in recorder.counts.values()]


def make_inputs(call: SdpaCall, device: torch.device | str, seed: int = 0, requires_grad: bool = True) -> dict:
    """Random leaf tensors with the call's shapes, strides and dtype on `device`, as keyword arguments
    of F.scaled_dot_product_attention (query, key, value, attn_mask, is_causal, scale, enable_gqa,
    dropout_p), N(0, 1) entries drawn from `seed`. Each tensor is a strided view of its own storage, so layouts with
    gaps or overlaps (stride 0) are reproduced too. A bool mask is all True, a float mask zeros (the
    kernels' cost does not depend on the mask's values)."""
    dtype = getattr(torch, call.dtype)
    generator = torch.Generator(device=device).manual_seed(seed)

    def strided(shape, stride, dt, fill):
        size = 1 + sum((n - 1) * s for n, s in zip(shape, stride)) if all(shape) else 0
        if fill == "randn":
            base = torch.randn(size, generator=generator, device=device, dtype=torch.float32).to(dt)
        else:
            base = torch.full((size,), fill, device=device, dtype=dt)
        return base.as_strided(shape, stride)

    out = {name: strided(getattr(call, f"{t}_shape"), getattr(call, f"{t}_stride"), dtype, "randn").detach()
           .requires_grad_(requires_grad) for t, name in zip("qkv", ("query", "key", "value"))}
    if call.has_mask:
        mask_dtype = getattr(torch, call.mask_dtype)
        out["attn_mask"] = strided(call.mask_shape, call.mask_stride, mask_dtype, True if call.mask_dtype == "bool" else 0.0)
    out.update(is_causal=call.is_causal, scale=call.scale, enable_gqa=call.enable_gqa, dropout_p=call.dropout_p)
    return out

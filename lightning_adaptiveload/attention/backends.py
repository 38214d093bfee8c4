"""Attention backends by name, and running a model's attention under one of them, compiled or not.

Names: torch SDPA's kernels "flash", "efficient" (memory-efficient), "cudnn", and "math" (the
unfused reference, never a candidate), chosen through `torch.nn.attention.sdpa_kernel`; and, when
importable, external FlashAttention builds with Hopper kernels: "fa4" (`flash_attn.cute` of the
flash-attn-4 package) and "fa3" (`flash_attn_interface`, FlashAttention 3). The external ones are
detected, never required.

Why a router in torch.nn.functional's place: torch.compile picks the SDPA kernel when it traces
(the choice is baked into the graph: the aten op of the backend enabled at trace time) and does
not guard on `sdpa_kernel`'s state, so a graph traced under one backend silently keeps running it
under another (tests/attention/test_compile.py shows both). `attention_backend(name)` therefore
sets a module global that `scaled_dot_product_attention` below reads and installs that function
as `torch.nn.functional.scaled_dot_product_attention`. Dynamo inlines it, guards on the global's
value and on the identity of `F.scaled_dot_product_attention`, and bakes the `sdpa_kernel` it
enters into the graph: a compiled region recompiles once per backend it meets and then runs the
one asked for. The cost: one graph per (code object, backend) with dynamic shapes, per (code
object, shape, backend) with static ones. A TorchFunctionMode would also be guarded, but dynamo
breaks the graph at Python-level tensor methods under a mode (`Tensor.unflatten` in the example
block: 15 graph breaks), so it is used only to record calls (calls.py), never to apply a backend.
The router reaches code that looks the function up at call time (`F.scaled_dot_product_attention`,
`torch.nn.functional.scaled_dot_product_attention`: the example model, diffusers); the global
`sdpa_kernel` state set alongside covers torch-backend calls made through an alias bound at import.
"""
from __future__ import annotations

import contextlib
import importlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from lightning_adaptiveload.attention.calls import SDPA, SdpaCall, bind_sdpa_arguments

TORCH_BACKENDS = {"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
                  "cudnn": SDPBackend.CUDNN_ATTENTION, "math": SDPBackend.MATH}
# the aten ops each torch backend runs (prefixes: CPU's flash op is _scaled_dot_product_flash_attention_for_cpu);
# math has none of its own: its matmuls and softmax show instead
BACKEND_OPS = {"flash": "aten::_scaled_dot_product_flash_attention",
               "efficient": "aten::_scaled_dot_product_efficient_attention",
               "cudnn": "aten::_scaled_dot_product_cudnn_attention",
               "math": "aten::_scaled_dot_product_attention_math"}
REFERENCE = "math"


@dataclass(frozen=True)
class ExternalBackend:
    """A FlashAttention build outside torch: `module.function(q, k, v, softmax_scale=, causal=)` on
    (B, S, h, d) tensors, returning out or (out, lse, ...)."""

    name: str
    module: str
    function: str
    package: str  # what to install
    devices: tuple[str, ...] = ("cuda",)

    def load(self) -> Callable:
        """The attention function; ImportError (or whatever the import raised) when it cannot be had."""
        return getattr(importlib.import_module(self.module), self.function)


EXTERNAL_BACKENDS = {b.name: b for b in (
    ExternalBackend("fa4", "flash_attn.cute", "flash_attn_func", "flash-attn-4"),
    ExternalBackend("fa3", "flash_attn_interface", "flash_attn_func", "flash-attn 3 (hopper/ of flash-attention)"),
)}
BACKENDS = (*TORCH_BACKENDS, *EXTERNAL_BACKENDS)


def require_backend(name: str) -> str:
    if name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; known: {', '.join(BACKENDS)}")
    return name


def external_status() -> dict[str, str | None]:
    """External backend name -> None if importable, else why not (the import's error)."""
    status = {}
    for name, backend in EXTERNAL_BACKENDS.items():
        try:
            backend.load()
            status[name] = None
        except Exception as e:  # an optional extension may fail to import in any way (missing CUDA libs, ABI)
            status[name] = f"{type(e).__name__}: {e}"
    return status


def candidate_backends(device_type: str) -> list[str]:
    """The backends worth measuring on `device_type`: torch's fused ones (CPU has only flash) and
    the importable external ones on CUDA."""
    if device_type != "cuda":
        return ["flash"]
    return ["flash", "efficient", "cudnn"] + [n for n, why in external_status().items() if why is None]


def external_unsupported(args: dict, backend: ExternalBackend) -> str | None:
    """Why an external FlashAttention cannot take this call (None: it can): they take no mask or
    dropout, 4-D (B, h, S, d) inputs of fp16/bf16 on their devices, one head dim <= 256."""
    q, k, v = args["query"], args["key"], args["value"]
    if args["attn_mask"] is not None or args["dropout_p"]:
        return "an attention mask or dropout"
    if q.dim() != 4 or q.dtype not in (torch.float16, torch.bfloat16) or q.device.type not in backend.devices:
        return f"{q.dim()}-D {q.dtype} on {q.device.type} (needs 4-D fp16/bf16 on {', '.join(backend.devices)})"
    if q.size(-1) != v.size(-1) or q.size(-1) > 256 or q.size(1) % k.size(1):
        return "head dims or head counts it does not take"
    return None


def run_external(fn: Callable, args: dict) -> torch.Tensor:
    """An external FlashAttention on SDPA's (B, h, S, d) arguments: it takes (B, S, h, d) with the
    last dim contiguous, which the example's transposed projections already are."""
    def layout(t):
        t = t.transpose(1, 2)
        return t if t.stride(-1) == 1 else t.contiguous()

    out = fn(layout(args["query"]), layout(args["key"]), layout(args["value"]), softmax_scale=args["scale"],
             causal=args["is_causal"])
    return (out[0] if isinstance(out, tuple) else out).transpose(1, 2)


def _priority(name: str, strict: bool) -> tuple[SDPBackend, ...]:
    """`name` first, then (unless strict) torch's other kernels, math last: a call the chosen kernel
    refuses still runs. (torch's CPU selection ignores a priority order: flash, then math, always.)"""
    if strict:
        return (TORCH_BACKENDS[name],)
    return (TORCH_BACKENDS[name],) + tuple(b for n, b in TORCH_BACKENDS.items() if n != name)


# What the router applies: None (torch's own choice), a tuple of SDPBackend in priority order, or
# (external backend name, strict). Dynamo guards on this value in every graph that traced the router.
_active: tuple | None = None
_externals: dict[str, Callable] = {}


def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                                 enable_gqa=False):
    """F.scaled_dot_product_attention under the backend `attention_backend` set (module docstring)."""
    active = _active
    if active is None:
        return SDPA(query, key, value, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa)
    if isinstance(active[0], str):
        name, strict = active
        args = bind_sdpa_arguments((query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa), {})
        why = external_unsupported(args, EXTERNAL_BACKENDS[name])
        if why is None:
            return run_external(_externals[name], args)
        if strict:
            raise RuntimeError(f"attention backend {name} does not take {why}")
        return SDPA(query, key, value, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa)
    with sdpa_kernel(list(active), set_priority=True):
        return SDPA(query, key, value, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa)


def install_router() -> None:
    """Put `scaled_dot_product_attention` in torch.nn.functional's place (idempotent). With no backend
    active it calls torch's own function unchanged."""
    if F.scaled_dot_product_attention is not scaled_dot_product_attention:
        if F.scaled_dot_product_attention is not SDPA:
            raise RuntimeError("torch.nn.functional.scaled_dot_product_attention was already replaced by "
                               f"{F.scaled_dot_product_attention!r}; attention backends cannot be applied over it")
        F.scaled_dot_product_attention = scaled_dot_product_attention


@contextlib.contextmanager
def attention_backend(name: str | None, strict: bool = False) -> Iterator[None]:
    """Run the model's attention under backend `name` (None: torch's own choice, nothing changed)
    until the block exits, forward and backward, eager and compiled (module docstring).

    Torch backends: `name` first, torch's other kernels after it where it refuses a call, unless
    strict (then only `name`, and a call it refuses raises). External backends take the calls they
    support (`external_unsupported`), torch's own choice the rest (strict: a RuntimeError); ImportError
    if not importable.
    Process-wide, like sdpa_kernel: enter it around whole steps, not per thread."""
    global _active
    if name is None:
        yield
        return
    require_backend(name)
    install_router()
    previous = _active
    if name in EXTERNAL_BACKENDS:
        if name not in _externals:
            _externals[name] = EXTERNAL_BACKENDS[name].load()
        _active = (name, bool(strict))
        try:
            yield
        finally:
            _active = previous
        return
    order = _priority(name, strict)
    _active = order
    try:
        with sdpa_kernel(list(order), set_priority=True):
            yield
    finally:
        _active = previous


def active_backend() -> tuple | None:
    """What the router applies now (for tests and logs)."""
    return _active


def torch_choice(call_args: dict) -> str | None:
    """The torch kernel SDPA would pick for these arguments under the current settings (name), None
    when none can run them."""
    a = bind_sdpa_arguments((), call_args)
    choice = torch._fused_sdp_choice(a["query"], a["key"], a["value"], a["attn_mask"], a["dropout_p"],
                                     a["is_causal"], scale=a["scale"], enable_gqa=a["enable_gqa"])
    names = {int(b): n for n, b in TORCH_BACKENDS.items()}
    return names.get(int(choice))


def backends_run(fn: Callable[[], object]) -> set[str]:
    """The torch attention backends whose aten ops ran during fn() (profiled: CPU-side op events,
    which inductor's extern kernels emit too), e.g. {"flash"}; "math" where its op ran or, in a
    compiled graph that decomposed it, no fused attention op ran but batched matmuls or a softmax
    did (so fn should run attention only)."""
    from torch.profiler import profile

    with profile() as prof:
        fn()
    keys = {e.key for e in prof.key_averages()}
    ran = {name for name, op in BACKEND_OPS.items() if any(k.startswith(op) for k in keys)}
    if not ran and any("softmax" in k or k in ("aten::bmm", "aten::baddbmm") for k in keys):
        ran.add("math")
    return ran


def forward_backward(call_args: dict, grad_out: torch.Tensor | None = None) -> tuple:
    """SDPA's output and the grads of q, k, v for `call_args` (make_inputs' dict; the leaves need
    requires_grad) through F.scaled_dot_product_attention (the router when installed), backward of
    `grad_out` (ones when None: timing only)."""
    out = F.scaled_dot_product_attention(**call_args)
    if grad_out is None:
        grad_out = torch.ones_like(out)
    leaves = [call_args[n] for n in ("query", "key", "value")]
    return (out, *torch.autograd.grad(out, leaves, grad_out))


def describe(call: SdpaCall) -> str:
    """A short human name of a call: "self 75600x75600" style (B, heads, S_q x S_k, d, dtype)."""
    *b, h, s_q, d = call.q_shape
    return f"B={b[0] if b else 1} h={h} {s_q}x{call.k_shape[-2]} d={d} {call.dtype}"

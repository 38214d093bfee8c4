"""Which sizes `torch.compile(dynamic=True)` makes symbolic in a block whose parameters are plain
tensor views of one flat tensor, as FSDP1 (`use_orig_params=True`) sets them on the module during
forward, against the same block holding `nn.Parameter`s (CPU, no FSDP needed: FSDP1 wants an
accelerator, so its forward-time views are built by hand).

    python benchmarks/e2e/fsdp_param_views.py --out benchmarks/results/fsdp_param_views_cpu.json

Why: `compile: dynamic` under FSDP1 failed with an illegal memory access in an inductor kernel
(gpu_session6 at 75,600 tokens; gpu_session10 at 256 tokens, `compile_crash.py`
dynamic_fused_fsdp_ckpt_all_views), and that run's graphs carry the parameters' sizes as symbols
(the modulation's 6 chunks as `(s81 + 5)//6`, D as `s18`); without FSDP the same compile ran both
shapes. Per case: each graph input's name and shape as dynamo traced it (a symbol where it is
dynamic). Cases: `parameters` and `flat_views` compiled by `nn.Module.compile(dynamic=True)`;
`flat_views_compile_blocks` compiled by `regional_compile.compile_blocks(..., "dynamic")`, which marks
a block's plain tensor attributes static at every call (the fix).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root (see benchmarks/_meta.py)
from benchmarks._meta import run_meta, write_result  # noqa: E402
from lightning_adaptiveload import regional_compile  # noqa: E402


class Block(nn.Module):
    """An AdaLN-modulated linear: a (1, 6, D) modulation table chunked in 6, as the DiT blocks do."""

    def __init__(self, dim: int):
        super().__init__()
        self.modulation = nn.Parameter(torch.randn(1, 6, dim) / dim**0.5)
        self.linear = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
        shift, scale, *_ = (self.modulation + e).chunk(6, dim=1)
        return self.linear(x * (1 + scale) + shift)


def as_flat_views(block: nn.Module) -> None:
    """Replace every parameter by a plain tensor view into one flat tensor (FSDP1's forward-time views)."""
    params = list(block.named_parameters())
    flat = torch.cat([p.detach().reshape(-1) for _, p in params]).requires_grad_()
    offset = 0
    for name, p in params:
        owner, _, leaf = name.rpartition(".")
        module = block.get_submodule(owner) if owner else block
        del module._parameters[leaf]
        setattr(module, leaf, flat[offset:offset + p.numel()].view(p.shape))
        offset += p.numel()


CASES = {  # name -> (the parameters as flat views, compiled by compile_blocks)
    "parameters": (False, False), "flat_views": (True, False), "flat_views_compile_blocks": (True, True)}


def traced_inputs(views: bool, dim: int, tokens: int, compile_blocks: bool = False) -> dict[str, list[str]]:
    """name -> traced shape of every input of the graph dynamo captured for one forward + backward,
    the block compiled by `nn.Module.compile(dynamic=True)` or, `compile_blocks`, by ours."""
    torch._dynamo.reset()
    seen: dict[str, list[str]] = {}

    def backend(gm: torch.fx.GraphModule, example_inputs):
        for node in gm.graph.nodes:
            if node.op == "placeholder" and isinstance(node.meta.get("example_value"), torch.Tensor):
                seen[node.name] = [str(s) for s in node.meta["example_value"].shape]
        return gm.forward

    torch.manual_seed(0)
    block = Block(dim)
    if views:
        as_flat_views(block)
    if compile_blocks:
        regional_compile.compile_blocks([block], "dynamic", backend=backend)
    else:
        block.compile(dynamic=True, backend=backend)
    x = torch.randn(1, tokens, dim, requires_grad=True)
    block(x, torch.randn(1, 6, dim)).sum().backward()
    return seen


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=32)
    args = parser.parse_args(argv)
    cases = {name: traced_inputs(views, args.dim, args.tokens, ours) for name, (views, ours) in CASES.items()}
    for name, inputs in cases.items():
        symbolic = {k: v for k, v in inputs.items() if not all(s.isdigit() for s in v)}
        print(f"{name:26s} {len(inputs)} inputs, symbolic: " + "; ".join(f"{k} {v}" for k, v in symbolic.items()))
    write_result(args.out, {**run_meta("fsdp_param_views", argv), "dim": args.dim, "tokens": args.tokens, "cases": cases})


if __name__ == "__main__":
    main()

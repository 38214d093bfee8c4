"""Host time per call of the fused AdaLN op layer (`ops.adaln_modulate`), by design, in one run.

Designs (same Python argument checks in front of each):
- `custom_op`: the `torch.library` custom op `adaptiveload::adaln_fwd` with its Python autograd
  (`register_autograd`); what eager CUDA calls ran until the C++ autograd path, and what
  torch.compile and other tracers still see.
- `cpp_autograd`: the extension's `adaln_eager`, forward and backward as one C++ autograd
  function (what eager CUDA calls run now).
Context: `aten_mul` (`x * 2` forward + backward: the autograd engine's floor for one node),
`yardsticks` (the marginal cost, defined below, of an op made of plain ATen calls: `wan_eager` =
Wan 2.1's unfused `(layer_norm(x.float()) * (1 + scale) + shift).type_as(x)`, what surgery
replaces; `aten_mul` = `h * 2`) and `breakdown` (host us of each piece of one eager call: the
chunk views, the Python argument checks, `adaln_eager` with autograd, the bare forward and
backward launchers, and `x * 2` / `empty_like` as this host's yardstick).

On a machine without a GPU (default there) the designs run on CPU with tiny tensors
(B, N, D) = (1, 4, 8): `custom_op` with the reference kernels (as CPU calls run) and, for both
designs, with no-op kernels from a stub build of csrc/adaln_bindings.cpp (allocations as the real
launchers, no math; JIT-compiled with g++ on first run, ~1 min), so the two designs differ
only in their op layer. Times are us per call: the best of `--repeats` averages over `--calls`
calls, one thread. `fwd` = forward with autograd recording, `fwd_bwd` = forward +
`torch.autograd.grad` to x and the (B, 6, D) time embedding the shift/scale `chunk` views come
from (+ weight, bias when affine); `fwd_bwd_marginal_us` = what one more op adds to a chain of
ops that feed each other, each with its own (B, 1, D) shift/scale leaves, under one backward
call: (time of 16 - time of 8) / 8. That is an op's cost inside a model's training step: the
autograd engine's fixed cost per backward call (most of `aten_mul`'s) and the chunk's backward
are not in it.

On a GPU (`--device cuda`, the default there; needs the built extension) for each shape, bf16 x
and fp32 (B, 1, D) chunk views: `host_*_us` = host time to issue one call (perf_counter, no
synchronization inside the timed calls, few enough calls that the launch queue never fills),
`gpu_*_us` = GPU time per call from CUDA events around calls queued behind a sleep kernel (no
host gaps: pure GPU time), `wall_fwd_bwd_us` = back-to-back calls with a final synchronize, per
call. wall ~= gpu means the GPU is the limit; wall ~= host means the host is.

    python benchmarks/kernel/adaln_host.py                       # CPU: benchmarks/results/adaln_host_cpu.json
    python benchmarks/kernel/adaln_host.py --device cuda         # GPU: benchmarks/results/adaln_host_gpu.json
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root (see benchmarks/_meta.py)
from benchmarks._meta import RESULTS, run_meta, write_result  # noqa: E402

from lightning_adaptiveload import ops  # noqa: E402
from lightning_adaptiveload.ops import adaln  # noqa: E402
from lightning_adaptiveload.ops._build import build_spec  # noqa: E402
from lightning_adaptiveload.ops.extension import CSRC_DIR, load_extension  # noqa: E402
from lightning_adaptiveload.ops.reference import adaln_bwd_reference, adaln_fwd_reference  # noqa: E402

CPU_SHAPE = (1, 4, 8)
GPU_SHAPES = [(1, 256, 1536), (1, 16384, 1536), (1, 65536, 1536), (2, 32760, 5120)]
EPS = 1e-6
GPU_QUEUED_CALLS = 50  # 3-6 kernels per pair: well inside CUDA's launch queue, so issuing never blocks
CHAIN = 8  # the marginal cost per op: (16 chained ops - 8 chained ops) / 8

# No-op stand-ins for the CUDA launchers of csrc/adaln_launch.cu: the same outputs, allocated, not
# computed. Linked with the real csrc/adaln_bindings.cpp, they give the real op layer on CPU.
STUB_LAUNCHERS = r"""
#include "adaln.h"
namespace adaptiveload {
std::vector<at::Tensor> adaln_fwd_cuda(const at::Tensor& x, const at::Tensor&, const at::Tensor&,
                                       const std::optional<at::Tensor>&, const std::optional<at::Tensor>&, double) {
  at::Tensor mean = at::empty({x.size(0), x.size(1)}, x.options().dtype(at::kFloat));
  return {at::empty_like(x), mean, at::empty_like(mean)};
}
std::vector<at::Tensor> adaln_bwd_cuda(const at::Tensor&, const at::Tensor& x, const at::Tensor& scale,
                                       const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias,
                                       const at::Tensor&, const at::Tensor&) {
  const auto f32 = x.options().dtype(at::kFloat);
  at::Tensor dshift = at::empty({x.size(0), scale.size(1), x.size(2)}, scale.options());
  return {at::empty_like(x), dshift, at::empty_like(dshift), at::empty({weight ? x.size(2) : 0}, f32),
          at::empty({bias ? x.size(2) : 0}, f32)};
}
}  // namespace adaptiveload
"""


def build_stub():
    """csrc/adaln_bindings.cpp + STUB_LAUNCHERS as a CPU extension (cached by torch)."""
    from torch.utils.cpp_extension import load

    stub_dir = Path(tempfile.gettempdir()) / "adaptiveload_host_stub"
    stub_dir.mkdir(exist_ok=True)
    stub = stub_dir / "stub_launchers.cpp"
    if not stub.is_file() or stub.read_text() != STUB_LAUNCHERS:
        stub.write_text(STUB_LAUNCHERS)
    spec = build_spec(CSRC_DIR)
    return load(name="adaptiveload_host_stub", sources=[str(CSRC_DIR / "adaln_bindings.cpp"), str(stub)],
                extra_include_paths=spec.include_dirs, extra_cflags=spec.cxx_flags, verbose=False)


@contextmanager
def design(name: str, stub=None):
    """Route adaln_modulate's calls through one design (and, with `stub`, its no-op kernels)."""
    saved = adaln._eager_kernels, adaln.adaln_fwd_reference, adaln.adaln_bwd_reference
    if name == "custom_op":
        adaln._eager_kernels = lambda x: None
        if stub is not None:  # what the custom op's CUDA kernel does, with the stub's launchers
            adaln.adaln_fwd_reference = lambda *a: tuple(stub.adaln_fwd(*a))
            adaln.adaln_bwd_reference = lambda *a: tuple(stub.adaln_bwd(*a))
    elif name == "cpp_autograd":
        if stub is not None:
            adaln._eager_kernels = lambda x: stub
    else:
        raise ValueError(name)
    try:
        yield
    finally:
        adaln._eager_kernels, adaln.adaln_fwd_reference, adaln.adaln_bwd_reference = saved


def make_case(shape, x_dtype, affine, device):
    batch, seq, dim = shape
    gen = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(batch, seq, dim, generator=gen, device=device).to(x_dtype).requires_grad_()
    emb = torch.randn(batch, 6, dim, generator=gen, device=device).requires_grad_()  # fp32, Wan-style
    weight = torch.randn(dim, generator=gen, device=device).requires_grad_() if affine else None
    bias = torch.randn(dim, generator=gen, device=device).requires_grad_() if affine else None
    dy = torch.randn(batch, seq, dim, generator=gen, device=device).to(x_dtype)
    leaves = [t for t in (x, emb, weight, bias) if t is not None]

    def forward():
        shift, scale = emb.chunk(6, dim=1)[:2]
        return ops.adaln_modulate(x, shift, scale, weight, bias, EPS)

    def forward_backward():
        torch.autograd.grad(forward(), leaves, dy)

    # Ops feeding each other, each with its own (B, 1, D) shift/scale leaves, one backward call.
    mods = [(0.5 * torch.randn(batch, 2, 1, dim, generator=gen, device=device)).unbind(1) for _ in range(2 * CHAIN)]
    mods = [tuple(t.requires_grad_() for t in m) for m in mods]

    def chain(ops_count: int, op=None):
        op = op or (lambda h, shift, scale: ops.adaln_modulate(h, shift, scale, weight, bias, EPS))
        chain_leaves = [x] + [t for m in mods[:ops_count] for t in m] + [t for t in (weight, bias) if t is not None]

        def run():
            h = x
            for shift, scale in mods[:ops_count]:
                h = op(h, shift, scale)
            torch.autograd.grad(h, chain_leaves, dy, allow_unused=True)

        return run

    yardsticks = {  # what an op of plain ATen calls costs this host, chained the same way
        "wan_eager": lambda h, shift, scale: (
            F.layer_norm(h.float(), (dim,), weight, bias, EPS) * (1 + scale) + shift).type_as(h),
        "aten_mul": lambda h, shift, scale: h * 2,
    }

    def aten_forward_backward():
        torch.autograd.grad(x * 2, x, dy)

    return {"x": x, "emb": emb, "weight": weight, "bias": bias, "dy": dy, "forward": forward,
            "forward_backward": forward_backward, "chain": chain, "yardsticks": yardsticks,
            "aten_forward_backward": aten_forward_backward}


def breakdown(c: dict, ext, calls: int, repeats: int, sync=None) -> dict:
    """Host us of the pieces of one call on the C++ path, and of plain ATen calls as this host's yardstick."""
    x, emb, weight, bias, dy = c["x"], c["emb"], c["weight"], c["bias"], c["dy"]
    shift, scale = emb.chunk(6, dim=1)[:2]
    args = adaln._canonical_args(x, shift, scale, weight, bias, EPS)
    with torch.no_grad():
        _, mean, rstd = ext.adaln_fwd(*args)
    pieces = {
        "chunk": lambda: emb.chunk(6, dim=1)[:2],
        "checks": lambda: adaln._canonical_args(x, shift, scale, weight, bias, EPS),
        "adaln_eager_call": lambda: ext.adaln_eager(*args),
        "launcher_fwd": lambda: ext.adaln_fwd(*args),
        "launcher_bwd": lambda: ext.adaln_bwd(dy, args[0], args[2], args[3], args[4], mean, rstd),
        "aten_mul_fwd": lambda: x * 2,
        "aten_empty_like": lambda: torch.empty_like(x),
    }
    return {f"{name}_us": round(best_us_per_call(fn, calls, repeats, sync), 1) for name, fn in pieces.items()}


def best_us_per_call(fn, calls: int, repeats: int, sync=None) -> float:
    for _ in range(calls // 10 + 1):  # warm-up
        fn()
    best = float("inf")
    for _ in range(repeats):
        if sync:
            sync()
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - start) / calls * 1e6)
    if sync:
        sync()
    return best


def cpu_rows(calls: int, repeats: int) -> list[dict]:
    stub = build_stub()
    rows = []
    for case_name, x_dtype, affine in [("bf16 x, fp32 (B,1,D) chunk views", torch.bfloat16, False),
                                       ("fp32 x, affine", torch.float32, True)]:
        c = make_case(CPU_SHAPE, x_dtype, affine, "cpu")
        row = {"case": case_name}
        with design("custom_op"):
            row["custom_op_reference_kernels"] = fwd_and_pair(c, calls, repeats)
        for name in ("custom_op", "cpp_autograd"):
            with design(name, stub):
                row[f"{name}_noop_kernels"] = fwd_and_pair(c, calls, repeats)
        with torch.no_grad():
            args = (c["x"], c["emb"][:, 0:1], c["emb"][:, 1:2], c["weight"], c["bias"], EPS)
            _, mean, rstd = adaln_fwd_reference(*args)
            row["reference_math_fwd_us"] = round(best_us_per_call(lambda: adaln_fwd_reference(*args), calls, repeats), 1)
            row["reference_math_bwd_us"] = round(best_us_per_call(
                lambda: adaln_bwd_reference(c["dy"], args[0], args[2], args[3], args[4], mean, rstd), calls, repeats), 1)
        row["aten_mul_fwd_bwd_us"] = round(best_us_per_call(c["aten_forward_backward"], calls, repeats), 1)
        row["yardsticks"] = yardstick_marginals(c, calls, repeats)
        row["breakdown_noop_kernels"] = breakdown(c, stub, calls, repeats)
        rows.append(row)
    return rows


def fwd_and_pair(c: dict, calls: int, repeats: int, sync=None) -> dict:
    fwd = best_us_per_call(c["forward"], calls, repeats, sync)
    pair = best_us_per_call(c["forward_backward"], calls, repeats, sync)
    return {"fwd_us": round(fwd, 1), "fwd_bwd_us": round(pair, 1), "bwd_us": round(pair - fwd, 1),
            "fwd_bwd_marginal_us": marginal_us(c, calls, repeats, sync)}


def marginal_us(c: dict, calls: int, repeats: int, sync=None, op=None) -> float:
    """Host us that one more op adds to a chain under one backward call: (16 ops - 8 ops) / 8."""
    chain_calls = max(1, calls // (2 * CHAIN))
    short, long = (best_us_per_call(c["chain"](n, op), chain_calls, repeats, sync) for n in (CHAIN, 2 * CHAIN))
    return round((long - short) / CHAIN, 1)


def yardstick_marginals(c: dict, calls: int, repeats: int, sync=None) -> dict:
    return {f"{name}_marginal_us": marginal_us(c, calls, repeats, sync, op) for name, op in c["yardsticks"].items()}


def gpu_time_us(fn, calls: int, host_us: float) -> float:
    """GPU time per call: calls queued behind a sleep kernel long enough to cover their issue,
    so the events see back-to-back GPU work with no host gaps. If the GPU reached the start
    event before the last call was issued (the sleep was too short), measure again with a
    longer sleep."""
    torch.cuda.synchronize()
    probe_start, probe_end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    probe_start.record()
    torch.cuda._sleep(1_000_000)
    probe_end.record()
    torch.cuda.synchronize()
    cycles_per_us = 1_000_000 / (probe_start.elapsed_time(probe_end) * 1e3)
    sleep_us = 2 * calls * host_us + 2000
    for _ in range(4):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(int(cycles_per_us * sleep_us))
        start.record()
        for _ in range(calls):
            fn()
        covered = not start.query()  # still behind the sleep when the last call was issued
        end.record()
        torch.cuda.synchronize()
        if covered:
            return start.elapsed_time(end) * 1e3 / calls
        sleep_us *= 4
    raise RuntimeError(f"could not queue {calls} calls behind a {sleep_us / 4:.0f} us sleep kernel")


def gpu_rows(calls: int, repeats: int, shapes: list[tuple[int, int, int]]) -> list[dict]:
    sync = torch.cuda.synchronize
    rows = []
    for shape in shapes:
        c = make_case(shape, torch.bfloat16, False, "cuda")
        per_launch_queue = max(5, min(calls, GPU_QUEUED_CALLS))
        row = {"case": f"{shape} bf16 x, fp32 (B,1,D) chunk views"}
        for name in ("custom_op", "cpp_autograd"):
            with design(name):
                host = fwd_and_pair(c, per_launch_queue, repeats, sync)
                r = {"host_fwd_us": host["fwd_us"], "host_fwd_bwd_us": host["fwd_bwd_us"], "host_bwd_us": host["bwd_us"],
                     "host_fwd_bwd_marginal_us": host["fwd_bwd_marginal_us"]}
                r["gpu_fwd_us"] = round(gpu_time_us(c["forward"], per_launch_queue, host["fwd_us"]), 1)
                r["gpu_fwd_bwd_us"] = round(gpu_time_us(c["forward_backward"], per_launch_queue, host["fwd_bwd_us"]), 1)
                sync()
                start = time.perf_counter()
                for _ in range(calls):
                    c["forward_backward"]()
                sync()
                r["wall_fwd_bwd_us"] = round((time.perf_counter() - start) / calls * 1e6, 1)
                row[name] = r
        row["aten_mul_host_fwd_bwd_us"] = round(best_us_per_call(c["aten_forward_backward"], per_launch_queue, repeats, sync), 1)
        row["yardsticks"] = yardstick_marginals(c, per_launch_queue, repeats, sync)
        row["breakdown"] = breakdown(c, load_extension()[0], per_launch_queue, repeats, sync)
        rows.append(row)
        del c
        torch.cuda.empty_cache()
    return rows


def print_cpu(rows: list[dict]) -> None:
    print(f"host time per call, us; CPU, (B, N, D) = {CPU_SHAPE}, 1 thread")
    print(f"{'case':<34} {'design':<28} {'fwd':>7} {'bwd':>7} {'fwd+bwd':>8} {'marginal':>8}")
    for r in rows:
        for key in ("custom_op_reference_kernels", "custom_op_noop_kernels", "cpp_autograd_noop_kernels"):
            d = r[key]
            print(f"{r['case']:<34} {key:<28} {d['fwd_us']:>7.1f} {d['bwd_us']:>7.1f} {d['fwd_bwd_us']:>8.1f}"
                  f" {d['fwd_bwd_marginal_us']:>8.1f}")
        print(f"{'':<34} reference math fwd {r['reference_math_fwd_us']}, bwd {r['reference_math_bwd_us']}; "
              f"x*2 fwd+bwd {r['aten_mul_fwd_bwd_us']}; marginal {r['yardsticks']}")
        print(f"{'':<34} pieces: {r['breakdown_noop_kernels']}")


def print_gpu(rows: list[dict]) -> None:
    print("us per call (host: issue time; gpu: CUDA events, no host gaps; wall: back-to-back with sync)")
    print(f"{'case':<44} {'design':<13} {'host fwd':>8} {'host f+b':>8} {'marginal':>8} {'gpu fwd':>8} {'gpu f+b':>8}"
          f" {'wall f+b':>8}")
    for r in rows:
        for name in ("custom_op", "cpp_autograd"):
            d = r[name]
            print(f"{r['case']:<44} {name:<13} {d['host_fwd_us']:>8.1f} {d['host_fwd_bwd_us']:>8.1f} "
                  f"{d['host_fwd_bwd_marginal_us']:>8.1f} "
                  f"{d['gpu_fwd_us']:>8.1f} {d['gpu_fwd_bwd_us']:>8.1f} {d['wall_fwd_bwd_us']:>8.1f}")
        print(f"{'':<44} x*2 host fwd+bwd {r['aten_mul_host_fwd_bwd_us']}; marginal {r['yardsticks']}")
        print(f"{'':<44} pieces: {r['breakdown']}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", type=Path, default=None,
                        help="JSON file (default benchmarks/results/adaln_host_{cpu,gpu}.json)")
    parser.add_argument("--calls", type=int, default=None, help="calls per timed loop (default 2000 CPU, 200 GPU)")
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    gpu = args.device == "cuda"
    calls = args.calls or (200 if gpu else 2000)
    if gpu:
        backend = ops.ensure_extension()
        if not backend.startswith("cuda:"):
            sys.exit(f"the fused kernels are not active ({backend}); build the extension first (adaptiveload build-ext)")
        rows = gpu_rows(calls, args.repeats, GPU_SHAPES)
        print_gpu(rows)
        meta = run_meta("adaln_host", argv) | {"description": __doc__.strip().splitlines()[0], "backend": backend}
    else:
        rows = cpu_rows(calls, args.repeats)
        print_cpu(rows)
        meta = {"description": __doc__.strip().splitlines()[0], **run_meta("adaln_host", argv), "backend": ops.backend(),
                "note": "CPU, 1 thread; the op layer measured with tiny tensors (and no-op kernels where named)"}
    out = args.out or RESULTS / f"adaln_host_{'gpu' if gpu else 'cpu'}.json"
    meta["timing"] = (f"host: best of {args.repeats} averages over {min(calls, GPU_QUEUED_CALLS)} calls (marginal: "
                      f"over chains of {CHAIN} and {2 * CHAIN} ops), time.perf_counter; wall: {calls} calls"
                      if gpu else f"best of {args.repeats} averages over {calls} calls, time.perf_counter")
    meta["definitions"] = __doc__
    write_result(out, meta | {"rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())

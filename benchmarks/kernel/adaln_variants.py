"""Fused AdaLN kernel designs side by side on one GPU, to choose between them in one session.

Each variant is a csrc/ tree (LABEL=DIR), JIT-built under its own name (all builds in parallel),
then, one variant at a time in its own process (a crashing variant cannot take the others down):
checked against the fp32 reference (relative error of y, dx, dshift, dscale; bf16 bound 1e-2) and
timed on benchmarks/kernel/adaln.py's shapes, forward and backward kernels called directly (no autograd),
as CUDA-graph GPU time in ms, beside the copy floor. benchmarks/kernel/adaln.py then measures the
adopted kernel against PyTorch.

    python benchmarks/kernel/adaln_variants.py --variant main=csrc --variant staged=/tmp/staged/csrc \\
        --out benchmarks/results/kernel_variants/sweep_h200.json
"""
from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root (see benchmarks/_meta.py)
from benchmarks._meta import run_meta, write_result  # noqa: E402
from benchmarks.kernel.adaln import EPS, SHAPES, time_graph_ms, time_ms  # noqa: E402

from lightning_adaptiveload.ops.extension import jit_build  # noqa: E402
from lightning_adaptiveload.ops.reference import adaln_bwd_reference, adaln_fwd_reference  # noqa: E402

REL_ERR_MAX = 1e-2  # bf16 bound of issue 4's GPU tests


def module_name(label: str) -> str:
    return "adaptiveload_variant_" + "".join(c if c.isalnum() else "_" for c in label)


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    return ((got.double() - ref.double()).norm() / ref.double().norm()).item()


def measure_variant(label: str, csrc: Path) -> list[dict]:
    """Errors and graph times (ms) of one variant on every shape; runs in a worker process."""
    ext = jit_build(csrc, module_name(label))
    rows = []
    for batch, seq, dim in SHAPES:
        gen = torch.Generator(device="cuda").manual_seed(batch * seq + dim)
        x = torch.randn(batch, seq, dim, generator=gen, device="cuda").bfloat16()
        shift = (0.5 * torch.randn(batch, 1, dim, generator=gen, device="cuda")).bfloat16()
        scale = (0.5 * torch.randn(batch, 1, dim, generator=gen, device="cuda")).bfloat16()
        dy = torch.randn(batch, seq, dim, generator=gen, device="cuda").bfloat16()
        y, mean, rstd = ext.adaln_fwd(x, shift, scale, None, None, EPS)
        grads = ext.adaln_bwd(dy, x, scale, None, None, mean, rstd)
        y_ref, mean_ref, rstd_ref = adaln_fwd_reference(x, shift, scale, None, None, EPS)
        grads_ref = adaln_bwd_reference(dy, x, scale, None, None, mean_ref, rstd_ref)
        errors = {"y": rel_err(y, y_ref)}
        errors.update({name: rel_err(g, r) for name, g, r in zip(("dx", "dshift", "dscale"), grads, grads_ref)})
        dst = torch.empty_like(x)
        copy_ms = time_ms(lambda: dst.copy_(x))
        rows.append({
            "B": batch, "N": seq, "D": dim,
            "fwd_floor_ms": round(copy_ms, 4), "bwd_floor_ms": round(1.5 * copy_ms, 4),
            "fwd_ms": time_graph_ms(lambda: ext.adaln_fwd(x, shift, scale, None, None, EPS)),
            "bwd_ms": time_graph_ms(lambda: ext.adaln_bwd(dy, x, scale, None, None, mean, rstd)),
            "rel_err": {k: float(f"{v:.3g}") for k, v in errors.items()},
            "correct": all(v <= REL_ERR_MAX for v in errors.values()),
        })
        print(f"  {label} {(batch, seq, dim)}: fwd {rows[-1]['fwd_ms']} ms bwd {rows[-1]['bwd_ms']} ms "
              f"errors {rows[-1]['rel_err']}", flush=True)
    return rows


def build(label: str, csrc: Path) -> str:
    """Compile one variant in a child process (torch's build cache is keyed by name and sources)."""
    code = ("import sys; from pathlib import Path; from lightning_adaptiveload.ops.extension import jit_build; "
            "jit_build(Path(sys.argv[1]), sys.argv[2])")
    done = subprocess.run([sys.executable, "-c", code, str(csrc), module_name(label)], capture_output=True, text=True)
    return "ok" if done.returncode == 0 else "build failed: " + (done.stderr.strip().splitlines() or ["?"])[-1][:300]


def print_table(results: dict) -> None:
    labels = [lbl for lbl, r in results.items() if r.get("rows")]
    if not labels:
        return
    print("\nGPU time per call (ms, CUDA graph) and / copy floor; * = wrong result")
    print(f"{'(B, N, D)':20s} {'pass':4s} {'floor':>7s} " + " ".join(f"{lbl:>16s}" for lbl in labels))
    for i, (batch, seq, dim) in enumerate(SHAPES):
        for kind in ("fwd", "bwd"):
            floor = results[labels[0]]["rows"][i][f"{kind}_floor_ms"]
            cells = []
            for lbl in labels:
                r = results[lbl]["rows"][i]
                t = r[f"{kind}_ms"]
                cells.append(f"{'-' if t is None else f'{t:.4f} {t / floor:.2f}x'}{'' if r['correct'] else '*'}")
            print(f"{str((batch, seq, dim)):20s} {kind:4s} {floor:7.4f} " + " ".join(f"{c:>16s}" for c in cells))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variant", action="append", required=True, metavar="LABEL=DIR", help="a csrc/ tree")
    parser.add_argument("--out", type=Path, required=True, help="JSON results")
    parser.add_argument("--worker", help=argparse.SUPPRESS)  # LABEL=DIR measured in this process
    args = parser.parse_args(argv)
    variants = {}
    for spec in args.variant:
        label, _, path = spec.partition("=")
        if not label or not (Path(path) / "build_flags.json").is_file():
            parser.error(f"--variant {spec!r}: expected LABEL=DIR with DIR/build_flags.json")
        variants[label] = Path(path).resolve()
    if args.worker:
        label, _, path = args.worker.partition("=")
        args.out.write_text(json.dumps(measure_variant(label, Path(path))))
        return 0
    if not torch.cuda.is_available():
        print("adaln_variants: needs a CUDA GPU", file=sys.stderr)
        return 1

    print(f"building {len(variants)} variants in parallel ...", flush=True)
    with concurrent.futures.ThreadPoolExecutor(len(variants)) as pool:
        builds = dict(zip(variants, pool.map(lambda kv: build(*kv), variants.items())))
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for label, csrc in variants.items():
            results[label] = {"csrc": str(csrc), "build": builds[label]}
            print(f"{label}: {builds[label]}", flush=True)
            if builds[label] != "ok":
                continue
            out = Path(tmp) / f"{module_name(label)}.json"
            cmd = [sys.executable, __file__, "--variant", f"{label}={csrc}", "--out", str(out), "--worker", f"{label}={csrc}"]
            done = subprocess.run(cmd, env=os.environ)
            results[label]["rows"] = json.loads(out.read_text()) if done.returncode == 0 and out.is_file() else None
            if results[label]["rows"] is None:
                results[label]["error"] = f"worker exited {done.returncode}"
    print_table(results)
    meta = {
        **run_meta("adaln_variants", argv),
        "description": __doc__.strip().splitlines()[0],
        "archs": os.environ.get("ADAPTIVELOAD_CUDA_ARCHS", "build_flags.json"),
        "timing": "CUDA graph of 10 calls, median of 15 replays; floor: do_bench median of a copy of x",
    }
    write_result(args.out, {**meta, "shapes": SHAPES, "variants": results})
    ok = all(r.get("rows") and all(row["correct"] for row in r["rows"]) for r in results.values())
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())

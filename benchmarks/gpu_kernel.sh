#!/usr/bin/env bash
# Fused AdaLN kernels on one GPU, in one command (~6-8 min on an H200), from the repository root:
#   1. build lightning_adaptiveload._C in place (setup.py build_ext; sm_90 only unless
#      ADAPTIVELOAD_CUDA_ARCHS says otherwise),
#   2. tests/ops/test_adaln_cuda.py (fused vs fp64, determinism, torch.compile, FSDP) and, at the same
#      time, compute-sanitizer memcheck + racecheck on small shapes of every kernel,
#   3. benchmarks/kernel/adaln_host.py --device cuda (host cost per call of the op layer, by design),
#   4. benchmarks/kernel/adaln.py (alone on the GPU, for clean timings).
# Logs and JSON go to $OUT (default benchmarks/results/gpu_kernel); copy kernel_gpu_tests.log,
# adaln_host_gpu.json and adaln_h200.json into benchmarks/results/ and commit them. Exit status: 0
# only if every stage passed.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-benchmarks/results/gpu_kernel}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export ADAPTIVELOAD_CUDA_ARCHS="${ADAPTIVELOAD_CUDA_ARCHS:-90}" ADAPTIVELOAD_NO_JIT=1 MAX_JOBS="${MAX_JOBS:-8}"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export CUDA_HOME="${CUDA_HOME:-/usr/local/cuda}"
DEADLINE=$((SECONDS + ${GPU_KERNEL_BUDGET_S:-570}))  # finish inside the device tool's 600 s
summary="$OUT/summary.txt"
: >"$summary"
status=0
stage() { echo "[$(date -u +%H:%M:%S) +${SECONDS}s] $*" | tee -a "$summary"; }

stage "machine: $(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | head -1); $("$CUDA_HOME/bin/nvcc" --version | tail -1)"
stage "python $(python3 -c 'import sys, torch; print(sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda)')"

stage "1/4 build (archs $ADAPTIVELOAD_CUDA_ARCHS)"
if ! timeout 300 python3 setup.py build_ext --inplace >"$OUT/build.log" 2>&1; then
  grep -E "error" "$OUT/build.log" | head -30 | tee -a "$summary"
  stage "build FAILED (see build.log); nothing else can run"
  exit 1
fi
stage "build ok; compiler warnings in csrc: $(grep -cE "csrc/adaln[a-z_]*\.(cu|cuh|cpp|h)[:(].*warning" "$OUT/build.log")"
python3 -c "import lightning_adaptiveload.ops as o; print('backend:', o.backend())" 2>&1 | tee -a "$summary"

stage "2/4 GPU tests + compute-sanitizer (in parallel)"
timeout 300 python3 -m pytest -v -p no:cacheprovider -m cuda tests/ops/test_adaln_cuda.py >"$OUT/kernel_gpu_tests.log" 2>&1 &
tests_pid=$!

cat >/tmp/adaln_sanitize.py <<'PY'
"""Every AdaLN kernel once on small shapes (fast and generic paths, per-sample/per-token,
affine or not, fp32/bf16), checked against the CPU reference so the run also proves results."""
import torch
from lightning_adaptiveload.ops import adaln_modulate, backend

assert backend().startswith("cuda:"), backend()
cases = [  # (B, N, D, x dtype, per_token, affine, mod fp32)
    (2, 5, 64, torch.bfloat16, False, False, False),  # warp forward, lean block backward
    (2, 5, 64, torch.bfloat16, True, True, True),  # warp forward, general block backward
    (2, 67, 1536, torch.bfloat16, False, True, True),  # warp, 6 vectors/lane; backward 96 threads x 2
    (3, 7, 96, torch.float32, True, True, True),  # fp32 warp, per token + affine partials
    (2, 9, 3072, torch.bfloat16, False, False, False),  # block forward 96 threads x 4, lean backward
    (1, 3, 2048 * 8, torch.bfloat16, False, True, False),  # block, 512 threads x 4, general
    (1, 5, 8192, torch.bfloat16, False, False, True),  # block forward 512 threads x 2
    # Warp forward at 20 vectors per lane; backward 320 x 2 with rows in pairs and, on an H200,
    # tiles of 2 rows and a last one of 1 (a pair step and a lone-row step).
    (1, 401, 5120, torch.bfloat16, False, False, False),  # lean backward
    (1, 401, 5120, torch.bfloat16, True, True, True),  # general backward
    (2, 4, 33, torch.float32, False, True, True),  # generic forward/dx/partial kernels
    (2, 4, 33, torch.float16, True, False, True),  # generic, per token, no partials
]
for b, n, d, dt, per_token, affine, mod_fp32 in cases:
    g = torch.Generator().manual_seed(b * n + d)
    m = n if per_token else 1
    mdt = torch.float32 if mod_fp32 else dt
    x = torch.randn(b, n, d, generator=g).to(dt)
    shift, scale = (0.5 * torch.randn(b, m, d, generator=g)).to(mdt), (0.5 * torch.randn(b, m, d, generator=g)).to(mdt)
    w, bias = (torch.randn(d, generator=g), torch.randn(d, generator=g)) if affine else (None, None)
    dy = torch.randn(b, n, d, generator=g).to(dt)
    results = []
    for device in ("cuda", "cpu"):
        leaves = [t.to(device).requires_grad_() for t in (x, shift, scale) + ((w, bias) if affine else ())]
        y = adaln_modulate(*leaves[:3], *(leaves[3:] if affine else (None, None)))
        results.append([y] + list(torch.autograd.grad(y, leaves, dy.to(device))))
    for got, ref in zip(*results):
        err = ((got.cpu().double() - ref.double()).norm() / ref.double().norm()).item()
        assert err <= (1e-5 if dt == torch.float32 else 1e-2), (b, n, d, dt, err)
    print("ok", (b, n, d, str(dt), per_token, affine, mod_fp32), flush=True)
torch.cuda.synchronize()
print("sanitize script: all cases ok")
PY
(
  san_status=0
  for tool in memcheck racecheck; do
    echo "=== compute-sanitizer --tool $tool"
    timeout 240 compute-sanitizer --tool "$tool" --error-exitcode 3 --print-limit 20 python3 /tmp/adaln_sanitize.py || san_status=1
  done
  exit $san_status
) >"$OUT/sanitizer.log" 2>&1 &
san_pid=$!

if wait $tests_pid; then stage "tests passed: $(tail -1 "$OUT/kernel_gpu_tests.log")"; else
  status=1
  stage "tests FAILED: $(tail -1 "$OUT/kernel_gpu_tests.log")"
  grep -E "^(FAILED|ERROR)" "$OUT/kernel_gpu_tests.log" | head -20 | tee -a "$summary"
fi
if wait $san_pid; then stage "compute-sanitizer memcheck + racecheck clean"; else
  status=1
  stage "compute-sanitizer FAILED or found errors"
  grep -E "ERROR SUMMARY|Error|error|Traceback" "$OUT/sanitizer.log" | head -20 | tee -a "$summary"
fi
grep -E "ERROR SUMMARY|RACECHECK SUMMARY" "$OUT/sanitizer.log" | tee -a "$summary"

stage "3/4 host cost benchmark"
if ! timeout 120 python3 benchmarks/kernel/adaln_host.py --device cuda --out "$OUT/adaln_host_gpu.json" 2>&1 | tee "$OUT/host_benchmark.log"; then
  status=1
  stage "host cost benchmark FAILED or timed out"
fi

left=$((DEADLINE - SECONDS))
stage "4/4 benchmark (${left}s left)"
if ! timeout "$left" python3 benchmarks/kernel/adaln.py --out "$OUT/adaln_h200.json" 2>&1 | tee "$OUT/benchmark.log"; then
  status=1
  stage "benchmark FAILED or timed out"
fi
stage "done, status $status"
exit $status

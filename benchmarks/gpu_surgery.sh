#!/usr/bin/env bash
# Fused-AdaLN surgery on GPUs, in one command (~6 min on 2x H200), from the repository root:
#   1. the CUDA op's backend, 2. GPU comparisons (tests/surgery/test_gpu.py: Wan 2.1/2.2 and
#   SD3.5 blocks by pattern and by idiom, bf16 vs fp64; tests/surgery/test_compile.py: fused example
#   and Wan blocks under inductor, fullgraph), 3. a 2-GPU FSDP Lightning run with the
#   FusedAdaLNSurgery callback (tests/surgery/test_fsdp.py), 4. benchmarks/kernel/surgery.py.
# Logs and JSON go to $OUT (default benchmarks/results/gpu_surgery); commit them from there.
# Needs 2 GPUs for step 3 (skipped with a note otherwise). Python packages missing on the machine
# (diffusers, importlib_metadata, zipp, ...) are installed from ./.whl when that folder exists.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-benchmarks/results/gpu_surgery}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
if [ -d .whl ] && ! python3 -c "import diffusers" 2>/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl &&
    export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi
status=0
python3 -c "import torch, lightning_adaptiveload.ops as o; print(torch.cuda.get_device_name(0), torch.__version__); print(o.backend())" \
  2>&1 | tee "$OUT/backend.log" || status=1
python3 -m pytest -v -rA -p no:cacheprovider -m cuda tests/surgery/test_gpu.py tests/surgery/test_compile.py 2>&1 \
  | tee "$OUT/pytest_gpu.log" || status=1
if [ "$(python3 -c 'import torch; print(torch.cuda.device_count())')" -ge 2 ]; then
  torchrun --standalone --nproc_per_node 2 tests/surgery/test_fsdp.py --out "$OUT" 2>&1 | tee "$OUT/fsdp.log" || status=1
else
  echo "fewer than 2 GPUs: FSDP run skipped" | tee "$OUT/fsdp.log"
fi
python3 benchmarks/kernel/surgery.py --out "$OUT/surgery_h200.json" 2>&1 | tee "$OUT/benchmark.log" || status=1
exit $status

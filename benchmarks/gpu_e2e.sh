#!/usr/bin/env bash
# End-to-end FSDP benchmark (AdaptiveLoad vs token-equal bucketing), one command from the
# repository root on the device machine (about 7-8 min on 2x H200 with the defaults):
#   bash benchmarks/gpu_e2e.sh            # carry .whl (webdataset, braceexpand) when missing there
# Builds lightning_adaptiveload._C in place, runs benchmarks/e2e/e2e.py for token_equal,
# dual_constraint (recorded without training when its plan equals token_equal's), balanced and
# balanced_fused on the same synthetic shards, then the report. To $OUT (default
# benchmarks/results/e2e): setup.log, runs.log, report.log, e2e_<N>xh200.json/.png and
# e2e_work.tar.gz (every run's JSON, monitor CSVs and calibration files; refreshed after each run,
# so a run cut short still leaves the finished ones). Env: E2E_DEVICES (2), E2E_LAYERS (8),
# E2E_SAMPLES (200 per device), E2E_BUDGET_S (560: runs that cannot finish by then are skipped).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-benchmarks/results/e2e}
WORK=${E2E_WORK:-/tmp/e2e}
DEVICES=${E2E_DEVICES:-2}
SAMPLES=${E2E_SAMPLES:-$((200 * DEVICES))}
DEADLINE=$((SECONDS + ${E2E_BUDGET_S:-560}))
REPORT_S=40  # kept back for the report
mkdir -p "$OUT" "$WORK"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
if [ -d .whl ] && ! python3 -c "import webdataset" 2>/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl &&
    export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi
# Build the extension once, before the runs (otherwise the fused run JIT-builds it on each rank).
ADAPTIVELOAD_CUDA_ARCHS=90 timeout 300 python3 setup.py -q build_ext --inplace > "$OUT/setup.log" 2>&1 || {
  echo "extension build failed, see setup.log"; exit 1; }
{ nvidia-smi --query-gpu=index,name,driver_version --format=csv,noheader
  python3 -c "import lightning_adaptiveload.ops as o; print(o.backend())"; } 2>&1 | tee -a "$OUT/setup.log"
status=0
for config in token_equal dual_constraint balanced balanced_fused; do
  left=$((DEADLINE - SECONDS - REPORT_S))
  if [ "$left" -lt 60 ]; then
    echo "$config skipped: ${left}s left of E2E_BUDGET_S" | tee -a "$OUT/runs.log"; status=1; continue
  fi
  timeout "$left" python3 benchmarks/e2e/e2e.py run --config "$config" --workdir "$WORK" --devices "$DEVICES" \
    --layers "${E2E_LAYERS:-8}" --samples "$SAMPLES" > "$WORK.log" 2>&1 || {
    echo "$config failed (exit $?), see runs.log"; status=1
    pkill -f "benchmarks/e2e/e2e.py run" && sleep 5; }  # ranks the launcher started may outlive a timeout
  { echo "===== $config (+${SECONDS}s)"; cat "$WORK.log"; } >> "$OUT/runs.log"
  tail -n 1 "$WORK.log"
  tar -czf "$OUT/e2e_work.tar.gz" -C "$WORK" --exclude=./shards --exclude='./index.jsonl*' . 2>/dev/null
done
python3 benchmarks/e2e/e2e.py report --workdir "$WORK" --out "$OUT/e2e_${DEVICES}xh200.json" 2>&1 | tee "$OUT/report.log" ||
  status=1
exit $status

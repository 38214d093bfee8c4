#!/usr/bin/env bash
# End-to-end FSDP benchmark on 2 GPUs (issue: AdaptiveLoad vs token-equal bucketing), one command
# from the repository root on the device machine (about 8 min on 2x H200 with the defaults):
#   bash benchmarks/gpu_e2e.sh            # carry .whl (webdataset, braceexpand) when missing there
# Runs benchmarks/e2e.py for token_equal, dual_constraint, balanced and balanced_fused on the same
# synthetic shards, then the report. JSON, PNG and logs go to $OUT (default
# benchmarks/results/e2e); commit them from there. Env: E2E_LAYERS (8), E2E_SAMPLES (480).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-benchmarks/results/e2e}
WORK=${E2E_WORK:-/tmp/e2e}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if [ -d .whl ] && ! python3 -c "import webdataset" 2>/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl &&
    export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi
# Build the extension once, before the runs (otherwise the fused run JIT-builds it on each rank).
# (The device tool brings back at most 8 files: keep to setup.log, runs.log, report.log, JSON, PNG.)
ADAPTIVELOAD_CUDA_ARCHS=90 python3 setup.py -q build_ext --inplace > "$OUT/setup.log" 2>&1 || {
  echo "extension build failed, see setup.log"; exit 1; }
python3 -c "import lightning_adaptiveload.ops as o; print(o.backend())" 2>&1 | tee -a "$OUT/setup.log"
status=0
for config in token_equal dual_constraint balanced balanced_fused; do
  timeout 240 python3 benchmarks/e2e.py run --config "$config" --workdir "$WORK" \
    --layers "${E2E_LAYERS:-8}" --samples "${E2E_SAMPLES:-480}" > "$WORK.log" 2>&1 || {
    echo "$config failed (exit $?), see runs.log"; status=1; }
  { echo "===== $config"; cat "$WORK.log"; } >> "$OUT/runs.log"
  tail -n 1 "$WORK.log"
done
python3 benchmarks/e2e.py report --workdir "$WORK" --out "$OUT/e2e_2xh200.json" 2>&1 | tee "$OUT/report.log" || status=1
exit $status

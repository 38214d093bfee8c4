#!/usr/bin/env bash
# One call on the GPU machine, from the repository root: the stages named on the command line, in
# order, each with its own time limit, inside an overall budget (GPU_BUDGET_S, default 560 s).
#   bash benchmarks/gpu_session.sh setup tests host compile        # e.g. carry .whl
# Stages:
#   setup    wheels from .whl (webdataset, jsonargparse, diffusers, ... missing on the image: `pip download` them
#            for cp312 with their dependencies, minus numpy, packaging, typing_extensions, filelock and fsspec,
#            and with huggingface_hub < 2, which the image's transformers requires), the
#            CUDA extension built in place (sm_90) unless a carried build loads, the op's backend
#   tests    every test marked `cuda` (pytest -m cuda), log kept
#   host     benchmarks/kernel/adaln_host.py: host cost of the fused op per call
#   compile  benchmarks/e2e/compile.py: eager vs regional compile strategies, +- surgery
#   warmup   benchmarks/e2e/warmup.py: cold shapes with and without the shape warm-up
#   memory   benchmarks/scheduling/memory_plan.py: per-bucket activation checkpointing
#   attention benchmarks/kernel/attention.py: each SDPA backend at the shipped shapes, the 75,600-token step under each (~3 min)
#   shipped  benchmarks/e2e/shipped_config.py: the shipped config and its baseline as a user runs them
#            (SHIPPED_RUNS, default baseline,compiled; SHIPPED_SAMPLES, default 100); each run's log,
#            calibration.json and per-rank CSV kept; calibration caches and compile cache folders kept in
#            .shipped_cache/, returned as $OUT/shipped/cache (put it back as .shipped_cache and carry it to the
#            next call: a run stopped by its limit goes on from its cached points and graphs)
#   encode   benchmarks/data/encode.py: the Wan 2.1 VAE and UMT5-XXL per clip (carry .whl-av: PyAV)
#   crash    benchmarks/e2e/compile_crash.py: compile dynamic at 75,600 tokens, variant by variant (CRASH_ARGS)
#   graphs   benchmarks/e2e/compile_graphs.py: the graphs a mixed-shape run compiles, Wan-1.3B-shaped blocks,
#            with AOTAutograd's tracing (attention's kernel choice included) but no code generation
#            (GRAPHS_ARGS, e.g. "--backend inductor" for the compile times too)
#   wan      benchmarks/e2e/wan_runs.py: one of the Wan 2.1 1.3B runs (WAN_RUN=a|b|c; WAN_ARGS), its files in
#            $OUT/wan/<run>/; calibration caches in .wan_cache/ (put $OUT/wan/cache back there for a second call)
# Everything each stage writes lands in $OUT/<stage>/ and is packed into $OUT/results.tar.gz
# (the device tool returns at most 8 files); $OUT/summary.txt has one line per stage.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu_out}
mkdir -p "$OUT"
DEADLINE=$((SECONDS + ${GPU_BUDGET_S:-560}))
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export CUDA_HOME="${CUDA_HOME:-/usr/local/cuda}" ADAPTIVELOAD_CUDA_ARCHS="${ADAPTIVELOAD_CUDA_ARCHS:-90}"
export MAX_JOBS="${MAX_JOBS:-16}" ADAPTIVELOAD_NO_JIT=1
summary="$OUT/summary.txt"
status=0
note() { echo "[$(date -u +%H:%M:%S) +${SECONDS}s] $*" | tee -a "$summary"; }
left() { echo $((DEADLINE - SECONDS)); }

# run STAGE LIMIT_S COMMAND...: the command with the smaller of LIMIT_S and the time left, its
# output in $OUT/STAGE/log.txt; a stage that fails or times out marks the call failed.
run() {
  local stage=$1 limit=$2; shift 2
  local budget; budget=$(left)
  [ "$budget" -lt "$limit" ] && limit=$budget
  if [ "$limit" -lt 20 ]; then note "$stage SKIPPED (${budget}s left)"; status=1; return; fi
  mkdir -p "$OUT/$stage"
  note "$stage start (limit ${limit}s)"
  timeout --kill-after=10 "$limit" "$@" > "$OUT/$stage/log.txt" 2>&1
  local rc=$?
  note "$stage exit $rc: $(tail -n 1 "$OUT/$stage/log.txt" | cut -c1-200)"
  [ "$rc" -ne 0 ] && status=1
}

# Packages the image lacks, from the carried wheels (kept across calls on a warm machine).
if [ -d .whl ] && [ ! -d /tmp/site/webdataset ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
fi
[ -d /tmp/site ] && export PYTHONPATH="$PYTHONPATH:/tmp/site"

for stage in "$@"; do
  case $stage in
    setup)
      note "machine: $(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | head -1); $(python3 -c 'import torch; print("torch", torch.__version__, "cudnn", torch.backends.cudnn.version())')"
      if ! python3 -c "import torch, lightning_adaptiveload._C" 2>/dev/null; then  # _C links against torch
        run build 300 python3 setup.py build_ext --inplace
        # the build, for a later call to carry (a fresh machine would spend the build again)
        mkdir -p "$OUT/build" && for so in lightning_adaptiveload/_C*.so; do strip -g -o "$OUT/build/$(basename "$so")" "$so"; done
      fi
      run backend 120 python3 -c "import lightning_adaptiveload.ops as o; print(o.backend())"
      # a carried wheel that shadows one of the image's (huggingface_hub 2.x under its transformers) breaks
      # `import lightning` in every later stage: fail here, in seconds
      run imports 60 python3 -c "import lightning, jsonargparse, webdataset, diffusers; print('imports ok')" ;;
    tests)  # TESTS_PATHS (default tests/); TESTS_ARGS: e.g. --ignore=tests/ops when the kernels' tests already ran
      run tests "${TESTS_LIMIT_S:-240}" python3 -m pytest -q -rs -p no:cacheprovider -m cuda ${TESTS_PATHS:-tests/} ${TESTS_ARGS:-} ;;
    host)
      run host 90 python3 benchmarks/kernel/adaln_host.py --out "$OUT/host/adaln_host_h200.json" ;;
    compile)
      run compile "${COMPILE_LIMIT_S:-330}" python3 benchmarks/e2e/compile.py --out "$OUT/compile/compile_h200.json" ${COMPILE_ARGS:-} ;;
    warmup)
      run warmup 270 python3 benchmarks/e2e/warmup.py --out "$OUT/warmup/warmup_h200.json" --workdir /tmp/warmup_bench \
        ${WARMUP_ARGS:-} ;;
    memory)
      run memory 290 python3 benchmarks/scheduling/memory_plan.py --out "$OUT/memory/memory_plan_h200.json" ${MEMORY_ARGS:-} ;;
    attention)
      run attention 240 python3 benchmarks/kernel/attention.py --out "$OUT/attention/attention_h200.json" ${ATTENTION_ARGS:-} ;;
    shipped)
      run shipped "${SHIPPED_LIMIT_S:-560}" python3 benchmarks/e2e/shipped_config.py --runs "${SHIPPED_RUNS:-baseline,compiled}" \
        --samples "${SHIPPED_SAMPLES:-100}" --workdir /tmp/shipped --cache-dir .shipped_cache \
        --out "$OUT/shipped/shipped_config.json" ${SHIPPED_ARGS:-}
      for dir in /tmp/shipped/*/; do
        name=$(basename "$dir"); [ "$name" = shards ] && continue
        mkdir -p "$OUT/shipped/$name"
        cp "$dir"fit.log "$dir"config.yaml "$OUT/shipped/$name/" 2>/dev/null
        cp "$dir"logs/version_0/{calibration.json,balance_per_rank.csv,metrics.csv} "$OUT/shipped/$name/" 2>/dev/null
      done
      cp -r .shipped_cache "$OUT/shipped/cache" 2>/dev/null ;;
    encode)
      [ -d .whl-av ] && [ ! -d /tmp/site/av ] && python3 -m pip install -q --no-index --no-deps --no-compile \
        --no-cache-dir --target /tmp/site .whl-av/*.whl
      run encode 300 python3 benchmarks/data/encode.py --out "$OUT/encode/encode_h200.json" ${ENCODE_ARGS:-} ;;
    crash)
      run crash "${CRASH_LIMIT_S:-540}" python3 benchmarks/e2e/compile_crash.py --out "$OUT/crash/compile_crash_h200.json" \
        --budget-s $(( ${CRASH_LIMIT_S:-540} - 40 )) ${CRASH_ARGS:-} ;;
    graphs)
      run graphs "${GRAPHS_LIMIT_S:-150}" python3 benchmarks/e2e/compile_graphs.py --device cuda --backend aot_eager \
        --dim 1536 --heads 12 --ffn 8960 --text-dim 4096 --out "$OUT/graphs/compile_graphs_h200.json" ${GRAPHS_ARGS:-} ;;
    wan)  # the fit stops itself 40 s before the stage's limit, so its calibration cache is kept
      case ${WAN_RUN:-} in a|b|c) ;; *) note "wan: set WAN_RUN to a, b or c"; status=1; continue ;; esac
      wan_limit=$(left); [ "$wan_limit" -gt 540 ] && wan_limit=540
      run wan 540 python3 benchmarks/e2e/wan_runs.py --run "$WAN_RUN" --workdir /tmp/wan --cache-dir .wan_cache \
        --run-timeout-s $((wan_limit - 40)) ${WAN_ARGS:-}
      mkdir -p "$OUT/wan/$WAN_RUN"
      cp /tmp/wan/wan_"$WAN_RUN".json /tmp/wan/"$WAN_RUN"/fit.log /tmp/wan/"$WAN_RUN"/config.yaml "$OUT/wan/$WAN_RUN/" 2>/dev/null
      cp /tmp/wan/"$WAN_RUN"/logs/version_0/{calibration.json,metrics.csv,balance_per_rank.csv,fused_adaln_surgery.json} \
        "$OUT/wan/$WAN_RUN/" 2>/dev/null
      cp -r .wan_cache "$OUT/wan/cache" 2>/dev/null ;;
    *) note "unknown stage $stage"; status=1 ;;
  esac
done
note "done, status $status"
# the build returns apart (it may be over 16 MiB); compile caches stay on the machine (100+ MiB: over what
# returns, and over what a call can carry)
tar -czf /tmp/results.tar.gz --exclude=./build --exclude="*compile_cache" -C "$OUT" . 2>/dev/null
find "$OUT" -mindepth 1 -maxdepth 1 ! -name summary.txt ! -name build -exec rm -rf {} +
mv /tmp/results.tar.gz "$OUT/results.tar.gz"
exit $status

#!/usr/bin/env bash
# Proves csrc/ compiles and links against a CUDA build of torch, on a machine without a GPU.
# Builds lightning_adaptiveload._C into a temp dir (never the source tree), then imports it.
# Usage: bash tools/check_cuda_build.sh   (CI; ~2-4 min on 2 cores, sm_90 only by default, +1.5 min for a venv)
# Env: CUDA_TORCH (the CUDA torch a venv gets when the installed one is a CPU build; default 2.14.1),
#      ADAPTIVELOAD_CUDA_ARCHS (default "90"; the shipped setup.py builds "80;90"), KEEP_BUILD=1.
set -euo pipefail
cd "$(dirname "$0")/.."
export CUDA_HOME="${CUDA_HOME:-/usr/local/cuda}"
export ADAPTIVELOAD_CUDA_ARCHS="${ADAPTIVELOAD_CUDA_ARCHS:-90}"
export MAX_JOBS="${MAX_JOBS:-2}"
unset ADAPTIVELOAD_NO_CUDA_BUILD
[[ -x "$CUDA_HOME/bin/nvcc" ]] || { echo "check_cuda_build: no nvcc at $CUDA_HOME/bin/nvcc" >&2; exit 1; }

work="$(mktemp -d)"
[[ -n "${KEEP_BUILD:-}" ]] || trap 'rm -rf "$work"' EXIT
# The compile needs a CUDA build of torch. A CPU build installed here (the test suite's) is left
# alone: the CUDA one goes into a throwaway venv (~1.5 min, 5.5 GB, from this machine's wheel cache).
PYTHON=python
if ! python -c "import sys, torch; sys.exit(0 if torch.version.cuda else 1)" 2>/dev/null; then
    echo "check_cuda_build: installed torch is not a CUDA build; installing torch==${CUDA_TORCH:-2.14.1} into $work/venv"
    python -m venv "$work/venv"
    "$work/venv/bin/python" -m pip install -qq "torch==${CUDA_TORCH:-2.14.1}" numpy setuptools
    PYTHON="$work/venv/bin/python"
fi
"$PYTHON" -c "import torch, sys; sys.exit(0 if torch.version.cuda else 'check_cuda_build: torch ' + torch.__version__ + ' is not a CUDA build')"
echo "check_cuda_build: nvcc $("$CUDA_HOME/bin/nvcc" --version | tail -1), archs $ADAPTIVELOAD_CUDA_ARCHS, build dir $work"
start=$SECONDS
if ! "$PYTHON" setup.py -q build_ext --build-lib "$work/lib" --build-temp "$work/tmp" >"$work/build.log" 2>&1; then
    grep -E "error|Error" "$work/build.log" | head -40 >&2 || true
    echo "check_cuda_build: FAILED to compile csrc/ (full log above: $work/build.log)" >&2
    KEEP_BUILD=1
    trap - EXIT
    exit 1
fi
# Our sources must compile warning-free (a narrowing warning once hid a mis-ordered argument).
if grep -E "csrc/adaln[a-z_]*\.(cu|cuh|cpp|h)[:(].*warning" "$work/build.log" >&2; then
    echo "check_cuda_build: FAILED, compiler warnings in csrc/ (above)" >&2
    exit 1
fi
so="$(find "$work/lib" -name '_C*.so' | head -1)"
[[ -n "$so" ]] || { echo "check_cuda_build: build finished but produced no _C*.so" >&2; exit 1; }
# Import the built module by path: proves every symbol resolves against this torch.
"$PYTHON" - "$so" <<'PY'
import importlib.util, sys
import torch  # loads libtorch/c10 first, as the package does
spec = importlib.util.spec_from_file_location("lightning_adaptiveload._C", sys.argv[1])
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
missing = [f for f in ("adaln_fwd", "adaln_bwd", "adaln_eager") if not hasattr(module, f)]
sys.exit(f"check_cuda_build: {sys.argv[1]} lacks {missing}" if missing else 0)
PY
echo "check_cuda_build: OK, $(basename "$so") ($(du -h "$so" | cut -f1)) built and imported in $((SECONDS - start)) s"

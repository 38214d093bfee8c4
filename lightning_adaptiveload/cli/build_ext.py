"""`adaptiveload build-ext`: build the fused AdaLN CUDA extension now, not inside a training run.

Without a prebuilt `lightning_adaptiveload._C` (e.g. after a plain `pip install .`, whose build
isolation hides torch from setup.py), the first CUDA call of the op would JIT-compile the
kernels: minutes on a fresh machine. This command does it ahead of time, on any machine with
nvcc and the training environment's CUDA torch (no GPU needed):

- by default into torch's extension cache ($TORCH_EXTENSIONS_DIR, default
  ~/.cache/torch_extensions), where training processes of this user find it;
- with --package, into the installed package as `lightning_adaptiveload._C` (used by every user
  of this environment; the package directory must be writable).

A prebuilt `_C` that imports is reported and left alone (--force builds anyway). Prints where
the extension is and what `ops.backend()` says. Exit status 0 when an extension is available
afterwards, 1 when none can be built here (a CPU torch, no nvcc, or a compile error; the
message says which): training then runs the reference PyTorch path (correct, slower).
ADAPTIVELOAD_CUDA_ARCHS ("90", "80;90") selects the GPU architectures to compile for.
"""
from __future__ import annotations

import argparse
import shutil
import sysconfig
import tempfile
import time


def register(subparsers) -> None:
    p = subparsers.add_parser("build-ext", help="build the fused AdaLN CUDA extension ahead of time",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--package", action="store_true",
                   help="build lightning_adaptiveload._C into the installed package instead of torch's cache")
    p.add_argument("--force", action="store_true", help="build even when a prebuilt _C imports")
    p.add_argument("--verbose", action="store_true", help="show the compiler commands")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from lightning_adaptiveload import ops
    from lightning_adaptiveload.ops import extension

    prebuilt, where = extension.prebuilt_extension()
    if prebuilt is not None and not args.force:
        print(f"build-ext: prebuilt extension present, nothing to build: {where}")
    else:
        if prebuilt is None:
            print(f"build-ext: no prebuilt lightning_adaptiveload._C ({where})")
        blocker = extension.jit_blocker()
        if blocker is not None:
            print(f"build-ext: cannot build the CUDA extension here: {blocker}. "
                  "Training will run the reference PyTorch AdaLN path (correct, slower, more memory).")
            return 1
        target = f"the installed package ({extension.PACKAGE_DIR})" if args.package else "torch's extension cache"
        print(f"build-ext: compiling csrc/ from {extension.CSRC_DIR} into {target} (minutes on a first build) ...",
              flush=True)
        start = time.perf_counter()
        try:
            where = build_into_package(args.verbose) if args.package else extension.jit_build(verbose=args.verbose).__file__
        except Exception as error:  # the compiler's message is in the error
            print(f"build-ext: build FAILED: {error}")
            return 1
        print(f"build-ext: built in {time.perf_counter() - start:.0f} s: {where}")
    print(f"build-ext: ops.backend() = {ops.backend()}")
    return 0


def build_into_package(verbose: bool) -> str:
    """Compile into a temp dir as module `_C`, then copy it into the package; returns its path."""
    from lightning_adaptiveload.ops import extension

    with tempfile.TemporaryDirectory(prefix="adaptiveload_build_") as tmp:
        module = extension.jit_build(name="_C", build_directory=tmp, verbose=verbose)
        target = extension.PACKAGE_DIR / ("_C" + sysconfig.get_config_var("EXT_SUFFIX"))
        shutil.copy2(module.__file__, target)
    return str(target)

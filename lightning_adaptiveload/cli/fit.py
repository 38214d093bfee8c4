"""`adaptiveload fit ARGS...`: Lightning's `LightningCLI` fit subcommand with ARGS passed through
unchanged (`--config demo.yaml`, `--trainer.max_steps 10`, `--print_config`, `--help`)."""
from __future__ import annotations

import argparse
import os
import sys


def register(subparsers) -> None:
    # No option prefix for this subparser: every argument, '--config' included, is handed on to
    # LightningCLI, which owns the option grammar (argparse.REMAINDER drops leading options).
    parser = subparsers.add_parser(
        "fit", prefix_chars="\x00", add_help=False,
        help="train with LightningCLI: adaptiveload fit --config examples/configs/demo.yaml",
        description="Runs `LightningCLI fit` with all remaining arguments; try `adaptiveload fit --help`.")
    parser.add_argument("cli_args", nargs="*")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    # Like `python -m`, resolve class paths such as examples.video_dit.module.VideoDiTModule
    # against the current directory.
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    from lightning.pytorch.cli import LightningCLI

    # LightningCLI warns when given `args` while sys.argv has arguments too; ours are in `args`.
    argv, sys.argv = sys.argv, sys.argv[:1]
    try:
        LightningCLI(
            subclass_mode_model=True,
            subclass_mode_data=True,
            args=["fit", *args.cli_args],
            parser_kwargs={"prog": "adaptiveload"},
            save_config_kwargs={"overwrite": True},
        )
    finally:
        sys.argv = argv
    return 0

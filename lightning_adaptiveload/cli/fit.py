"""`adaptiveload fit ARGS...`: Lightning's `LightningCLI` fit subcommand with ARGS passed through
unchanged (`--config demo.yaml`, `--trainer.max_steps 10`, `--print_config`, `--help`), in a process
prepared by `_environment.prepare_environment` (expandable CUDA allocator segments unless configured
otherwise)."""
from __future__ import annotations

import argparse
import os
import sys

from lightning_adaptiveload._environment import prepare_environment


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
    # before torch is imported; a multi-GPU strategy's other ranks inherit them
    prepare_environment()
    from lightning.pytorch.cli import LightningCLI

    cli_args = ["fit", *args.cli_args]
    # From the console, sys.argv[1:] is already `fit ...`: let LightningCLI read it, because
    # multi-GPU strategies start their other ranks by re-running sys.argv. Programmatic calls
    # (main([...]) with another sys.argv) pass the arguments explicitly.
    LightningCLI(
        subclass_mode_model=True,
        subclass_mode_data=True,
        args=None if sys.argv[1:] == cli_args else cli_args,
        parser_kwargs={"prog": "adaptiveload"},
        save_config_kwargs={"overwrite": True},
    )
    return 0

"""`adaptiveload fit ARGS...`: Lightning's `LightningCLI` fit subcommand with ARGS passed through
unchanged (`--config demo.yaml`, `--trainer.max_steps 10`, `--print_config`, `--help`), in a process
prepared by `_environment.prepare_environment` (expandable CUDA allocator segments unless configured
otherwise).

A run bounded by `max_steps` alone has `trainer.max_epochs == -1` (Lightning's "no epoch limit"),
and Lightning's RichProgressBar (the default bar when `rich` is installed) then titles the bar
`Epoch 0/-2` (max_epochs - 1; Lightning-AI/pytorch-lightning#21925). The CLI gives that bar the
title TQDMProgressBar shows there, `Epoch 0`; a bar with a finite max_epochs keeps `Epoch 0/N`.
"""
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


def cli_class():
    """LightningCLI with the epoch title of a step-bounded rich progress bar fixed (module
    docstring). Imports Lightning: call after prepare_environment."""
    from lightning.pytorch.callbacks import RichProgressBar
    from lightning.pytorch.cli import LightningCLI

    class StepBoundedRichProgressBar(RichProgressBar):
        """RichProgressBar whose train title leaves out the epoch total when there is none."""

        def _get_train_description(self, current_epoch: int) -> str:
            description = super()._get_train_description(current_epoch)
            if self.trainer.max_epochs is not None and self.trainer.max_epochs < 0:
                # the title is padded to the validation title's width: keep that width
                description = description.replace(f"/{self.trainer.max_epochs - 1}", "", 1).ljust(len(description))
            return description

    class AdaptiveLoadCLI(LightningCLI):
        def instantiate_trainer(self, **kwargs):
            trainer = super().instantiate_trainer(**kwargs)
            # Lightning's own class only, the default bar or one a config names: a subclass of a
            # user's has its own title. The subclass adds no state, so the bar's settings stay.
            if type(trainer.progress_bar_callback) is RichProgressBar:
                trainer.progress_bar_callback.__class__ = StepBoundedRichProgressBar
            return trainer

    return AdaptiveLoadCLI


def run(args: argparse.Namespace) -> int:
    # Like `python -m`, resolve class paths such as examples.video_dit.module.VideoDiTModule
    # against the current directory.
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    # before torch is imported; a multi-GPU strategy's other ranks inherit them
    prepare_environment()
    cli_args = ["fit", *args.cli_args]
    # From the console, sys.argv[1:] is already `fit ...`: let LightningCLI read it, because
    # multi-GPU strategies start their other ranks by re-running sys.argv. Programmatic calls
    # (main([...]) with another sys.argv) pass the arguments explicitly.
    cli_class()(
        subclass_mode_model=True,
        subclass_mode_data=True,
        args=None if sys.argv[1:] == cli_args else cli_args,
        parser_kwargs={"prog": "adaptiveload"},
        save_config_kwargs={"overwrite": True},
    )
    return 0

"""The `adaptiveload` command. Each subcommand lives in its own module of this package and
exposes `register(subparsers)`, which adds its parser and sets `func(args) -> int`. Every subcommand
runs with `_environment.quiet_console()`: our warnings without a source path, no library notices
a user cannot act on."""
from __future__ import annotations

import argparse
import importlib
import sys

from lightning_adaptiveload._environment import quiet_console

# Module names under lightning_adaptiveload.cli, in the order `--help` lists them.
COMMANDS = ('plan', 'simulate', 'report', 'encode', 'index', 'make_shards', 'fit', 'build_ext')


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="adaptiveload",
        description="Plan, simulate and train video DiTs with AdaptiveLoad bucketing.",
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in COMMANDS:
        importlib.import_module(f"{__name__}.{name}").register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    quiet_console()
    return int(args.func(args) or 0)

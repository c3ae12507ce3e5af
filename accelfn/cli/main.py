"""``accelfn`` entry point: an argparse parser with one subcommand per module.

Example:
    $ accelfn launch --nproc-per-node 2 --cpu train.py --epochs 1
    $ accelfn --version
    accelfn 0.1.0 (torch 2.13.0+cpu, Python 3.11.7)
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence

from . import config, dry_run, env, estimate_memory, launch, plan, plot, test

COMMANDS = (config, env, test, launch, dry_run, plan, estimate_memory, plot)


def version_line() -> str:
    """``accelfn X (torch Y, Python Z)``: what `accelfn --version` prints."""
    import platform

    import torch

    from .. import __version__

    return f"accelfn {__version__} (torch {torch.__version__}, Python {platform.python_version()})"


class _VersionAction(argparse.Action):
    """``--version``: print `version_line` and exit 0 (computed only when asked: it imports torch)."""

    def __init__(self, option_strings: Sequence[str], dest: str = argparse.SUPPRESS, **kw: object) -> None:
        super().__init__(
            option_strings,
            dest,
            nargs=0,
            default=argparse.SUPPRESS,
            help="print the versions of accelfn and torch, and exit",
        )

    def __call__(self, parser: argparse.ArgumentParser, *args: object) -> None:
        print(version_line())
        parser.exit()


def build_parser() -> argparse.ArgumentParser:
    """The full parser (every command registers its own subparser)."""
    parser = argparse.ArgumentParser(prog="accelfn", description="Functional training for PyTorch.")
    parser.add_argument("-V", "--version", action=_VersionAction)
    sub = parser.add_subparsers(
        dest="command", metavar="{config,env,test,launch,dry-run,plan,estimate-memory,plot}", required=True
    )
    for command in COMMANDS:
        command.add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Parse ``argv`` (default ``sys.argv[1:]``), run the command, exit with its code."""
    args = build_parser().parse_args(argv)
    code = int(args.func(args) or 0)
    if argv is None:
        # As a command, skip the interpreter's teardown of torch (~0.5 s): nothing is left to clean up.
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


if __name__ == "__main__":
    main()

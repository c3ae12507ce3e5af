"""``accelfn`` entry point: an argparse parser with one subcommand per module.

Example:
    $ accelfn launch --nproc-per-node 2 --cpu train.py --epochs 1
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence

from . import config, env, estimate_memory, launch, plot, test

COMMANDS = (config, env, test, launch, estimate_memory, plot)


def build_parser() -> argparse.ArgumentParser:
    """The full parser (every command registers its own subparser)."""
    parser = argparse.ArgumentParser(prog="accelfn", description="Functional training for PyTorch.")
    sub = parser.add_subparsers(dest="command", metavar="{config,env,test,launch,estimate-memory,plot}", required=True)
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

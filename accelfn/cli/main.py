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


def with_dashes(parser: argparse.ArgumentParser, argv: Sequence[str]) -> list[str]:
    """`argv` with torchrun's and Accelerate's underscore spellings of a command's options
    (`--nproc_per_node`, `--num_processes`, `--mixed_precision=bf16`) as the command's dashed ones, up to the
    script path (its own arguments are left as they are).

    Example:
        >>> with_dashes(build_parser(), ["launch", "--nproc_per_node", "2", "train.py", "--max_steps", "5"])
        ['launch', '--nproc-per-node', '2', 'train.py', '--max_steps', '5']
    """
    out = list(argv)
    sub = next((a for a in parser._actions if isinstance(a, argparse._SubParsersAction)), None)
    command = sub.choices.get(out[0]) if sub is not None and out else None
    if command is None:
        return out
    known = command._option_string_actions
    i = 1
    while i < len(out):
        token = out[i]
        if token == "--" or not token.startswith("-"):
            break  # the script path: what follows is the script's
        name, eq, value = token.partition("=")
        if name not in known and name.startswith("--") and name.replace("_", "-") in known:
            name = name.replace("_", "-")
            out[i] = name + eq + value
        action = known.get(name)
        i += 2 if action is not None and action.nargs != 0 and not eq else 1
    return out


def main(argv: Sequence[str] | None = None) -> int:
    """Parse ``argv`` (default ``sys.argv[1:]``), run the command, exit with its code."""
    parser = build_parser()
    words = with_dashes(parser, sys.argv[1:] if argv is None else argv)
    args, unknown = parser.parse_known_args(words)
    if unknown:  # argparse would print the top-level usage; the command's says what it takes
        sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        if words[0] not in sub.choices:
            parser.error(f"unrecognized arguments: {' '.join(unknown)}")
        sub.choices[words[0]].error(
            f"unrecognized arguments: {' '.join(unknown)} (the options of accelfn {words[0]} go before the "
            "script path; see accelfn " + words[0] + " --help)"
        )
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

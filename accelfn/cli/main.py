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


def _command(parser: argparse.ArgumentParser, name: str) -> argparse.ArgumentParser | None:
    """The subcommand `name`'s parser (None for a word that names none)."""
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices.get(name)


def with_dashes(parser: argparse.ArgumentParser, argv: Sequence[str]) -> list[str]:
    """`argv` with torchrun's and Accelerate's underscore spellings of a command's options
    (`--nproc_per_node`, `--num_processes`, `--mixed_precision=bf16`) as the command's dashed ones, up to the
    script path (its own arguments are left as they are).

    Example:
        >>> with_dashes(build_parser(), ["launch", "--nproc_per_node", "2", "train.py", "--max_steps", "5"])
        ['launch', '--nproc-per-node', '2', 'train.py', '--max_steps', '5']
    """
    out = list(argv)
    command = _command(parser, out[0]) if out else None
    if command is None:
        return out
    known = command._option_string_actions

    def action_of(name: str) -> argparse.Action | None:  # an option's action, abbreviated as argparse allows
        if name in known:
            return known[name]
        longer = {known[o] for o in known if name.startswith("--") and o.startswith(name)}
        return longer.pop() if len(longer) == 1 else None

    i = 1
    while i < len(out):
        token = out[i]
        if token == "--" or not token.startswith("-"):
            break  # the script path: what follows is the script's
        name, eq, value = token.partition("=")
        action = action_of(name)
        if action is None and "_" in name and (dashed := action_of(name.replace("_", "-"))) is not None:
            action, out[i] = dashed, name.replace("_", "-") + eq + value
        i += 1
        if action is None or eq or action.nargs == 0:
            continue
        # its values: one (nargs None), N, at most one ("?"), or up to the next option ("*", "+")
        if action.nargs in ("?", "*", "+"):
            most = 1 if action.nargs == "?" else len(out)
            while most and i < len(out) and not out[i].startswith("-"):
                i, most = i + 1, most - 1
        else:
            i += 1 if action.nargs is None else int(action.nargs)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    """Parse ``argv`` (default ``sys.argv[1:]``), run the command, exit with its code."""
    parser = build_parser()
    words = with_dashes(parser, sys.argv[1:] if argv is None else argv)
    args, unknown = parser.parse_known_args(words)
    if unknown:  # argparse would print the top-level usage; the command's says what it takes
        command = _command(parser, words[0])
        if command is None:
            parser.error(f"unrecognized arguments: {' '.join(unknown)}")
        runs_a_script = any(a.dest == "script" for a in command._actions)
        command.error(
            f"unrecognized arguments: {' '.join(unknown)}"
            + (" (not options of accelfn " + words[0] + "; the script's own options go after its path)"
               if runs_a_script else "")
        )  # fmt: skip
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

"""``accelfn test``: run the built-in distributed self-check on all configured processes.

It goes through the same launcher as ``accelfn launch`` (``-m accelfn.cli.selftest_worker``) and
prints PASS or FAIL; the exit code is non-zero on FAIL.

Example:
    $ accelfn test --nproc-per-node 2 --cpu
"""

from __future__ import annotations

import argparse
from typing import Any

from .launch import add_launch_options, launch, options_from_args


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "test",
        help="distributed self-check through the launcher",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_launch_options(p)
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    code = launch(options_from_args(args, "accelfn.cli.selftest_worker", [], module=True))
    print("accelfn test: PASS" if code == 0 else f"accelfn test: FAIL (exit code {code})", flush=True)
    return code

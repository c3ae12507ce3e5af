"""Process helpers: run a block on the main process first, print once."""

from __future__ import annotations

import builtins
import contextlib
from collections.abc import Iterator
from typing import Any

from ._runtime import is_local_main_process, is_main_process
from .collectives import barrier

__all__ = ["main_process_first", "print"]


@contextlib.contextmanager
def main_process_first(local: bool = False) -> Iterator[None]:
    """Run the block on the main process (with `local=True`: the first process of each node) before the
    others enter it, e.g. to download or preprocess a dataset once, then read it everywhere.

    Example:
        >>> import accelfn as af
        >>> with af.dist.main_process_first():
        ...     data = list(range(3))
    """
    first = is_local_main_process() if local else is_main_process()
    if not first:
        barrier()  # wait for the main process to finish the block
    yield  # if the main process's block raises, the others are not let in: the job fails on its error
    if first:
        barrier()  # let the others in


def print(*args: Any, **kwargs: Any) -> None:  # noqa: A001
    """`print` on the main process only.

    Example:
        >>> import accelfn as af
        >>> af.dist.print("loss", 0.25)
        loss 0.25
    """
    if is_main_process():
        builtins.print(*args, **kwargs)

"""`progress`: a tqdm progress bar on the main process, a silent passthrough on the others."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from tqdm.auto import tqdm

from ._runtime import is_main_process

__all__ = ["progress"]


def progress(iterable: Iterable[Any] | None = None, **kwargs: Any) -> tqdm:
    """`tqdm(iterable, **kwargs)`, disabled on every process but the main one (methods still work there).

    Example:
        >>> import accelfn as af
        >>> sum(af.progress(range(4), disable=True))
        6
    """
    kwargs["disable"] = bool(kwargs.get("disable", False)) or not is_main_process()
    return tqdm(iterable, **kwargs)

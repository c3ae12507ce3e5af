"""Runtime type checks at the public boundary (typeguard), raising `TypeError` that names the parameter.

Checks run once per call of a public constructor (`train_step`, `adamw`, ...), never inside a step.
"""

from __future__ import annotations

import functools
import inspect
import typing
from collections.abc import Callable
from typing import Any, TypeVar

import typeguard

F = TypeVar("F", bound=Callable[..., Any])

_CONFIG = typeguard.TypeCheckConfiguration(
    collection_check_strategy=typeguard.CollectionCheckStrategy.ALL_ITEMS
)


def checked(fn: F) -> F:
    """Decorate a public function so a wrong argument type raises `TypeError` naming the parameter."""
    sig = inspect.signature(fn)
    hints: dict[str, Any] | None = None

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        nonlocal hints
        if hints is None:
            hints = typing.get_type_hints(fn)
        try:
            bound = sig.bind(*args, **kwargs)
        except TypeError as e:
            raise TypeError(f"{fn.__qualname__}(): {e}") from None
        for name, value in bound.arguments.items():
            hint = hints.get(name)
            if hint is None or hint is Any:
                continue
            kind = sig.parameters[name].kind
            if kind is inspect.Parameter.VAR_POSITIONAL:
                values = [(f"{name}[{i}]", v) for i, v in enumerate(value)]
            elif kind is inspect.Parameter.VAR_KEYWORD:
                values = [(k, v) for k, v in value.items()]
            else:
                values = [(name, value)]
            for label, v in values:
                if isinstance(hint, type) and hint is not float:  # plain classes: isinstance is enough
                    if not isinstance(v, hint):
                        raise TypeError(
                            f"{fn.__qualname__}(): argument '{label}' has the wrong type: got "
                            f"{type(v).__name__} ({v!r:.60}), expected {hint.__name__}"
                        )
                    continue
                try:
                    typeguard.check_type(v, hint, collection_check_strategy=_CONFIG.collection_check_strategy)
                except typeguard.TypeCheckError as e:
                    raise TypeError(
                        f"{fn.__qualname__}(): argument '{label}' has the wrong type: got "
                        f"{type(v).__name__} ({v!r:.60}), expected {_hint_name(hint)} ({e})"
                    ) from None
        return fn(*args, **kwargs)

    return wrapper  # type: ignore[return-value]


def _hint_name(hint: Any) -> str:
    return getattr(hint, "__name__", None) or str(hint).replace("typing.", "")

"""Pytree helpers on optree, in accelfn's namespace (so `TrainState` is a node).

Example:
    >>> import torch, accelfn as af
    >>> tree = {"w": torch.ones(2), "opt": (torch.zeros(1),)}
    >>> [p for p, _ in af.tree.flatten_with_path(tree)]
    ['opt.0', 'w']
    >>> af.tree.map(lambda x: x + 1, tree)["w"].tolist()
    [2.0, 2.0]
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import optree

NAMESPACE = "accelfn"

__all__ = ["NAMESPACE", "map", "leaves", "flatten", "unflatten", "flatten_with_path", "structure", "path_str"]


def map(fn: Callable[..., Any], tree: Any, *rest: Any, none_is_leaf: bool = False) -> Any:  # noqa: A001
    """Apply `fn` to every leaf (and the matching leaves of `rest`), keeping the structure."""
    return optree.tree_map(fn, tree, *rest, none_is_leaf=none_is_leaf, namespace=NAMESPACE)


def leaves(tree: Any) -> list[Any]:
    """The leaves of `tree` in a fixed order (dict keys sorted)."""
    return optree.tree_leaves(tree, namespace=NAMESPACE)


def flatten(tree: Any) -> tuple[list[Any], optree.PyTreeSpec]:
    """`(leaves, treespec)`; `unflatten(treespec, leaves)` puts them back."""
    return optree.tree_flatten(tree, namespace=NAMESPACE)


def unflatten(spec: optree.PyTreeSpec, leaves: list[Any]) -> Any:
    """Inverse of `flatten`."""
    return optree.tree_unflatten(spec, leaves)


def structure(tree: Any) -> optree.PyTreeSpec:
    """The tree's structure (a `PyTreeSpec`), for comparing two trees."""
    return optree.tree_structure(tree, namespace=NAMESPACE)


def path_str(path: Any) -> str:
    """Join a path with dots, using field names for named tuples: `opt_state.0.mu.fc.weight`."""
    return ".".join(str(getattr(e, "field", None) or getattr(e, "entry", e)) for e in path)


def flatten_with_path(tree: Any) -> list[tuple[str, Any]]:
    """`[(dotted_path, leaf), ...]` in `leaves` order (named-tuple fields by name)."""
    accessors, lvs, _ = optree.tree_flatten_with_accessor(tree, namespace=NAMESPACE)
    return [(path_str(a), leaf) for a, leaf in zip(accessors, lvs)]

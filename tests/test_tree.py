"""af.tree: structure, path_str and flatten_with_path on nested dicts, lists, named tuples and TrainState."""

from typing import NamedTuple

import optree
import pytest
import torch

import accelfn as af
from tests.models import MLP


class Point(NamedTuple):
    x: object
    y: object


def nested():
    return {"b": [torch.ones(1), {"c": torch.ones(2)}], "a": Point(torch.zeros(1), (torch.zeros(3),))}


# ---- structure -------------------------------------------------------------------------------------------------
def test_structure_describes_the_nesting_without_the_leaves():
    spec = af.tree.structure(nested())
    assert str(spec) == "PyTreeSpec({'a': Point(x=*, y=(*,)), 'b': [*, {'c': *}]})"
    assert spec.num_leaves == 4
    assert af.tree.structure({"b": [0, {"c": 1}], "a": Point(2, (3,))}) == spec  # leaves do not matter
    leaves = af.tree.leaves(nested())
    again = af.tree.unflatten(spec, leaves)
    assert again["a"].y[0] is leaves[1] and isinstance(again["a"], Point)


@pytest.mark.parametrize(
    "other",
    [
        {"b": [1, {"c": 2}], "a": Point(3, [4])},  # list instead of tuple
        {"b": [1, {"d": 2}], "a": Point(3, (4,))},  # other key
        {"b": [1, {"c": 2}, 5], "a": Point(3, (4,))},  # one more leaf
        {"b": [1, {"c": 2}], "a": (3, (4,))},  # plain tuple instead of the named tuple
    ],
)
def test_structure_tells_different_trees_apart(other):
    assert af.tree.structure(other) != af.tree.structure(nested())


def test_structure_sees_into_a_train_state():
    """`TrainState` is a node in accelfn's optree namespace: its structure is its fields, not one leaf."""
    state = af.train_step(lambda m, b: m(b).sum(), af.optim.sgd(0.1, momentum=0.9)).init(MLP())
    spec = af.tree.structure(state)
    assert spec.num_leaves == len(af.tree.leaves(state)) > 1
    assert spec.namespace == af.tree.NAMESPACE == "accelfn"
    assert optree.tree_structure(state).num_leaves == 1  # outside the namespace it would be a single leaf
    copied = af.tree.map(lambda t: t.clone(), state)
    assert af.tree.structure(copied) == spec
    assert af.tree.structure(state.replace(params={})) != spec


# ---- path_str / flatten_with_path ---------------------------------------------------------------------------
def test_path_str_joins_entries_with_dots():
    assert af.tree.path_str(("b", 1, "c")) == "b.1.c"
    assert af.tree.path_str(()) == ""
    assert af.tree.path_str(["opt_state", 0, "mu"]) == "opt_state.0.mu"


def test_path_str_names_named_tuple_fields_and_indexes_sequences():
    accessors = optree.tree_accessors(nested(), namespace=af.tree.NAMESPACE)
    assert [af.tree.path_str(a) for a in accessors] == ["a.x", "a.y.0", "b.0", "b.1.c"]
    # raw optree paths carry the named tuple's position instead of its field name
    assert [af.tree.path_str(p) for p in optree.tree_paths(nested(), namespace=af.tree.NAMESPACE)] == [
        "a.0",
        "a.1.0",
        "b.0",
        "b.1.c",
    ]


def test_flatten_with_path_pairs_paths_with_leaves_in_leaves_order():
    tree = nested()
    pairs = af.tree.flatten_with_path(tree)
    assert [p for p, _ in pairs] == ["a.x", "a.y.0", "b.0", "b.1.c"]
    assert all(a is b for (_, a), b in zip(pairs, af.tree.leaves(tree)))
    assert pairs[3][1] is tree["b"][1]["c"]


def test_flatten_with_path_names_the_fields_of_an_optimizer_state():
    state = af.train_step(
        lambda m, b: m(b).sum(), af.optim.chain(af.optim.clip_by_global_norm(1.0), af.optim.adamw(1e-3))
    ).init(MLP())
    paths = [p for p, _ in af.tree.flatten_with_path(state)]
    assert "opt_state.1.mu.fc1.weight" in paths and "opt_state.1.nu.fc2.bias" in paths
    assert "params.fc1.weight" in paths and "buffers" not in paths and "step" in paths and "rng" in paths
    assert len(paths) == len(set(paths))

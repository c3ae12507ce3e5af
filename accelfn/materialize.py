"""Materialise a module built on the meta device: storage on the device, values from the modules' own init rules.

A model built under `af.init_empty()` (or `torch.device("meta")`) holds no memory. `step.init` materialises it
*after* sharding, so that each rank allocates only its shards: `materialize(module, device, seed)` gives every
meta parameter and buffer storage on `device` (a DTensor: its local shard) and fills it with the value its
module's init rule gives, one module at a time: the module's tensors are built whole on the host (the largest
single module is the most held at once), initialised by the module's `reset_parameters()` (torch's private
`_reset_parameters()` where it has none, as `nn.MultiheadAttention`; inside a `transformers` model, the model's
`_init_weights`, as `from_config` initialises it; inside an `nn.Transformer`, then xavier-uniform for every
matrix, as its `_reset_parameters()` re-initialises its subtree), and this rank's part is copied out. Each module draws from its own generator seeded by `seed` and the module's name, so the values
do not depend on the parallelism (one process, fsdp, tp, pipeline stages: the same model) and need no
communication; the caller's RNG is left as it was. Modules are visited children first, so a parent's rule
that writes its children's tensors wins, as in a host build. Tensors that were not on the meta device keep
their values; tied parameters stay tied.

Example:
    >>> import torch, accelfn as af
    >>> from accelfn.materialize import materialize
    >>> with af.init_empty():
    ...     net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    >>> materialize(net, torch.device("cpu"), seed=0)
    >>> net[1].weight.tolist(), net[0].weight.abs().max().item() <= 0.5  # LayerNorm: ones; Linear: U(-1/2, 1/2)
    ([1.0, 1.0, 1.0, 1.0], True)
"""

from __future__ import annotations

import contextlib
import contextvars
import warnings
import zlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from . import dry_mode
from . import random as _random

__all__ = ["has_meta", "materialize"]


def has_meta(module: nn.Module) -> bool:
    """Whether a parameter or buffer of `module` is on the meta device (a DTensor: its local shard)."""
    return any(_local(t).is_meta for t in [*module.parameters(), *module.buffers()])


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") and hasattr(t, "placements") else t  # type: ignore[no-any-return]


def _hf_owners(module: nn.Module) -> dict[int, nn.Module]:
    """id(submodule) -> the innermost `transformers` model holding it (whose `_init_weights` initialises it)."""
    import sys

    transformers = sys.modules.get("transformers")
    if transformers is None:
        return {}
    out: dict[int, nn.Module] = {}
    models = [m for m in module.modules() if isinstance(m, transformers.PreTrainedModel)]
    for model in models:  # outer ones first: an inner model overrides for its own modules
        for m in model.modules():
            out[id(m)] = model
    return out


def _xavier_matrices(stand_in: nn.Module) -> None:
    """`nn.Transformer._reset_parameters()`, for one module: xavier-uniform every parameter of 2+ dimensions."""
    for p in stand_in._parameters.values():
        if p is not None and p.dim() > 1:
            nn.init.xavier_uniform_(p)


# Modules whose init rule re-initialises their whole subtree after the children's own rules: the rule, for one
# module of the subtree at a time (run after that module's own rule).
_SUBTREE_RULES: dict[type, Any] = {nn.Transformer: _xavier_matrices}


def _subtree_owners(module: nn.Module) -> dict[int, Any]:
    """id(submodule) -> the subtree rule of the innermost module of `_SUBTREE_RULES` holding it."""
    out: dict[int, Any] = {}
    for m in module.modules():  # outer ones first: an inner one overrides for its own modules
        rule = next((r for cls, r in _SUBTREE_RULES.items() if isinstance(m, cls)), None)
        if rule is not None:
            out.update((id(sub), rule) for sub in m.modules())
    return out


def _own_rule(cls: type) -> Any:
    """The class's `reset_parameters`, else torch's private `_reset_parameters` (nn.MultiheadAttention's)."""
    return getattr(cls, "reset_parameters", None) or getattr(cls, "_reset_parameters", None)


def _rule(name: str, m: nn.Module, owners: dict[int, nn.Module], subtree: dict[int, Any]) -> Any:
    """The function that initialises module `m`'s direct tensors (given a stand-in of `m`)."""
    owner = owners.get(id(m))
    if owner is not None:
        return owner._init_weights  # type: ignore[operator]
    reset = _own_rule(type(m))
    if reset is not None:
        after = subtree.get(id(m))
        if after is None:
            return reset
        return lambda stand_in: (reset(stand_in), after(stand_in))
    where = name or "the root module"
    raise ValueError(
        f"step.init: the model was built on the meta device, and module {where!r} ({type(m).__name__}) has "
        "parameters or buffers there but no `reset_parameters()` to give them values. Give the module a "
        "`reset_parameters()`, or build the model on the host (or its buffers: af.init_empty() keeps buffers "
        "on the host unless include_buffers=True)"
    )


@torch.no_grad()
def materialize(module: nn.Module, device: torch.device, seed: int | None = None) -> None:
    """Give the meta parameters and buffers of `module` storage on `device` and their init rule's values (see
    the module docs); the others keep theirs. DTensor parameters (FSDP2, tensor parallel) get their shard.
    `seed` defaults to the one `step.init(model, seed=...)` is running with (`seeding`), else 0."""
    named = list(module.named_modules(remove_duplicate=True))
    todo = [
        (name, m)
        for name, m in reversed(named)  # children before their parents
        if any(_local(t).is_meta for t in [*m._parameters.values(), *m._buffers.values()] if t is not None)
    ]
    if not todo:
        return
    owners, subtree = _hf_owners(module), _subtree_owners(module)
    rules = {name: _rule(name, m, owners, subtree) for name, m in todo}  # every error before any allocation
    _warn_unrun_parents(named, {id(m) for _, m in todo}, owners)
    kept = {  # the real tensors, whose values to_empty would drop
        (id(m), kind, key): _local(t).detach().clone()
        for _, m in named
        for kind, store in (("p", m._parameters), ("b", m._buffers))
        for key, t in store.items()
        if t is not None and not _local(t).is_meta
    }
    on_meta = {
        (id(m), kind, key)
        for _, m in todo
        for kind, store in (("p", m._parameters), ("b", m._buffers))
        for key, t in store.items()
        if t is not None and _local(t).is_meta
    }
    tied: dict[int, list[tuple[nn.Module, str]]] = {}
    for _, m in named:
        for key, t in m._parameters.items():
            if t is not None:
                tied.setdefault(id(t), []).append((m, key))
    module.to_empty(device=device)  # FSDP2's modules re-register their shards (its `_apply`)
    for slots in tied.values():  # to_empty gives each slot its own new parameter
        first = slots[0][0]._parameters[slots[0][1]]
        for m, key in slots[1:]:
            m._parameters[key] = first
    for _, m in named:
        for kind, store in (("p", m._parameters), ("b", m._buffers)):
            for key, t in store.items():
                old = kept.get((id(m), kind, key))
                if t is not None and old is not None:
                    _local(t).copy_(old)
    del kept
    base = _seed.get() if seed is None else seed
    done: set[int] = set()
    for name, m in todo:
        with torch.random.fork_rng(devices=[]):  # the stand-ins are on the host: the CPU generator only
            torch.manual_seed(_random.seed_of(_random.fold_in(_random.key(base), zlib.crc32(name.encode()))))
            _fill(name, m, rules[name], on_meta, done)


_seed: contextvars.ContextVar[int] = contextvars.ContextVar("accelfn_materialize_seed", default=0)


@contextlib.contextmanager
def seeding(seed: int) -> Iterator[None]:
    """Inside the block, `materialize` seeds from `seed` by default (`step.init` runs its lowering in it)."""
    token = _seed.set(seed)
    try:
        yield
    finally:
        _seed.reset(token)


def _warn_unrun_parents(
    named: list[tuple[str, nn.Module]], filled: set[int], owners: dict[int, nn.Module]
) -> None:
    """Warn about modules with a `reset_parameters()` that are not run: they hold no meta tensor of their own
    but have some below them (such a rule may set its children's values, which a host build would keep)."""
    for name, m in named:
        if id(m) in filled or id(m) in owners or type(m) in _SUBTREE_RULES or _own_rule(type(m)) is None:
            continue
        if any(_local(t).is_meta for t in [*m.parameters(), *m.buffers()]):
            warnings.warn(
                f"step.init: module {name or '(root)'!r} ({type(m).__name__}) has a reset_parameters() but no "
                "tensors of its own; with the model on the meta device it is not run (its children are "
                "initialised by their own rules). If it sets its children's values, build the model on the host",
                stacklevel=3,
            )


def _fill(name: str, m: nn.Module, rule: Any, on_meta: set[tuple[int, str, str]], done: set[int]) -> None:
    """Build `m`'s direct tensors whole on the host in a stand-in of `m`, run `rule` on it, copy each tensor's
    part (a DTensor's shard) into `m`'s."""
    with dry_mode.on_host():  # the stand-in is host memory (a dry run counts it there)
        _fill_stand_in(name, m, rule, on_meta, done)


def _fill_stand_in(
    name: str, m: nn.Module, rule: Any, on_meta: set[tuple[int, str, str]], done: set[int]
) -> None:
    stand_in: Any = object.__new__(_original_class(type(m)))  # the init rule reads e.g. padding_idx, config
    stand_in.__dict__.update(m.__dict__)
    stand_in._parameters = {k: None for k, t in m._parameters.items() if t is None}  # e.g. `bias=False`
    stand_in._buffers = {k: None for k, t in m._buffers.items() if t is None}
    real: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for kind, store in (("p", m._parameters), ("b", m._buffers)):
        for key, t in store.items():
            if t is None:
                continue
            if (
                id(m),
                kind,
                key,
            ) not in on_meta:  # keeps its value: the stand-in gets a copy the rule may change
                copy = _local(t).detach().clone()
                if kind == "p":
                    stand_in._parameters[key] = nn.Parameter(copy, requires_grad=t.requires_grad)
                else:
                    stand_in._buffers[key] = copy
                continue
            whole = (
                torch.full(t.shape, float("nan"), dtype=t.dtype)
                if t.is_floating_point()
                else torch.zeros(t.shape, dtype=t.dtype)
            )
            if kind == "p":
                stand_in._parameters[key] = nn.Parameter(whole, requires_grad=t.requires_grad)
            else:
                stand_in._buffers[key] = whole
            real[key] = (t, whole)
    rule(stand_in)
    for key, (t, _) in real.items():
        whole = stand_in._parameters.get(key) if key in stand_in._parameters else stand_in._buffers.get(key)
        assert whole is not None
        if id(t) in done:
            continue
        done.add(id(t))
        fake = (
            getattr(whole, "fake_mode", None) is not None
        )  # a dry run's or a test's fake tensors: no values
        if not fake and whole.is_floating_point() and bool(whole.isnan().any()):
            raise ValueError(
                f"step.init: the model was built on the meta device, and the init rule of module "
                f"{name or '(root)'!r} ({type(m).__name__}) left {key!r} unset. Give the module a "
                "`reset_parameters()` that sets it, or build the model on the host"
            )
        _local(t).copy_(_part(t, whole.detach()))


def _original_class(cls: type) -> type:
    """The module's own class, not FSDP2's `FSDP<class>` (whose constructor re-runs the original's)."""
    from torch.distributed.fsdp import FSDPModule

    return next((c for c in cls.__mro__ if not issubclass(c, FSDPModule)), cls)


def _part(t: torch.Tensor, whole: torch.Tensor) -> torch.Tensor:
    """This rank's part of `whole` for `t` (a DTensor's local shard; `whole` itself otherwise)."""
    placements = getattr(t, "placements", None)
    if placements is None:
        return whole
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    with (
        unset_fake_temporarily()
    ):  # index arithmetic (strided shards build index tensors): real, as fake has none
        shape, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, placements)  # type: ignore[attr-defined]
    return whole[tuple(slice(o, o + s) for o, s in zip(offset, shape))]

"""Model <-> pytree: split an `nn.Module` into `(params, buffers)` dicts and bind them back in place.

Tied parameters (one tensor under several module paths, e.g. GPT-2's `lm_head.weight` and
`transformer.wte.weight`) appear once in `params`, under the first name, and stay tied when bound.

Example:
    >>> import torch, accelfn as af
    >>> net = torch.nn.Linear(2, 3)
    >>> params, buffers = af.partition(net)
    >>> sorted(params), buffers
    (['bias', 'weight'], {})
    >>> _ = af.bind(net, {"weight": torch.zeros(3, 2), "bias": torch.ones(3)}, {})
    >>> net(torch.ones(1, 2)).tolist()
    [[1.0, 1.0, 1.0]]
"""

from __future__ import annotations

from typing import Any

import attrs
import torch
from torch import nn

__all__ = ["partition", "bind", "Slots", "slots_of", "move"]

Slot = tuple[nn.Module, str]


@attrs.frozen
class Slots:
    """Where each named parameter and buffer of a module lives: every (submodule, attribute) alias."""

    params: dict[str, list[Slot]]
    buffers: dict[str, list[Slot]]
    trainable: tuple[str, ...]


def _collect(module: nn.Module, kind: str) -> dict[str, list[Slot]]:
    named = module.named_parameters if kind == "params" else module.named_buffers
    first: dict[int, str] = {}
    out: dict[str, list[Slot]] = {}
    for name, t in named(remove_duplicate=False):
        owner_name, _, attr = name.rpartition(".")
        owner = module.get_submodule(owner_name)
        canonical = first.setdefault(id(t), name)
        out.setdefault(canonical, []).append((owner, attr))
    return out


def slots_of(module: nn.Module) -> Slots:
    """Compute the alias table of `module` (done once per model)."""
    params = _collect(module, "params")
    trainable = tuple(n for n, s in params.items() if s[0][0]._parameters[s[0][1]].requires_grad)  # type: ignore[union-attr]
    return Slots(params, _collect(module, "buffers"), trainable)


def partition(module: nn.Module) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """`(params, buffers)`: the module's own tensors by dotted name (tied ones once).

    Example:
        >>> import torch, accelfn as af
        >>> params, buffers = af.partition(torch.nn.BatchNorm1d(4))
        >>> sorted(params), sorted(buffers)
        (['bias', 'weight'], ['num_batches_tracked', 'running_mean', 'running_var'])
    """
    return dict(module.named_parameters()), dict(module.named_buffers())


def _check(kind: str, given: dict[str, Any], slots: dict[str, list[Slot]]) -> None:
    if not isinstance(given, dict):
        raise TypeError(
            f"{kind} must be a dict of dotted module names -> tensors, got {type(given).__name__}"
        )
    missing = [k for k in slots if k not in given]
    extra = [k for k in given if k not in slots]
    if missing or extra:
        parts = []
        if missing:
            parts.append(f"missing {missing[:5]}{' ...' if len(missing) > 5 else ''}")
        if extra:
            parts.append(f"unexpected {extra[:5]}{' ...' if len(extra) > 5 else ''}")
        raise KeyError(f"{kind} do not match the model: " + "; ".join(parts))
    store = "_parameters" if kind == "params" else "_buffers"
    for name, value in given.items():
        owner, attr = slots[name][0]
        current = getattr(owner, store)[attr]
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"{kind}[{name!r}] is a {type(value).__name__}, expected a torch.Tensor")
        if current is not None and value.shape != current.shape:
            raise ValueError(
                f"{kind}[{name!r}] has shape {tuple(value.shape)} but the model expects {tuple(current.shape)}"
            )


def bind(
    module: nn.Module,
    params: dict[str, torch.Tensor],
    buffers: dict[str, torch.Tensor],
    slots: Slots | None = None,
) -> dict[str, torch.Tensor]:
    """Make `module` use exactly these tensors (in place, every alias); returns the bound params.

    Tensors that are not `nn.Parameter` are wrapped (sharing storage), so the returned dict may hold new
    objects; use it as the state's params. Cheap when the tensors are already bound.

    Example:
        >>> import torch, accelfn as af
        >>> net = torch.nn.Linear(2, 2)
        >>> params, buffers = af.partition(net)
        >>> new = af.bind(net, {k: torch.zeros_like(v) for k, v in params.items()}, buffers)
        >>> net.weight.abs().sum().item(), net.weight is new["weight"]
        (0.0, True)
    """
    slots = slots or slots_of(module)
    if _is_bound(params, slots.params, "_parameters") and _is_bound(buffers, slots.buffers, "_buffers"):
        return params
    _check("params", params, slots.params)
    _check("buffers", buffers, slots.buffers)
    trainable = set(slots.trainable)
    bound: dict[str, torch.Tensor] = {}
    for name, value in params.items():
        if not isinstance(value, nn.Parameter):
            value = nn.Parameter(
                value.detach(), requires_grad=name in trainable and value.is_floating_point()
            )
        bound[name] = value
        for owner, attr in slots.params[name]:
            owner._parameters[attr] = value
    for name, value in buffers.items():
        for owner, attr in slots.buffers[name]:
            owner._buffers[attr] = value
    return bound


def _is_bound(given: Any, slots: dict[str, list[Slot]], store: str) -> bool:
    if not isinstance(given, dict) or len(given) != len(slots):
        return False
    for name, aliases in slots.items():
        owner, attr = aliases[0]
        if getattr(owner, store).get(attr) is not given.get(name):
            return False
    return True


def read_buffers(slots: Slots) -> dict[str, torch.Tensor]:
    """The module's current buffers (a forward may have replaced them, e.g. running stats)."""
    return {name: aliases[0][0]._buffers[aliases[0][1]] for name, aliases in slots.buffers.items()}  # type: ignore[misc]


def move(module: nn.Module, device: torch.device) -> nn.Module:
    """`module.to(device)` when a parameter or buffer is elsewhere; else nothing (no tensor swapped: fake
    tensors, as in a dry run, cannot be swapped in place). Tensors on the meta device are materialised on
    `device` with their modules' init rules (`accelfn.materialize`).

    Example:
        >>> import torch
        >>> m = torch.nn.Linear(2, 2)
        >>> move(m, torch.device("cpu")) is m
        True
    """
    device = torch.device(device)
    from .materialize import has_meta, materialize

    if has_meta(module):  # built on the meta device: the whole model on `device` (sharding first: see fsdp)
        materialize(module, device)
    tensors = [*module.parameters(), *module.buffers()]
    if any(
        t.device != device and not (t.device.type == device.type and device.index is None) for t in tensors
    ):
        module.to(device)
    return module

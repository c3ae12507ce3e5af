"""Forward hooks that bring a module's offloaded weights to the execution device for one call, then drop them."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import attrs
import optree
import torch
from torch import nn

__all__ = ["Offloaded", "attach_offload", "attach_input_alignment", "remove_hooks"]

_HANDLES = "_accelfn_big_hooks"
_ENTRIES = "_accelfn_big_offloaded"
_FILES = "_accelfn_big_offload_files"  # a weakref.finalize deleting the files a dispatch wrote for the model


@attrs.define
class Offloaded:
    """One tensor a module holds that lives elsewhere: `fetch()` returns it (any device), `release()` frees it."""

    local: str
    is_param: bool
    placeholder: torch.Tensor
    """What the module holds between calls (a meta tensor of the right shape and dtype)."""
    fetch: Callable[[], torch.Tensor]
    release: Callable[[], None] | None = None


def _set(module: nn.Module, entry: Offloaded, value: torch.Tensor) -> None:
    if entry.is_param:
        module._parameters[entry.local] = (
            value if isinstance(value, nn.Parameter) else nn.Parameter(value, requires_grad=False)
        )
    else:
        module._buffers[entry.local] = value


def _keep(module: nn.Module, handle: Any) -> None:
    handles = module.__dict__.setdefault(_HANDLES, [])
    handles.append(handle)


def attach_offload(module: nn.Module, entries: list[Offloaded], device: torch.device) -> None:
    """Before each forward of `module`, load `entries` onto `device` (cast to the placeholder's dtype); after it,
    put the meta placeholders back and release the source."""
    for e in entries:
        _set(module, e, e.placeholder)
    module.__dict__.setdefault(_ENTRIES, []).extend(entries)

    def pre(mod: nn.Module, args: Any) -> None:
        for e in entries:
            value = e.fetch().to(device=device, dtype=e.placeholder.dtype)
            _set(mod, e, value)

    def post(mod: nn.Module, args: Any, output: Any) -> None:
        for e in entries:
            _set(mod, e, e.placeholder)
            if e.release is not None:
                e.release()

    _keep(module, module.register_forward_pre_hook(pre))
    _keep(module, module.register_forward_hook(post))


def _to(device: torch.device, tree: Any) -> Any:
    return optree.tree_map(
        lambda x: x.to(device) if isinstance(x, torch.Tensor) else x, tree, none_is_leaf=True
    )


def attach_input_alignment(module: nn.Module, device: torch.device, *, outputs_back: bool = False) -> None:
    """Move `module`'s tensor inputs to `device` before it runs; with `outputs_back`, move its outputs back
    to the device of its first tensor input."""
    first: list[torch.device] = []

    def pre(mod: nn.Module, args: Any, kwargs: Any) -> tuple[Any, Any]:
        if outputs_back:
            tree: Any = (args, kwargs)
            leaves = [x for x in optree.tree_leaves(tree, none_is_leaf=True) if isinstance(x, torch.Tensor)]
            first[:] = [leaves[0].device] if leaves else []
        return _to(device, args), _to(device, kwargs)

    def post(mod: nn.Module, args: Any, output: Any) -> Any:
        return _to(first[0], output) if first else output

    _keep(module, module.register_forward_pre_hook(pre, with_kwargs=True))
    if outputs_back:
        _keep(module, module.register_forward_hook(post))


def remove_hooks(model: nn.Module, *, restore: bool = True) -> None:
    """Remove the hooks `dispatch`, `load_and_dispatch` and `cpu_offload` installed (the user's own stay).

    With `restore` (the default) offloaded weights come back into the module where they are kept (host
    memory, or memory-mapped from the offload folder), so the model runs without the hooks; with
    `restore=False` they stay meta placeholders (the host copies are dropped with the hooks, and the files the
    dispatch wrote to `offload_folder` are deleted).

    Example:
        >>> import torch, accelfn as af
        >>> model = af.cpu_offload(torch.nn.Linear(2, 2))
        >>> af.big.remove_hooks(model); len(model._forward_pre_hooks), model.weight.device.type
        (0, 'cpu')
    """
    restored: dict[
        tuple[Any, ...], torch.Tensor
    ] = {}  # tied weights (one storage) become one Parameter again
    for module in model.modules():
        for handle in module.__dict__.pop(_HANDLES, []):
            handle.remove()
        for e in module.__dict__.pop(_ENTRIES, []):
            if not restore:
                continue
            value = e.fetch().to(dtype=e.placeholder.dtype)
            key = (
                e.is_param,
                value.device,
                value.data_ptr(),
                value.dtype,
                tuple(value.shape),
                value.stride(),
            )
            if key not in restored:
                grad = e.placeholder.requires_grad and value.is_floating_point()
                restored[key] = nn.Parameter(value, requires_grad=grad) if e.is_param else value
            _set(module, e, restored[key])
    if not restore:  # the weights are gone with the hooks: so are the files the dispatch wrote for them
        cleanup = model.__dict__.pop(_FILES, None)
        if cleanup is not None:
            cleanup()

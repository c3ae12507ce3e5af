"""`infer_device_map`: place a model's modules on accelerators, then host memory, then disk, in one linear pass.

Sizes are computed bottom-up once; placement walks the modules in order, splitting a module that does not
fit into its children (unless its class is in `no_split`), so each module is looked at a bounded number of
times. Tied parameters are placed together with the first module that holds them.
"""

from __future__ import annotations

import collections
from collections.abc import Iterable, Mapping
from typing import Any, Literal

import attrs
import torch
from torch import nn

from .._typecheck import checked
from .memory import (
    DISK,
    HOST,
    as_dtype,
    default_max_memory,
    format_size,
    module_tensors,
    parse_max_memory,
    tensor_bytes,
)

__all__ = ["infer_device_map", "ModelLayout", "layout_of", "resolve_device"]

Strategy = Literal["auto", "sequential", "balanced"]


@attrs.define
class ModelLayout:
    """What placement needs to know about a model, computed in one pass over `named_modules()`.

    `size[name]` counts each tensor once, in the first module (in module order) that holds it; `ties` lists
    the names of each tensor held under several names, first holder first.
    """

    order: list[str]
    """Module names in pre-order (`""` is the root)."""
    classes: dict[str, str]
    children: dict[str, list[str]]
    own: dict[str, list[tuple[str, int]]]
    """A module's own tensors that it holds first: (full tensor name, bytes)."""
    size: dict[str, int]
    largest_layer: dict[str, int]
    """The largest unsplittable piece inside each module (a `no_split` module, a leaf module or a tensor)."""
    ties: list[list[str]]


def layout_of(
    model: nn.Module, no_split: Iterable[str] = (), dtype: torch.dtype | None = None
) -> ModelLayout:
    """The `ModelLayout` of `model` (module sizes in bytes, cast to `dtype` where floating-point).

    Example:
        >>> import torch
        >>> layout_of(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))).size
        {'': 120, '0': 80, '1': 40}
    """
    no_split = set(no_split)
    order: list[str] = []
    classes: dict[str, str] = {}
    children: dict[str, list[str]] = {}
    own: dict[str, list[tuple[str, int]]] = {}
    first_name: dict[int, str] = {}
    ties: dict[int, list[str]] = {}
    for name, module in model.named_modules():
        order.append(name)
        classes[name] = type(module).__name__
        children[name] = []
        if name:
            children[name.rpartition(".")[0]].append(name)
        mine = []
        for local, t in module_tensors(module):
            full = f"{name}.{local}" if name else local
            key = id(t)
            if key in first_name:
                ties.setdefault(key, [first_name[key]]).append(full)
                continue
            first_name[key] = full
            mine.append((full, tensor_bytes(t, dtype)))
        own[name] = mine
    size: dict[str, int] = {}
    largest: dict[str, int] = {}
    for name in reversed(order):
        kids = children[name]
        own_bytes = [b for _, b in own[name]]
        size[name] = sum(own_bytes) + sum(size[k] for k in kids)
        if not kids or classes[name] in no_split:
            largest[name] = size[name]
        else:
            largest[name] = max([*own_bytes, *(largest[k] for k in kids)])
    size = {n: size[n] for n in order}
    return ModelLayout(order, classes, children, own, size, largest, list(ties.values()))


def _owner(tensor_name: str) -> str:
    return tensor_name.rpartition(".")[0]


def _inside(name: str, unit: str) -> bool:
    return unit == "" or name == unit or name.startswith(unit + ".")


def resolve_device(device_map: Mapping[str, Any], name: str) -> Any:
    """The device `device_map` gives to module or tensor `name`: that of its longest mapped prefix.

    Example:
        >>> resolve_device({"": "cpu", "h.1": "disk"}, "h.1.attn.weight")
        'disk'
    """
    probe = name
    while True:
        if probe in device_map:
            return device_map[probe]
        if not probe:
            raise ValueError(
                f"the device map places neither {name!r} nor a module containing it; add an entry for it (or for '')"
            )
        probe = probe.rpartition(".")[0]


def _place(
    layout: ModelLayout, budgets: dict[str, int], no_split: set[str], reserve: int, exec_device: str
) -> tuple[dict[str, str], int]:
    """Greedy sequential placement; returns the map and the largest layer it left off the execution device's tier."""
    devices = list(budgets)
    used = dict.fromkeys(devices, 0)
    tensor_size = {n: b for name in layout.order for n, b in layout.own[name]}
    # unit: (name, is_module)
    units = collections.deque([("", True)])
    placed: set[str] = set()
    device_map: dict[str, str] = {}
    offloaded_layer = 0
    offload_from = devices.index(HOST) if exec_device != HOST and HOST in devices else devices.index(DISK)
    i = 0
    while units:
        name, is_module = units.popleft()
        if name in placed:
            continue
        size = layout.size[name] if is_module else tensor_size[name]
        partners = [
            _owner(n)
            for group in layout.ties
            if _inside(group[0], name) and (is_module or group[0] == name)
            for n in group[1:]
            if not _inside(n, name) and _owner(n) not in placed
        ]
        need = size + sum(layout.size[p] for p in partners)
        while True:
            if i == len(devices):
                room = (
                    f" (keeping {format_size(reserve)} on {exec_device} to run offloaded layers)"
                    if reserve
                    else ""
                )
                left = ", ".join(
                    f"{d}: {format_size(max(budgets[d] - used[d], 0))} of {format_size(budgets[d])}"
                    for d in devices
                )
                raise ValueError(
                    f"infer_device_map: {name or 'the model'!r} ({format_size(need)}) fits in none of max_memory's "
                    f"devices after the modules before it{room}; left: {left}. Give more memory, or allow "
                    "offloading to 'disk' (leave 'disk' out of max_memory for no limit)"
                )
            device = devices[i]
            cap = budgets[device] - (reserve if device == exec_device else 0)
            if used[device] + need <= cap:
                used[device] += need
                for n in (name, *partners):
                    device_map[n] = device
                    placed.add(n)
                if i >= offload_from:
                    layer = layout.largest_layer[name] if is_module else size
                    offloaded_layer = max(
                        offloaded_layer, layer, *(layout.largest_layer[p] for p in partners)
                    )
                break
            kids = layout.children[name] if is_module else []
            if kids and layout.classes[name] not in no_split:
                split = [(n, False) for n, _ in layout.own[name]] + [(c, True) for c in kids]
                units.extendleft(reversed(split))
                break
            i += 1
    return device_map, offloaded_layer


@checked
def infer_device_map(
    model: nn.Module,
    max_memory: Mapping[Any, int | str] | None = None,
    no_split: str | Iterable[str] | None = None,
    dtype: torch.dtype | str | None = None,
    strategy: Strategy = "auto",
) -> dict[str, str]:
    """`{module name: device}` that fits `model` in `max_memory`: the accelerators in order, then `"cpu"`, then
    `"disk"`.

    `max_memory` maps devices (`"cuda:0"`, `0` for the platform's accelerator 0, `"cpu"`, `"disk"`) to sizes
    (bytes, or strings such as `"10GiB"` / `"10GB"`); its keys are the devices to use, so a plan for another
    machine can be made here. Default: 90% of what the platform's devices and the host have free; disk is
    unlimited unless given (`"disk": 0` never offloads to disk; a model that fits nowhere raises). Modules whose
    class name is in `no_split` (default: the model's `_no_split_modules`, as in transformers) stay whole; tied
    parameters go to one device; the execution device (the first accelerator, else `"cpu"`) keeps room for the
    largest layer placed after it, which is brought there to run. `dtype`: size floating-point weights as this
    dtype (a `torch.dtype` or its name, `"bfloat16"`). `strategy`: `"auto"`/`"sequential"` fill devices in order; `"balanced"` spreads the model evenly over
    the accelerators.

    Example:
        >>> import torch, accelfn as af
        >>> with af.init_empty():
        ...     model = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(4)])  # 257 KiB per layer
        >>> af.infer_device_map(model, max_memory={"cuda:0": "800KiB", "cpu": "300KiB"})
        {'0': 'cuda:0', '1': 'cuda:0', '2': 'cpu', '3': 'disk'}
    """
    dtype = as_dtype(dtype)
    if no_split is None:
        no_split = getattr(model, "_no_split_modules", None) or ()
    no_split = (
        {no_split} if isinstance(no_split, str) else set(no_split)
    )  # one class name, as Accelerate takes it
    classes = {type(m).__name__ for m in model.modules()}
    if (
        no_split
        and not no_split & classes
        and no_split != set(getattr(model, "_no_split_modules", None) or ())
    ):
        raise ValueError(  # a typo would let every block be split silently
            f"infer_device_map: no_split={sorted(no_split)} names no class of this model's modules (its classes: "
            f"{', '.join(sorted(classes)[:12])}{', ...' if len(classes) > 12 else ''})"
        )
    budgets = parse_max_memory(max_memory) if max_memory is not None else default_max_memory()
    budgets.setdefault(DISK, 2**62)
    layout = layout_of(model, no_split, dtype)
    accelerators = [d for d in budgets if d not in (HOST, DISK)]
    exec_device = accelerators[0] if accelerators else HOST
    if exec_device not in budgets:
        exec_device = DISK
    if strategy == "balanced" and len(accelerators) > 1:
        per_device = -(-layout.size[""] // len(accelerators)) + layout.largest_layer[""]
        for d in accelerators[:-1]:
            budgets[d] = min(budgets[d], per_device)
    reserve = 0
    for _ in range(8):
        device_map, needed = _place(layout, budgets, no_split, reserve, exec_device)
        if needed <= reserve:
            return device_map
        reserve = needed
    return _place(layout, budgets, no_split, layout.largest_layer[""], exec_device)[0]

"""`load_and_dispatch`, `dispatch`, `cpu_offload`: put a model's weights where a device map says and run it.

Weights on an accelerator (or on `"cpu"` when no accelerator is in the map) are ordinary tensors there.
Weights on `"cpu"` while an accelerator runs the model, and weights on `"disk"`, are offloaded: the module
holds meta tensors, and hooks bring the weights to the execution device just before it runs and drop them
after. Disk weights are memory-mapped safetensors (the checkpoint's own file when its dtype matches).
"""

from __future__ import annotations

import contextlib
import functools
import os
import uuid
import warnings
import weakref
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import attrs
import safetensors.torch
import torch
from torch import nn

from .. import platforms
from .._typecheck import checked
from .device_map import Strategy, infer_device_map, resolve_device
from .files import Checkpoint, SafetensorsFile
from .hooks import _FILES, Offloaded, attach_input_alignment, attach_offload
from .memory import DISK, HOST, as_dtype, module_tensors

__all__ = ["load_and_dispatch", "dispatch", "cpu_offload", "MissingWeightsError"]


class MissingWeightsError(KeyError):
    """A checkpoint lacks tensors the model needs."""

    def __str__(self) -> str:
        return str(self.args[0])


@attrs.define
class _Tensor:
    """One tensor of the model under all the names it has (tied weights have several)."""

    names: list[str]
    holders: list[tuple[nn.Module, str, bool]]
    current: torch.Tensor
    persistent: bool


def _tensors(model: nn.Module) -> list[_Tensor]:
    groups: dict[int, _Tensor] = {}
    for name, module in model.named_modules():
        for local, t in module_tensors(module):
            full = f"{name}.{local}" if name else local
            is_param = local in module._parameters
            persistent = is_param or local not in module._non_persistent_buffers_set
            g = groups.get(id(t))
            if g is None:
                groups[id(t)] = g = _Tensor([], [], t, persistent)
            g.names.append(full)
            g.holders.append((module, local, is_param))
    return list(groups.values())


def _device_name(value: Any, where: str) -> str:
    platform = platforms.detect()
    known = [HOST, DISK] + (
        []
        if platform.device_type == HOST
        else [str(platform.device(i)) for i in range(platform.device_count())]
    )
    if isinstance(value, int) and not isinstance(value, bool):
        if platform.device_type == HOST or not 0 <= value < platform.device_count():
            raise ValueError(
                f"{where} = {value!r} is not a device of this process; the devices are: {', '.join(known)}"
            )
        value = str(platform.device(value))
    if isinstance(value, torch.device):
        value = str(value)
    if value in (HOST, DISK):
        return str(value)
    try:
        device = torch.device(value)
    except (RuntimeError, TypeError):
        device = None
    if device is not None and device.type == HOST:
        return HOST
    if device is not None and device.type == platform.device_type and device.type != HOST:
        index = device.index or 0
        if index < platform.device_count():
            return str(platform.device(index))
    raise ValueError(
        f"{where} = {value!r} is not a device of this process; the devices are: {', '.join(known)}"
    )


def _check_map(model: nn.Module, device_map: Mapping[Any, Any]) -> dict[str, str]:
    names = {n for n, _ in model.named_modules()}
    names |= {n for n, _ in model.named_parameters(remove_duplicate=False)}
    names |= {n for n, _ in model.named_buffers(remove_duplicate=False)}
    out: dict[str, str] = {}
    for key, value in device_map.items():
        if key not in names:
            raise ValueError(
                f"device_map names {key!r}, which is no module, parameter or buffer of the model"
            )
        out[key] = _device_name(value, f"device_map[{key!r}]")
    return out


def _execution_device(device_map: Mapping[str, str]) -> str:
    return next((d for d in device_map.values() if d not in (HOST, DISK)), HOST)


def _const(t: torch.Tensor) -> Callable[[], torch.Tensor]:
    return lambda: t


def _target_dtype(t: torch.Tensor, dtype: torch.dtype | None) -> torch.dtype:
    return dtype if dtype is not None and t.is_floating_point() else t.dtype


def _placeholder(t: torch.Tensor, dtype: torch.dtype, is_param: bool) -> torch.Tensor:
    meta = torch.empty(t.shape, dtype=dtype, device="meta")
    return nn.Parameter(meta, requires_grad=False) if is_param else meta


class _Placer:
    """Puts each model tensor where the map says; collects the offloaded ones per module for the hooks."""

    def __init__(
        self, device_map: dict[str, str], exec_device: str, offload_folder: str | os.PathLike[str] | None
    ):
        self.device_map = device_map
        self.exec_device = exec_device
        self.offload_folder = offload_folder
        self.token = uuid.uuid4().hex[:12]
        self.files: list[Path] = []  # written to offload_folder by this dispatch: deleted with the model
        self.offloaded: dict[int, tuple[nn.Module, list[Offloaded]]] = {}
        self.pending: dict[str, tuple[_Tensor, torch.dtype, torch.Tensor]] = {}
        self.pending_ids: set[int] = set()
        self.written = 0

    def tier(self, name: str) -> str:
        device = resolve_device(self.device_map, name)
        if device == HOST and self.exec_device != HOST:
            return "host"
        return "disk" if device == DISK else "device"

    def place(
        self,
        g: _Tensor,
        value: Callable[[], torch.Tensor],
        dtype: torch.dtype,
        mapped: tuple[SafetensorsFile, str] | None,
    ) -> None:
        """`value()`: the tensor's data (any device); `mapped`: a file holding it already in `dtype`."""
        host: torch.Tensor | None = None
        on_device: dict[str, torch.Tensor] = {}
        for name, (module, local, is_param) in zip(g.names, g.holders):
            tier = self.tier(name) if is_param else "device"  # buffers are small: kept where the module runs
            if tier == "device":
                device = resolve_device(self.device_map, name)
                device = self.exec_device if device in (HOST, DISK) else device
                if device not in on_device:
                    t = value().to(device=device, dtype=dtype, copy=True)
                    on_device[device] = nn.Parameter(t, requires_grad=False) if is_param else t
                setattr_tensor(module, local, is_param, on_device[device])
                continue
            if tier == "host":
                if host is None:
                    host = value().to(device=HOST, dtype=dtype, copy=True)
                source = host
                self._offload(module, local, is_param, g.current, dtype, _const(source), None)
            elif mapped is not None:
                f, key = mapped
                self._offload(module, local, is_param, g.current, dtype, functools.partial(f.get, key),
                              functools.partial(f.release, key))  # fmt: skip
            elif id(g) not in self.pending_ids:  # flush() attaches every disk name of g
                self.pending_ids.add(id(g))
                self.pending[name] = (g, dtype, value().to(device=HOST, dtype=dtype, copy=True))

    def _offload(self, module: nn.Module, local: str, is_param: bool, current: torch.Tensor, dtype: torch.dtype,
                 fetch: Callable[[], torch.Tensor], release: Callable[[], None] | None) -> None:  # fmt: skip
        entry = Offloaded(local, is_param, _placeholder(current, dtype, is_param), fetch, release)
        self.offloaded.setdefault(id(module), (module, []))[1].append(entry)

    def flush(self) -> None:
        """Write the disk tensors that need a file of their own to `offload_folder`, and map them."""
        if not self.pending:
            return
        first = next(iter(self.pending))
        if self.offload_folder is None:
            raise ValueError(
                f"the device map puts {first!r} on disk, but it has no safetensors file in its dtype to read from; "
                "pass offload_folder= (a folder where accelfn may write offloaded weights)"
            )
        folder = Path(self.offload_folder)
        folder.mkdir(parents=True, exist_ok=True)
        # a name of this dispatch's own: another model offloaded to the same folder must not replace these files
        # (its weights would silently be read in place of these ones)
        path = folder / f"offload-{self.token}-{self.written:05d}.safetensors"
        self.written += 1
        safetensors.torch.save_file({n: t.contiguous() for n, (_, _, t) in self.pending.items()}, str(path))
        self.files.append(path)
        f = SafetensorsFile(path)
        for name, (g, dtype, _) in self.pending.items():
            for n, (module, local, is_param) in zip(g.names, g.holders):
                if is_param and self.tier(n) == "disk":
                    self._offload(module, local, is_param, g.current, dtype, functools.partial(f.get, name),
                                  functools.partial(f.release, name))  # fmt: skip
        self.pending, self.pending_ids = {}, set()

    def finish(self, model: nn.Module) -> None:
        self.flush()
        model.__dict__["hf_device_map"] = dict(
            self.device_map
        )  # where each part went (Accelerate's attribute)
        if self.files:  # deleted when the model is (or at exit), or by remove_hooks(restore=False)
            model.__dict__[_FILES] = weakref.finalize(model, _delete_files, list(self.files))
        device = torch.device(self.exec_device)
        for module, entries in self.offloaded.values():
            attach_offload(module, entries, device)
        devices = {self.exec_device if d in (HOST, DISK) else d for d in self.device_map.values()}
        if len(devices) > 1:
            modules = {n for n, _ in model.named_modules()}
            for name, d in self.device_map.items():
                if name and name in modules:
                    target = self.exec_device if d in (HOST, DISK) else d
                    attach_input_alignment(model.get_submodule(name), torch.device(target))
            attach_input_alignment(model, torch.device(self.exec_device), outputs_back=True)


def _warn_unused(checkpoint: Any, ckpt: Checkpoint, model: nn.Module, names: set[str]) -> None:
    """Warn about checkpoint tensors no tensor of `model` takes (another configuration's checkpoint?), as
    transformers does, except those the model says to ignore (`_keys_to_ignore_on_load_unexpected`)."""
    import re

    ignore = [re.compile(p) for p in getattr(model, "_keys_to_ignore_on_load_unexpected", None) or []]
    unused = [k for k in ckpt.file_of if k not in names and not any(p.search(k) for p in ignore)]
    if unused:
        more = f" and {len(unused) - 3} more" if len(unused) > 3 else ""
        warnings.warn(
            f"checkpoint '{checkpoint}' has {len(unused)} tensors the model has no place for: "
            f"{', '.join(map(repr, unused[:3]))}{more} (were they saved from another configuration?)",
            UserWarning,
            stacklevel=4,  # the caller of load_and_dispatch (under its type-check wrapper)
        )


def _delete_files(paths: list[Path]) -> None:
    """Delete a dispatch's offload files (a file still mapped stays readable until unmapped, on POSIX)."""
    for path in paths:
        with contextlib.suppress(OSError):  # e.g. Windows, while mapped: left for the user
            path.unlink(missing_ok=True)


def setattr_tensor(module: nn.Module, local: str, is_param: bool, value: torch.Tensor) -> None:
    if is_param:
        module._parameters[local] = value if isinstance(value, nn.Parameter) else nn.Parameter(value, False)
    else:
        module._buffers[local] = value


def _resolve_map(
    model: nn.Module,
    device_map: Mapping[Any, Any] | str,
    max_memory: Mapping[Any, int | str] | None,
    no_split: str | list[str] | None,
    dtype: torch.dtype | None,
) -> dict[str, str]:
    if isinstance(device_map, str):
        strategies: tuple[Strategy, ...] = ("auto", "sequential", "balanced")
        if device_map not in strategies:
            raise ValueError(f"device_map={device_map!r}: expected a dict or one of {', '.join(strategies)}")
        return infer_device_map(model, max_memory, no_split, dtype, device_map)  # type: ignore[arg-type]
    return _check_map(model, device_map)


@checked
def load_and_dispatch(
    model: nn.Module,
    checkpoint: str | os.PathLike[str],
    device_map: Mapping[Any, Any] | str = "auto",
    *,
    max_memory: Mapping[Any, int | str] | None = None,
    no_split: str | list[str] | None = None,
    dtype: torch.dtype | str | None = None,
    offload_folder: str | os.PathLike[str] | None = None,
) -> nn.Module:
    """Fill `model` (usually built under `af.init_empty()`) from a safetensors checkpoint and place it.

    `checkpoint`: a `.safetensors` file, a folder with shards and `model.safetensors.index.json`, or one with
    `model.safetensors` (an `af.checkpoint` folder too). Files are memory-mapped and read shard by shard, so
    host memory holds what is placed on `"cpu"` plus one tensor at a time. `device_map`: a dict
    `{module or tensor name: device}` or a strategy of `af.infer_device_map` (`"auto"`, `"balanced"`,
    `"sequential"`, with `max_memory`, `no_split` and `dtype`). `dtype` (a `torch.dtype` or its name, `"bfloat16"`)
    casts floating-point weights.
    Disk weights are read from the checkpoint when their dtype matches, else written to `offload_folder`.
    Returns `model`, ready for inference.

    Example:
        >>> import tempfile, torch, safetensors.torch, accelfn as af
        >>> path = tempfile.mkdtemp() + "/model.safetensors"
        >>> safetensors.torch.save_file(torch.nn.Linear(4, 2).state_dict(), path)
        >>> with af.init_empty():
        ...     model = torch.nn.Linear(4, 2)
        >>> model = af.load_and_dispatch(model, path, {"": "disk"})
        >>> model(torch.ones(1, 4)).shape, model.weight.device
        (torch.Size([1, 2]), device(type='meta'))
    """
    dtype = as_dtype(dtype)
    if isinstance(device_map, str) and max_memory is not None:  # a plan to run here: its devices must exist
        for key in max_memory:
            _device_name(key, f"max_memory[{key!r}]")
    ckpt = Checkpoint(checkpoint)
    tensors = _tensors(model)
    keys: dict[int, str] = {}
    missing = []
    for i, g in enumerate(tensors):
        key = next((n for n in g.names if n in ckpt), None)
        if key is not None:
            keys[i] = key
            shape = tuple(ckpt.file(key)._entries[key]["shape"])
            if shape != tuple(g.current.shape):
                raise ValueError(
                    f"checkpoint '{checkpoint}': {key!r} has shape {shape} but the model expects {tuple(g.current.shape)}"
                )
        elif g.current.is_meta or g.holders[0][2]:
            missing.append(g.names[0])
    if missing:
        sample = ", ".join(list(ckpt.file_of)[:3])
        raise MissingWeightsError(
            f"checkpoint '{checkpoint}' has no tensor {missing[0]!r}"
            + (f" (nor {len(missing) - 1} more: {', '.join(map(repr, missing[1:6]))}{', ...' if len(missing) > 6 else ''})" if len(missing) > 1 else "")
            + f"; its keys look like: {sample}"
        )  # fmt: skip
    _warn_unused(checkpoint, ckpt, model, {n for g in tensors for n in g.names})
    resolved = _resolve_map(model, device_map, max_memory, no_split, dtype)
    placer = _Placer(resolved, _execution_device(resolved), offload_folder)
    by_file: dict[str, list[int]] = {}
    for i, key in keys.items():
        by_file.setdefault(ckpt.file_of[key], []).append(i)
    for file_name, indices in by_file.items():
        f = ckpt.files[file_name]
        for i in indices:
            g, key = tensors[i], keys[i]
            target = _target_dtype(g.current, dtype)
            mapped = (f, key) if f.dtype(key) == target else None
            placer.place(g, functools.partial(f.get, key), target, mapped)
            f.release(key)
        placer.flush()
    for i, g in enumerate(tensors):
        if i not in keys:  # real buffers the checkpoint does not have: keep the model's values
            placer.place(g, _const(g.current), g.current.dtype, None)
    placer.finish(model)
    return model


@checked
def dispatch(
    model: nn.Module, device_map: Mapping[Any, Any], *, offload_folder: str | os.PathLike[str] | None = None
) -> nn.Module:
    """Place an already loaded `model` as `device_map` says (see `load_and_dispatch`); returns `model`.

    Example:
        >>> import tempfile, torch, accelfn as af
        >>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
        >>> x = torch.ones(1, 4); expected = model(x)
        >>> model = af.dispatch(model, {"0": "cpu", "1": "disk"}, offload_folder=tempfile.mkdtemp())
        >>> torch.equal(model(x), expected), model[1].weight.is_meta
        (True, True)
    """
    resolved = _check_map(model, device_map)
    placer = _Placer(resolved, _execution_device(resolved), offload_folder)
    for g in _tensors(model):
        placer.place(g, _const(g.current), g.current.dtype, None)
    placer.finish(model)
    return model


@checked
def cpu_offload(model: nn.Module, execution_device: str | torch.device | None = None) -> nn.Module:
    """Keep `model`'s weights in host memory and bring each layer's to `execution_device` (default: the
    platform's device 0) only while it runs. Returns `model`.

    Example:
        >>> import torch, accelfn as af
        >>> model = torch.nn.Linear(4, 2); expected = model(torch.ones(1, 4))
        >>> torch.equal(af.cpu_offload(model)(torch.ones(1, 4)), expected)
        True
    """
    device = str(platforms.detect().device(0)) if execution_device is None else str(execution_device)
    device = _device_name(device, "execution_device")
    placer = _Placer({"": HOST}, device, None)
    for g in _tensors(model):
        placer.place(g, _const(g.current), g.current.dtype, None)
    placer.finish(model)
    return model

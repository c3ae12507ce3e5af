"""`init_empty` / `init_on_device`: build a model skeleton whose parameters take no memory (meta device)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from .._typecheck import checked

__all__ = ["init_empty", "init_on_device"]


@contextlib.contextmanager
def init_on_device(device: str | torch.device, include_buffers: bool = False) -> Iterator[None]:
    """Inside the context, every parameter a module registers is moved to `device` as it is registered
    (and every buffer too with `include_buffers=True`); other tensors are created as usual.

    Example:
        >>> import torch, accelfn as af
        >>> with af.init_on_device("meta"):
        ...     layer = torch.nn.Linear(4096, 4096)
        >>> layer.weight.device
        device(type='meta')
    """
    device = torch.device(device)
    register_parameter = nn.Module.register_parameter
    register_buffer = nn.Module.register_buffer

    def on_device_parameter(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        register_parameter(module, name, param)
        if param is not None and param.device != device:
            p = module._parameters[name]
            assert p is not None
            attrs: dict[str, Any] = dict(p.__dict__)
            if (
                getattr(p, "fake_mode", None) is not None
            ):  # a fake tensor (a dry run): its __dict__ is its own
                module._parameters[name] = nn.Parameter(p.to(device), requires_grad=p.requires_grad)
                return
            try:  # subclasses that take their attributes in the constructor (e.g. bitsandbytes' Params4bit)
                moved = type(p)(p.to(device), requires_grad=p.requires_grad, **attrs)
            except TypeError:
                if not attrs:
                    raise
                # a plain nn.Parameter with Python attributes set on it (p.no_weight_decay = True): its
                # constructor takes no such keywords, so the attributes are set afterwards
                moved = type(p)(p.to(device), requires_grad=p.requires_grad)
                moved.__dict__.update(attrs)
            module._parameters[name] = moved

    def on_device_buffer(
        module: nn.Module, name: str, tensor: torch.Tensor | None, persistent: bool = True
    ) -> None:
        register_buffer(module, name, tensor, persistent=persistent)
        if tensor is not None:
            module._buffers[name] = tensor.to(device)

    nn.Module.register_parameter = on_device_parameter  # type: ignore[method-assign,assignment]
    if include_buffers:
        nn.Module.register_buffer = on_device_buffer  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        nn.Module.register_parameter = register_parameter  # type: ignore[method-assign,assignment]
        nn.Module.register_buffer = register_buffer  # type: ignore[method-assign,assignment]


@checked
def init_empty(include_buffers: bool = False) -> contextlib.AbstractContextManager[None]:
    """A context in which modules are built with parameters on the meta device: shapes and dtypes, no memory.

    Buffers stay real unless `include_buffers=True` (so computed buffers, like rotary frequencies, survive).
    Fill the skeleton with `af.load_and_dispatch`.

    Example:
        >>> import torch, accelfn as af
        >>> with af.init_empty():
        ...     model = torch.nn.Sequential(*[torch.nn.Linear(8192, 8192) for _ in range(100)])  # 27 GB
        >>> sum(p.numel() for p in model.parameters()), model[0].weight.is_meta
        (6711705600, True)
    """
    return init_on_device("meta", include_buffers=include_buffers)

"""Helpers shared by the optimizers: leaf lists, masks, device/dtype groups, fused-kernel fallback."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.utils import _python_dispatch

from .. import dry_mode
from .. import tree as _tree

MaskLike = Any  # a pytree of bools matching params, or a callable params -> such a pytree

_NO_FUSED: set[tuple[str, str]] = set()  # (kernel, device type) pairs whose fused kernel is unavailable


def mask_leaves(mask: MaskLike, params: Any, who: str) -> list[bool]:
    """The mask as a list of bools aligned with `leaves(params)`; a clear error when it does not match."""
    m = mask(params) if callable(mask) else mask
    p_leaves, p_spec = _tree.flatten(params)
    try:
        m_leaves = _tree.leaves(_tree.map(lambda _p, b: bool(b), params, m))
    except (ValueError, TypeError) as e:
        raise ValueError(
            f"{who}: mask structure does not match params: mask={_tree.structure(m)}, params={p_spec} ({e}). "
            "The optimizer sees the trainable params only (requires_grad=True): build the mask from those, or "
            "pass a callable params -> mask"
        ) from None
    assert len(m_leaves) == len(p_leaves)
    return m_leaves


def groups(tensors: Sequence[torch.Tensor], idx: Sequence[int] | None = None) -> list[list[int]]:
    """Indices of `tensors` grouped by (device, dtype), as multi-tensor kernels need."""
    out: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    for i in range(len(tensors)) if idx is None else idx:
        t = tensors[i]
        out.setdefault((t.device, t.dtype), []).append(i)
    return list(out.values())


def pick(xs: Sequence[Any], idx: Sequence[int]) -> list[Any]:
    return [xs[i] for i in idx]


Traffic = Callable[[], Sequence[tuple[Sequence[torch.Tensor], Sequence[torch.Tensor]]]]


def try_fused(kernel: str, device: torch.device, fn: Callable[[], None], traffic: Traffic) -> bool:
    """Run a fused kernel call; on a device without it, remember that and return False (caller falls back).

    `traffic()` lists, per launch (one per tensor group, as torch's fused multi-tensor kernels launch), the tensors
    it only reads and those it reads and writes in place. A dry run does not run the kernel (torch has no fake
    version of the fused optimizer kernels: it would run them on real zeros of every input) but times each
    launch from those bytes (`accelfn.dryrun.timing.in_place_kernel`); in place, they allocate nothing.
    """
    key = (kernel, device.type)
    if key in _NO_FUSED:
        return False
    if dry_mode.active() is not None:
        from ..dryrun.timing import in_place_kernel

        for read, written in traffic():
            in_place_kernel(read, written)
        dry_mode.note(
            f"fused optimizer kernel {kernel} not run: timed as a memory-bound kernel per tensor group"
        )
        return True
    try:
        fn()
        return True
    except (RuntimeError, NotImplementedError) as e:
        msg = str(e)
        if "not implemented" in msg.lower() or "NotImplemented" in type(e).__name__ or "supported" in msg:
            # remembered for the device only when no dispatch mode (LocalTensorMode, ...) stood in the way: a mode
            # that lacks the kernel says nothing of the device, and must not turn it off for the whole process
            if _python_dispatch._get_current_dispatch_mode() is None:
                _NO_FUSED.add(key)
            return False
        raise


def zeros_like_tree(params: Any) -> Any:
    return _tree.map(lambda p: torch.zeros_like(p, memory_format=torch.preserve_format), params)

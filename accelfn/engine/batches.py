"""What a step computes on: a batch checked, placed on the model's device, split into micro-batches, and a
loss function's return value taken apart (`Loss(total, count)`, a scalar, or `(loss, aux)`)."""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from typing import Any

import optree
import torch

from .. import platforms
from .. import tree as _tree
from ..losses import Loss

__all__ = ["check_batch", "plain_batch", "place_batch", "split_batch", "loss_parts", "rows", "where"]


def where(path: Sequence[Any], root: str = "batch") -> str:
    """The text of a pytree path for messages: `batch['input_ids']`, `batch[0]`."""
    return root + "".join(f"[{p!r}]" for p in path)


def rows(batch: Any) -> int:
    """The number of rows (dim 0) of the batch's first tensor (1 for a batch of 0-d tensors)."""
    leaves = _tree.leaves(batch)
    return int(leaves[0].shape[0]) if leaves and leaves[0].dim() > 0 else 1


def split_batch(batch: Any, parts: int, uneven: bool = False) -> list[Any]:
    """Split every tensor leaf of `batch` along dim 0 into `parts` micro-batches."""
    paths, leaves, spec = optree.tree_flatten_with_path(batch, namespace=_tree.NAMESPACE)
    if not leaves:
        raise ValueError("cannot split an empty batch into micro-batches")
    seen = None
    for path, leaf in zip(paths, leaves):
        at = where(path)
        n = leaf.shape[0] if leaf.dim() > 0 else None
        if n is None:
            raise ValueError(
                f"accumulate({parts}): {at} is a 0-d tensor; every leaf needs a batch dimension 0"
            )
        if seen is not None and n != seen:
            raise ValueError(
                f"accumulate({parts}): {at} has {n} rows along dim 0 but other leaves have {seen}"
            )
        seen = n
        if n % parts and not uneven:
            raise ValueError(
                f"accumulate({parts}): {at} has {n} rows along dim 0, not divisible by {parts} micro-batches "
                f"(use a batch size divisible by {parts}, or accumulate(..., uneven=True); a DataLoader with "
                "last_batch='short' ends each epoch with a smaller batch)"
            )
        if n < parts and not uneven:  # uneven: empty micro-batches (a short last batch's rank with few rows)
            raise ValueError(f"accumulate({parts}): {at} has only {n} rows, fewer than {parts} micro-batches")
    chunks = [torch.tensor_split(leaf, parts, dim=0) for leaf in leaves]
    return [optree.tree_unflatten(spec, [c[i] for c in chunks]) for i in range(parts)]


def place_batch(batch: Any, device: torch.device | None) -> Any:
    """Move the host tensors of `batch` to `device` (asynchronously: from pinned memory the copy overlaps);
    tensors already there stay. A tensor on another accelerator device is an error naming its path, as `jax.jit`
    refuses arrays committed to another device: copying it silently would hide a wrong placement."""
    if device is None:
        return batch
    leaves, spec = optree.tree_flatten(batch, namespace=_tree.NAMESPACE)
    if all(isinstance(t, torch.Tensor) and t.device == device for t in leaves):
        return batch
    moved = []
    for i, t in enumerate(leaves):
        if not isinstance(t, torch.Tensor) or t.device == device:
            moved.append(t)
        elif platforms.is_host(t.device):
            moved.append(t.to(device, non_blocking=True))
        else:
            paths = optree.tree_paths(batch, namespace=_tree.NAMESPACE)
            raise ValueError(
                f"{where(paths[i])} is on {t.device}, but the model computes on {device}: pass host tensors (they are moved "
                f"to {device} for you, asynchronously when pinned) or tensors on {device}"
            )
    return optree.tree_unflatten(spec, moved)


def plain_batch(batch: Any) -> Any:
    """`batch` with every `Mapping` that is not a dict (Hugging Face's `BatchEncoding` from a data collator, a
    `UserDict`) turned into a plain dict, at any depth of dicts, lists and tuples, so that its tensors are
    pytree leaves. Returns `batch` itself when there is none (the common case costs no copy)."""
    if isinstance(batch, dict):
        items = {k: plain_batch(v) for k, v in batch.items()}
        if all(items[k] is v for k, v in batch.items()):
            return batch
        if type(batch) is dict:
            return items
        new = copy.copy(batch)  # OrderedDict, defaultdict: keep the type
        new.update(items)
        return new
    if isinstance(batch, Mapping):
        return {k: plain_batch(v) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        seq = [plain_batch(v) for v in batch]
        if all(a is b for a, b in zip(seq, batch)):
            return batch
        if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # a namedtuple
            return type(batch)(*seq)
        return type(batch)(seq)
    return batch


def check_batch(batch: Any) -> Any:
    """`batch` as the step computes on it (`plain_batch`: a `BatchEncoding` becomes a dict); raises a `TypeError`
    naming the first leaf that is not a tensor."""
    batch = plain_batch(batch)
    paths, leaves, _ = optree.tree_flatten_with_path(batch, namespace=_tree.NAMESPACE)
    for path, leaf in zip(paths, leaves):
        if not isinstance(leaf, torch.Tensor):
            if hasattr(leaf, "__array__"):
                hint = " (convert it with torch.as_tensor)"
            else:  # a str, an id, ...: a field the loss does not compute on
                hint = "; drop the non-tensor fields before the step" + (
                    " (e.g. {k: v for k, v in batch.items() if isinstance(v, torch.Tensor)})"
                    if isinstance(batch, Mapping)
                    else ""
                )
            raise TypeError(
                f"{where(path)} is a {type(leaf).__name__}: a batch must be a pytree (a dict or other Mapping, list, "
                f"tuple) whose leaves are torch.Tensor{hint}"
            )
    return batch


def loss_parts(out: Any) -> tuple[torch.Tensor, torch.Tensor | None, dict[str, Any]]:
    """Normalise what a loss function returned into `(total, count or None, aux)`."""
    aux: dict[str, Any] = {}
    if isinstance(out, tuple) and not isinstance(out, Loss) and len(out) == 2 and isinstance(out[1], dict):
        out, aux = out
        aux = {k: _metric(k, v) for k, v in aux.items()}
    if isinstance(out, Loss):
        total, count = out.total, out.count
        if not isinstance(total, torch.Tensor) or total.numel() != 1:
            raise ValueError(f"Loss.total must be a scalar tensor, got {_describe(total)}")
        count_t = count if isinstance(count, torch.Tensor) else torch.tensor(count, device=total.device)
        if count_t.numel() != 1:
            raise ValueError(
                f"Loss.count must be a scalar (the number of elements `total` sums over), got {_describe(count_t)}; "
                "sum it, e.g. af.Loss(total, (labels != -100).sum())"
            )
        # counts stay exact: at least fp32 (a bf16 count of 301 is 300; fp16 overflows past 65504)
        return total.reshape(()), count_t.reshape(()).to(torch.promote_types(total.dtype, torch.float32)), aux
    if isinstance(out, torch.Tensor):
        if out.numel() != 1:
            raise ValueError(
                f"loss_fn returned a tensor of shape {tuple(out.shape)}; expected a scalar (0-d) tensor, "
                "an af.Loss(total, count), or (loss, aux_dict) — reduce it, e.g. with .mean()"
            )
        if not out.is_floating_point():
            raise ValueError(f"loss_fn returned a {out.dtype} tensor; the loss must be floating point")
        return out.reshape(()), None, aux
    raise TypeError(
        f"loss_fn returned {_describe(out)}; expected a scalar tensor, an af.Loss(total, count), "
        "or (loss, aux_dict)"
    )


def _metric(key: str, value: Any) -> torch.Tensor:
    """An aux value as a 0-d tensor (metrics are averaged over micro-batches and ranks, so scalars only)."""
    if isinstance(value, bool | int | float):
        return torch.tensor(float(value))
    if not isinstance(value, torch.Tensor):
        raise TypeError(
            f"aux[{key!r}] is a {type(value).__name__}; aux values must be scalar tensors or numbers"
        )
    if value.numel() != 1:
        raise ValueError(
            f"aux[{key!r}] has shape {tuple(value.shape)}; aux values are metrics, averaged over micro-batches "
            "and ranks, so they must be scalars: reduce it (e.g. .mean()), or compute per-example outputs with "
            "an af.eval_step"
        )
    return value.reshape(())


def _describe(x: Any) -> str:
    if isinstance(x, torch.Tensor):
        return f"a tensor of shape {tuple(x.shape)}"
    return f"a {type(x).__name__}"

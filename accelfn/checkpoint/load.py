"""`load(path, like=state)`: read a checkpoint back into the structure and placement of `like`.

`like` is donated: its tensors receive the loaded values in place (so a module bound to them, FSDP2's
included, sees them), except meta tensors, which are replaced by new CPU tensors. Each rank reads the
pieces that overlap its part of every tensor, so a checkpoint saved on any number of ranks loads on any
other (plain tensors, or DTensors sharded like `like`'s).

Example:
    >>> import tempfile, torch, accelfn as af
    >>> step = af.train_step(lambda m, b: af.losses.mse(m(b["x"]), b["y"]), af.optim.adamw(1e-3))
    >>> state = step.init(torch.nn.Linear(3, 1), seed=1)
    >>> path = tempfile.mkdtemp() + "/ckpt"
    >>> _ = af.checkpoint.save(path, state)
    >>> fresh = step.init(torch.nn.Linear(3, 1), seed=2)
    >>> loaded = af.checkpoint.load(path, like=fresh)
    >>> torch.equal(loaded.params["weight"], state.params["weight"]), torch.equal(loaded.rng, state.rng)
    (True, True)
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from .. import platforms
from .. import tree as _tree
from .._typecheck import checked
from ..stages import holds_stage_params
from ..state import TrainState, mark_donated
from . import adapters, io
from ._dist import Comm, is_dtensor, region
from .format import CheckpointError, CheckpointMismatchError, CorruptCheckpointError, read_state_json
from .leaves import alias_key, describe, dtype_name, dtype_of, flatten

__all__ = ["load", "Target", "check_leaf", "copy_overlap"]


class Target:
    """Where one leaf's values go: this rank's local tensor, its global offset, and what has been filled."""

    def __init__(self, path: str, like: torch.Tensor, fresh: bool) -> None:
        self.path = path
        local = like.to_local() if is_dtensor(like) else like  # type: ignore[attr-defined]
        if fresh:
            device = "cpu" if local.device.type == "meta" else local.device
            local = torch.empty(local.shape, dtype=local.dtype, device=device)
            if is_dtensor(like):
                from torch.distributed.tensor import DTensor

                dt: Any = like
                self.value: torch.Tensor = DTensor.from_local(
                    local,
                    dt.device_mesh,
                    dt.placements,
                    run_check=False,
                    shape=like.shape,
                    stride=like.stride(),  # type: ignore[attr-defined]
                )
            else:
                self.value = local
        else:
            self.value = like
        self.local = local
        self.offset, _ = region(like)
        self.filled = 0

    def direct(self, piece: dict[str, Any]) -> bool:
        """Whether a stored piece is exactly this rank's local tensor, so it can be read straight into it."""
        return (
            piece["offset"] == list(self.offset)
            and piece["shape"] == list(self.local.shape)
            and platforms.is_host(self.local.device)
            and self.local.is_contiguous()
        )

    def fill(self, src: torch.Tensor, src_offset: list[int]) -> None:
        if src is self.local:  # read in place
            self.filled += src.numel()
            return
        self.filled += copy_overlap(self.local, self.offset, src, src_offset)

    def check_complete(self, folder: Path) -> None:
        if self.filled != self.local.numel():
            raise CorruptCheckpointError(
                f"checkpoint '{folder}' holds {self.filled} of the {self.local.numel()} values of {self.path!r} "
                "this rank needs: a file is missing from the checkpoint"
            )


def copy_overlap(dst: torch.Tensor, dst_offset: list[int], src: torch.Tensor, src_offset: list[int]) -> int:
    """Copy the overlap of two boxes of the same global tensor (given by offsets); returns values copied."""
    dst_idx, src_idx = [], []
    for d in range(dst.ndim):
        lo = max(dst_offset[d], src_offset[d])
        hi = min(dst_offset[d] + dst.shape[d], src_offset[d] + src.shape[d])
        if hi <= lo:
            return 0
        dst_idx.append(slice(lo - dst_offset[d], hi - dst_offset[d]))
        src_idx.append(slice(lo - src_offset[d], hi - src_offset[d]))
    part = src[tuple(src_idx)]
    with torch.no_grad():
        dst[tuple(dst_idx)].copy_(part)
    return part.numel()


def check_leaf(path: str, dtype: torch.dtype, shape: list[int], like: Any, where: str) -> None:
    """Raise `CheckpointMismatchError` naming `path` when `like` is not a tensor of this dtype and shape."""
    if not isinstance(like, torch.Tensor):
        raise CheckpointMismatchError(
            f"{path!r}: {where} has a tensor {dtype_name(dtype)}{shape} but `like` has {describe(like)}"
        )
    if list(like.shape) != list(shape):
        raise CheckpointMismatchError(
            f"{path!r}: {where} has shape {tuple(shape)} but `like` has shape {tuple(like.shape)}"
        )
    if like.dtype != dtype:
        raise CheckpointMismatchError(
            f"{path!r}: {where} has dtype {dtype_name(dtype)} but `like` has dtype {dtype_name(like.dtype)}"
        )


def _short(paths: list[str]) -> str:
    return str(paths[:5]) + (f" and {len(paths) - 5} more" if len(paths) > 5 else "")


@checked
def load(path: str | os.PathLike[str] | None, like: TrainState, *, loader: Any = None) -> TrainState:
    """Load the checkpoint at `path` into the structure, dtypes and placement of `like` (donated).

    `path=None` (what `latest(root)` returns when `root` holds no checkpoint) raises `FileNotFoundError`
    saying so: check `latest`'s result to start fresh.

    Checks every file's size and CRC-32; raises `CheckpointMismatchError` naming the pytree path when the
    structure, a shape or a dtype differs. With `loader`, restores its position (`load_state_dict`).
    """
    if path is None:
        raise FileNotFoundError(
            "af.checkpoint.load(None, ...): no checkpoint path; af.checkpoint.latest(root) returns None when root "
            "holds no committed checkpoint: `path = latest(root)`, then load only `if path is not None`"
        )
    comm = Comm()
    comm.roll_call("af.checkpoint.load")  # on some ranks only: an error naming the others, not a hang
    error: Exception | None = None
    try:
        adapter = adapters.adapter_for(like)
        if (
            adapter is not None
        ):  # a backend's engine holds part of the state (DeepSpeed): load, then write it back
            out = adapter.restore(like, _load(path, adapter.template(like), loader))
        else:
            out = _load(path, like, loader)
    except Exception as e:  # noqa: BLE001 - re-raised below, after the ranks have compared outcomes
        error = e
    # the ranks agree: one rank that cannot read its files (a truncated shard) fails the load on every rank, so
    # a "newest readable checkpoint" loop cannot resume the ranks from different steps
    outcomes = comm.all_gather_json(None if error is None else [type(error).__name__, str(error)])
    if error is not None:
        raise error
    failed = [(r, o) for r, o in enumerate(outcomes) if o is not None]
    if failed:
        rank, (kind, message) = failed[0]
        cls = _SAME_KIND.get(kind, RuntimeError)
        raise cls(
            f"af.checkpoint.load('{path}') failed on rank {rank} ({kind}: {message}); every rank refuses it, so "
            "that all resume from the same checkpoint (this rank's `like` may hold its values)"
        )
    if out is not like:  # its tensors now hold the checkpoint's values beside its own step count and extras
        mark_donated(like, "af.checkpoint.load (as `like`)")
    return out


_SAME_KIND: dict[str, type[Exception]] = {
    "CorruptCheckpointError": CorruptCheckpointError,
    "CheckpointMismatchError": CheckpointMismatchError,
    "FileNotFoundError": FileNotFoundError,
}  # an error on another rank is raised here as the same kind, so `except CorruptCheckpointError` agrees


def _load(path: str | os.PathLike[str], like: TrainState, loader: Any) -> TrainState:
    folder = Path(path)
    meta = read_state_json(folder)
    where = f"checkpoint '{folder}'"
    saved: dict[str, dict[str, Any]] = meta["leaves"]
    leaves, spec = flatten(like)
    like_paths = [p for p, _ in leaves]
    missing = [p for p in like_paths if p not in saved]
    known = set(like_paths)
    unexpected = [p for p in saved if p not in known]
    if unexpected and not missing and holds_stage_params(like.params):
        unexpected = []  # a pipeline stage's state: the other stages' leaves are for the other ranks
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"in `like` but not in the checkpoint: {_short(missing)}")
        if unexpected:
            parts.append(f"in the checkpoint but not in `like`: {_short(unexpected)}")
        raise CheckpointMismatchError(f"{where} does not match the structure of `like`: " + "; ".join(parts))
    if loader is not None and meta.get("loader") is None:
        raise CheckpointError(f"{where} has no loader position (it was saved without loader=)")
    if loader is not None and hasattr(loader, "check_state_dict"):
        loader.check_state_dict(meta["loader"])  # before any weight is written into `like`

    out: dict[str, Any] = {}
    targets: dict[str, Target] = {}
    used: set[Any] = set()
    for p, v in leaves:
        e = saved[p]
        kind = e["kind"]
        if kind == "json":
            if isinstance(v, torch.Tensor):
                raise CheckpointMismatchError(
                    f"{p!r}: {where} has {e['value']!r} but `like` has {describe(v)}"
                )
            out[p] = e["value"]
            continue
        if kind == "alias":
            continue
        dtype, shape = dtype_of(e["dtype"]), e["shape"]
        check_leaf(p, dtype, shape, v, where)
        key = alias_key(v)
        local = v.to_local() if is_dtensor(v) else v  # type: ignore[attr-defined]
        t = Target(p, v, fresh=key in used or local.device.type == "meta")
        used.add(key)
        if kind == "inline":
            t.fill(torch.tensor(e["data"], dtype=dtype).reshape(shape), [0] * len(shape))
        else:
            targets[p] = t
        out[p] = t.value

    by_file: dict[str, list[tuple[Target, dict[str, Any]]]] = {}
    for p, t in targets.items():
        for piece in saved[p].get("pieces", []):
            if not _overlaps(t, piece):
                continue
            by_file.setdefault(piece["file"], []).append((t, piece))
    records = meta.get("files", {})
    for name in sorted(by_file):
        if "/" in name or "\\" in name or name.startswith("."):
            raise CorruptCheckpointError(f"{where}: state.json names an invalid file {name!r}")
        if name not in records:
            raise CorruptCheckpointError(f"{where}: state.json does not record the file '{name}'")
        into = {piece["key"]: t.local for t, piece in by_file[name] if t.direct(piece)}
        tensors = io.read_file(folder / name, io.FileRecord(**records[name]), into=into)
        for t, piece in by_file[name]:
            if piece["key"] not in tensors:
                raise CorruptCheckpointError(
                    f"'{folder / name}' lacks the tensor {piece['key']!r} of {t.path!r}"
                )
            t.fill(tensors[piece["key"]], piece["offset"])
        del tensors
    for t in targets.values():
        t.check_complete(folder)
    # files read straight into a tensor's memory bypass torch: count it as an in-place change, so that what
    # watches version counters (af.offload's host mirror of the params) sees the loaded values
    with torch.inference_mode(False):
        torch.autograd.graph.increment_version(
            [t.local for t in targets.values() if not t.local.is_inference()]
        )

    for p, v in leaves:
        e = saved[p]
        if e["kind"] == "alias":
            src = out[e["of"]]
            check_leaf(p, src.dtype, list(src.shape), v, where)
            out[p] = src
    result = _tree.unflatten(spec, [out[p] for p in like_paths])
    if loader is not None:
        loader.load_state_dict(meta["loader"])
    return result


def _overlaps(t: Target, piece: dict[str, Any]) -> bool:
    if t.local.numel() == 0:
        return False
    for d in range(t.local.ndim):
        lo = max(t.offset[d], piece["offset"][d])
        hi = min(t.offset[d] + t.local.shape[d], piece["offset"][d] + piece["shape"][d])
        if hi <= lo:
            return False
    return True

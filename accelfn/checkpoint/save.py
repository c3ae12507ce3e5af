"""`save(path, state)`: write a `TrainState` as safetensors + `state.json`, atomically; `latest(root)`.

Each rank writes what it owns (its DTensor shards; plain and replicated tensors once, by rank 0) into a
hidden temporary folder; rank 0 then writes `state.json` (structure, sizes, checksums) and renames the
folder into place. With `async_save=True` the tensors are copied to host memory and written by a
background thread while training continues.

Example:
    >>> import tempfile, torch, accelfn as af
    >>> step = af.train_step(lambda m, b: af.losses.mse(m(b["x"]), b["y"]), af.optim.adamw(1e-3))
    >>> state = step.init(torch.nn.Linear(3, 1))
    >>> root = tempfile.mkdtemp()
    >>> _ = af.checkpoint.save(f"{root}/step-0", state)
    >>> af.checkpoint.latest(root) == f"{root}/step-0"
    True
"""

from __future__ import annotations

import json
import math
import os
import shutil
import uuid
import warnings
from pathlib import Path
from typing import Any

import torch

from .. import dry_mode
from .. import tree as _tree
from .._typecheck import checked
from ..state import TrainState, check_not_donated
from . import adapters, async_, atomic, io
from ._dist import Comm, is_dtensor, is_sharded, region, writes_piece
from .async_ import SaveHandle, wait
from .format import (
    FORMAT,
    GROUPS,
    HF_INDEX,
    INLINE,
    STATE_FILE,
    VERSION,
    CheckpointError,
    file_name,
    hf_index,
    parse_size,
    read_state_json,
    step_of_name,
)
from .leaves import JSON_TYPES, alias_key, dtype_name, dtype_of, flatten, split_path

__all__ = ["save", "latest", "wait", "SaveHandle", "checkpoints"]


class _Contents:
    """What one rank writes, and the description of every leaf (built in the caller's thread)."""

    def __init__(self, state: TrainState, comm: Comm, max_shard_size: int, snapshot: bool) -> None:
        leaves, _ = flatten(state)
        first: dict[str, int] = {}
        self.divided = False  # the ranks hold different leaves (pipeline stages): each describes its own
        if comm.world > 1:
            everyone = comm.all_gather_json([p for p, v in leaves if isinstance(v, torch.Tensor)])
            self.divided = any(paths != everyone[0] for paths in everyone)
            for r, paths in reversed(list(enumerate(everyone))):
                first.update(dict.fromkeys(paths, r))
        self.multi = comm.world > 1 and (self.divided or any(is_sharded(v) for _, v in leaves))
        self.entries: dict[str, dict[str, Any]] = {}
        self.files: dict[str, dict[str, torch.Tensor]] = {}  # file name -> {key: tensor} (this rank)
        self.pieces: dict[str, list[dict[str, Any]]] = {}  # path -> pieces written by this rank
        groups: dict[str, dict[str, torch.Tensor]] = {g: {} for g in GROUPS}
        owner: dict[str, str] = {}  # group/key -> path, to catch two paths that flatten to one key
        seen: dict[Any, str] = {}
        for path, v in leaves:
            field, key = split_path(path)
            if field in INLINE:
                self.entries[path] = _inline(path, v)
                continue
            if isinstance(v, torch.Tensor):
                ak = alias_key(v)
                if ak in seen:
                    self.entries[path] = {"kind": "alias", "of": seen[ak]}
                    continue
                seen[ak] = path
                self.entries[path] = {"kind": "tensor", "dtype": dtype_name(v.dtype), "shape": list(v.shape)}
                if field not in GROUPS:
                    raise TypeError(f"cannot save state field {field!r} ({path})")
                if f"{field}/{key}" in owner:
                    raise ValueError(
                        f"state paths {owner[f'{field}/{key}']!r} and {path!r} have the same name"
                    )
                owner[f"{field}/{key}"] = path
                if not writes_piece(v, comm.rank, first.get(path, 0)):
                    continue
                local = v.to_local() if is_dtensor(v) else v  # type: ignore[attr-defined]
                offset, shape = region(v)
                if local.numel() == 0 and v.numel() > 0:
                    continue  # an empty shard of an unevenly sharded tensor
                local = local.detach()
                if snapshot:
                    local = async_.stage(path, local)
                groups[field][key] = local
                self.pieces[path] = [{"key": key, "offset": offset, "shape": shape}]
            elif isinstance(v, JSON_TYPES):
                self.entries[path] = {"kind": "json", "value": v}
            else:
                raise TypeError(
                    f"state leaf {path!r} is a {type(v).__name__}: a checkpoint stores tensors and JSON scalars "
                    "(bool, int, float, str)"
                )
        key_to_path = {(split_path(p)[0], pc[0]["key"]): p for p, pc in self.pieces.items()}
        for field, tensors in groups.items():
            for name, chunk in _split(
                tensors, max_shard_size, GROUPS[field], comm.rank if self.multi else None
            ):
                self.files[name] = chunk
                for key in chunk:
                    self.pieces[key_to_path[(field, key)]][0]["file"] = name
        self.step = _int_step(state.step)


def is_sharded_entry(entry: dict[str, Any]) -> bool:
    """A tensor leaf written in pieces (a DTensor's shards) rather than whole."""
    pieces = entry.get("pieces", [])
    return entry.get("kind") == "tensor" and (len(pieces) != 1 or pieces[0]["shape"] != entry["shape"])


def _inline(path: str, v: Any) -> dict[str, Any]:
    if isinstance(v, torch.Tensor):
        full = v.full_tensor() if is_dtensor(v) else v  # type: ignore[attr-defined]
        return {"kind": "inline", "dtype": dtype_name(v.dtype), "shape": list(v.shape), "data": full.tolist()}
    if isinstance(v, JSON_TYPES):
        return {"kind": "json", "value": v}
    raise TypeError(f"state leaf {path!r} is a {type(v).__name__}; expected a tensor or an int")


def _int_step(step: Any) -> int | None:
    if isinstance(step, torch.Tensor) and step.numel() == 1:
        return int((step.full_tensor() if is_dtensor(step) else step).item())  # type: ignore[attr-defined]
    return step if isinstance(step, int) else None


def _split(
    tensors: dict[str, torch.Tensor], max_size: int, base: str, rank: int | None
) -> list[tuple[str, dict[str, torch.Tensor]]]:
    """Greedily pack tensors (in key order) into files of at most `max_size` bytes (one big tensor alone)."""
    if not tensors:
        return []
    chunks: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for key in sorted(tensors):
        n = tensors[key].numel() * tensors[key].element_size()
        if chunks[-1] and size + n > max_size:
            chunks.append({})
            size = 0
        chunks[-1][key] = tensors[key]
        size += n
    return [(file_name(base, i + 1, len(chunks), rank=rank), c) for i, c in enumerate(chunks)]


def _write(
    contents: _Contents, comm: Comm, tmp: Path, final: Path, loader_state: Any, keep_last: int | None
) -> None:
    """Write this rank's files, then (rank 0) state.json, and commit. Runs in any thread."""
    records = {
        name: io.write_file(tmp / name, tensors, {"format": "pt"}).to_json()
        for name, tensors in contents.files.items()
    }
    mine = {"files": records, "pieces": contents.pieces}
    if contents.divided:
        mine["entries"] = contents.entries
    everyone = comm.all_gather_json(mine)
    if comm.rank == 0:
        files: dict[str, Any] = {}
        for part in everyone:
            for path, entry in part.get("entries", {}).items():
                contents.entries.setdefault(path, entry)  # a leaf of another pipeline stage
        for part in everyone:
            files.update(part["files"])
            for path, pieces in part["pieces"].items():
                contents.entries[path].setdefault("pieces", []).extend(pieces)
        if contents.divided and not any(is_sharded_entry(e) for e in contents.entries.values()):
            # whole tensors in several ranks' files (pipeline stages): the Hugging Face index over all of them
            weight_map = {
                e["pieces"][0]["key"]: e["pieces"][0]["file"]
                for p, e in contents.entries.items()
                if p.startswith("params.") and e.get("kind") == "tensor"
            }
            total = sum(
                math.prod(e["shape"]) * dtype_of(e["dtype"]).itemsize
                for p, e in contents.entries.items()
                if p.startswith("params.") and e.get("kind") == "tensor"
            )
            (tmp / HF_INDEX).write_text(hf_index(weight_map, total))
            io.fsync_path(tmp / HF_INDEX)
        if not contents.multi:
            weight_map = {
                pc[0]["key"]: pc[0]["file"] for p, pc in contents.pieces.items() if p.startswith("params.")
            }
            if len(set(weight_map.values())) > 1:
                total = sum(
                    contents.files[f][k].numel() * contents.files[f][k].element_size()
                    for k, f in weight_map.items()
                )
                (tmp / HF_INDEX).write_text(hf_index(weight_map, total))
                io.fsync_path(tmp / HF_INDEX)
        meta = {
            "format": FORMAT,
            "version": VERSION,
            "step": contents.step,
            "world_size": comm.world,
            "sharded": contents.multi,
            "accelfn_version": _accelfn_version(),
            "torch_version": torch.__version__,
            "loader": loader_state,
            "files": dict(sorted(files.items())),
            "leaves": contents.entries,
        }
        with open(tmp / STATE_FILE, "w") as f:
            json.dump(meta, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        atomic.commit(tmp, final)
        if keep_last is not None:
            _prune(final, keep_last)
    comm.barrier()


def _write_or_clean(
    contents: _Contents, comm: Comm, tmp: Path, final: Path, loader_state: Any, keep_last: int | None
) -> None:
    try:
        _write(contents, comm, tmp, final, loader_state, keep_last)
    except BaseException:
        if comm.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise


def _accelfn_version() -> str:
    from .._version import __version__

    return str(__version__)


def series_of_name(name: str) -> str | None:
    """The series of a checkpoint folder name: the text before its trailing step number (`step-` for
    `step-1200`, `ckpt-` for `ckpt-000100`), or None for a name without one (`best`, `final`)."""
    if step_of_name(name) is None:
        return None
    return name.rstrip("0123456789")


def _prune(final: Path, keep_last: int) -> None:
    """Delete all but the `keep_last` newest checkpoints of `final`'s series (see `save`); nothing else."""
    series = series_of_name(final.name)
    if series is None:
        warnings.warn(
            f"save(keep_last={keep_last}): '{final.name}' does not end in a step number (like 'step-1200'), so "
            "it starts no series of checkpoints and nothing was deleted",
            stacklevel=2,
        )
        return
    older = [p for p in checkpoints(final.parent) if p != final and series_of_name(p.name) == series]
    for p in older[: max(0, len(older) - (keep_last - 1))]:
        atomic.remove(p)


@checked
def save(
    path: str | os.PathLike[str],
    state: TrainState,
    *,
    loader: Any = None,
    max_shard_size: int | str = "5GB",
    keep_last: int | None = None,
    async_save: bool = False,
) -> SaveHandle:
    """Save `state` (and `loader.state_dict()`) to the folder `path`, atomically; returns a `SaveHandle`.

    Call it on every rank. `keep_last=k` then deletes all but the `k` newest checkpoints of `path`'s series:
    the committed checkpoints beside `path` whose folder names differ from its name only in the trailing step
    number (`step-100`, `step-200`, ... or `ckpt-000100`, ...). Other checkpoints in the same folder (`best`,
    `final`, `run2-step-100`) are never deleted; with a `path` whose name has no step number, nothing is.
    With `async_save=True` it returns once the tensors are copied to host memory; the next `save` or
    `af.checkpoint.wait()` waits for the write (and re-raises its error).
    """
    if keep_last is not None and keep_last < 1:
        raise ValueError(f"save(): keep_last must be >= 1 or None, got {keep_last}")
    check_not_donated(state, "af.checkpoint.save")
    size = parse_size(max_shard_size)
    if dry_mode.skip(f"af.checkpoint.save({str(path)!r})"):
        return SaveHandle(str(Path(path).absolute()))
    wait()
    comm = Comm()
    comm.roll_call("af.checkpoint.save")  # a call on some ranks only: a clear error, not a hang
    adapter = adapters.adapter_for(state)
    if adapter is not None:  # a backend's engine holds part of the state (DeepSpeed): save its full values
        state = adapter.export(state)
    loader_state = None
    if loader is not None:
        if not callable(getattr(loader, "state_dict", None)):
            raise TypeError(f"save(): loader must have a state_dict() method, got {type(loader).__name__}")
        loader_state = loader.state_dict()
        try:
            json.dumps(loader_state)
        except (TypeError, ValueError) as e:
            raise TypeError(f"save(): loader.state_dict() must return JSON-able data ({e})") from None
    final = Path(path).absolute()
    atomic.check_replaceable(final, (STATE_FILE,))
    _finish_device_work(state)
    contents = _Contents(state, comm, size, snapshot=async_save)
    token = comm.broadcast_str(uuid.uuid4().hex[:12])
    tmp = atomic.temp_sibling(final, token)
    if comm.rank == 0:
        final.parent.mkdir(parents=True, exist_ok=True)
        atomic.clean_stale(final)
        tmp.mkdir()
    comm.barrier()
    if not async_save:
        _write_or_clean(contents, comm, tmp, final, loader_state, keep_last)
        return SaveHandle(str(final))
    return async_.start(
        lambda: _write_or_clean(contents, comm, tmp, final, loader_state, keep_last), str(final)
    )


def _finish_device_work(state: TrainState) -> None:
    """Let the devices finish their queued work before the state is read: host tensors may still be the target
    of asynchronous device-to-host copies (pinned buffers, e.g. af.offload's pending gradients)."""
    from .. import platforms

    tensors = [t for t in _tree.leaves(state) if isinstance(t, torch.Tensor)]
    devices = {t.device for t in tensors if not platforms.is_host(t.device) and not t.is_meta}
    for device in devices:
        platforms.synchronize(device)
    if not devices and any(
        platforms.is_host(t.device) and not is_dtensor(t) and t.is_pinned() for t in tensors
    ):
        torch.accelerator.synchronize()  # pinned host tensors only: the copies come from the current accelerator


def checkpoints(root: str | os.PathLike[str]) -> list[Path]:
    """The committed checkpoints directly under `root`, oldest first (by step in state.json, then name)."""
    root = Path(root)
    found = []
    if not root.is_dir():
        return []
    for p in root.iterdir():
        if atomic.is_hidden(p.name) or not p.is_dir():
            continue
        try:
            meta = read_state_json(p)
        except (OSError, ValueError, CheckpointError):
            continue
        step = meta.get("step")
        if not isinstance(step, int):
            step = step_of_name(p.name) or -1
        found.append((step, step_of_name(p.name) or -1, p.name, p))
    return [p for *_, p in sorted(found)]


@checked
def latest(root: str | os.PathLike[str]) -> str | None:
    """The path of the newest committed checkpoint under `root` (by step), or None if there is none."""
    found = checkpoints(root)
    return str(found[-1]) if found else None

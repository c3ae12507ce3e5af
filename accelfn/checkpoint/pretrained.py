"""Hugging Face weights: `save_pretrained` writes a folder `transformers` loads; `load_pretrained` reads one.

Tied weights are stored once, under the first name (`transformer.wte.weight` for GPT-2, whose
`lm_head.weight` transformers re-ties from the config). A sharded (DTensor) model or state is gathered
and written by rank 0 as one consolidated checkpoint.

Example:
    >>> import tempfile, torch, accelfn as af
    >>> path = tempfile.mkdtemp() + "/weights"
    >>> af.checkpoint.save_pretrained(path, torch.nn.Linear(2, 2))
    >>> sorted(af.checkpoint.load_pretrained(path))
    ['bias', 'weight']
"""

from __future__ import annotations

import json
import os
import re
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .. import dry_mode
from .._typecheck import checked
from ..state import TrainState, check_not_donated
from . import atomic, io
from ._dist import Comm, is_dtensor
from .format import HF_INDEX, CheckpointMismatchError, hf_index, parse_size
from .leaves import alias_key
from .load import Target, check_leaf
from .save import _split

__all__ = ["save_pretrained", "load_pretrained"]


def _persistent_buffers(module: nn.Module) -> set[str]:
    """The dotted names of `module`'s buffers that its `state_dict` holds (transformers saves only those)."""
    names = set()
    for prefix, m in module.named_modules(remove_duplicate=False):
        for n, b in m._buffers.items():
            if b is not None and n not in m._non_persistent_buffers_set:
                names.add(f"{prefix}.{n}" if prefix else n)
    return names


def _state_tensors(state: TrainState, model: nn.Module) -> dict[str, torch.Tensor]:
    """The state's params and the persistent ones of its buffers, checked against `model` (the module it trains)."""
    own = {n for n, _ in model.named_parameters(remove_duplicate=False)}
    persistent = _persistent_buffers(model)
    own_buffers = {n for n, _ in model.named_buffers(remove_duplicate=False)}
    foreign = [n for n in state.params if n not in own] + [n for n in state.buffers if n not in own_buffers]
    if foreign:
        raise ValueError(
            f"save_pretrained(): model= is not the module this state trains: it has no {foreign[:3]} "
            f"(pass the model of the step that made the state, step.model)"
        )
    return {**state.params, **{n: b for n, b in state.buffers.items() if n in persistent}}


def _named_tensors(model_or_params: Any, model: nn.Module | None = None) -> dict[str, torch.Tensor]:
    if isinstance(model_or_params, nn.Module):
        named = model_or_params.state_dict(keep_vars=True)  # persistent buffers included, as transformers
    elif isinstance(model_or_params, TrainState):
        named = model_or_params.params if model is None else _state_tensors(model_or_params, model)
    else:
        named = model_or_params
    out: dict[str, torch.Tensor] = {}
    seen: set[Any] = set()
    for name, t in named.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"save_pretrained(): {name!r} is a {type(t).__name__}, not a tensor")
        key = alias_key(t)
        if key not in seen:  # a tied weight is stored once, under its first name
            seen.add(key)
            out[name] = t
    return out


@checked
def save_pretrained(
    path: str | os.PathLike[str],
    model_or_params: nn.Module | TrainState | dict[str, torch.Tensor],
    *,
    model: nn.Module | None = None,
    config: Any = None,
    max_shard_size: int | str = "5GB",
) -> None:
    """Write Hugging Face weights (`model.safetensors`, or shards + `model.safetensors.index.json`) and
    `config.json`: a folder `transformers`' `from_pretrained` loads.

    Takes a module (its `state_dict`), a `TrainState` or a dict of tensors (the weights alone). The `config`
    (default: the module's `.config`, as transformers models have) is written beside the weights.

    A `TrainState` knows neither its model's config nor which of its buffers are persistent: pass
    `model=step.model`, the module it trains (the replacement for Accelerate's `save_model(model, dir)`).
    The weights are then the state's params and persistent buffers (the values training produced), and
    `config.json` is the model's `.config`. A state given with neither `model` nor `config` raises a
    `TypeError` (for the weights alone, pass `state.params`).

    Call on every rank. Saving into an existing model folder replaces the weights (and config) atomically and
    keeps the other files there (tokenizer, README, ...).
    """
    size = parse_size(max_shard_size)
    if model is not None and not isinstance(model_or_params, TrainState):
        raise TypeError(
            "save_pretrained(): model= goes with a TrainState (save_pretrained(path, state, model=step.model)); "
            f"for a {type(model_or_params).__name__}, pass config=model.config"
        )
    if isinstance(model_or_params, TrainState) and model is None and config is None:
        raise TypeError(
            "save_pretrained(path, state): a TrainState holds no model config, so transformers could not load "
            "the folder; pass the module it trains: save_pretrained(path, state, model=step.model) (writes "
            "config.json and the persistent buffers too), or config=..., or state.params for the weights alone"
        )
    if isinstance(model_or_params, TrainState):
        check_not_donated(model_or_params, "af.checkpoint.save_pretrained")
    named = _named_tensors(model_or_params, model)
    if dry_mode.skip(f"af.checkpoint.save_pretrained({str(path)!r})"):
        return
    source = model if model is not None else model_or_params
    module = source if isinstance(source, nn.Module) else None
    if config is None and module is not None:
        config = getattr(module, "config", None)
    final = Path(path).absolute()
    atomic.check_replaceable(final, ("model.safetensors", HF_INDEX, "config.json"), keeps_others=True)
    full = gather_full(named)
    if full is not None:
        write_folder(final, lambda tmp: write_weights(tmp, full, size, config, module), _is_weight_file)
    Comm().barrier()


def gather_full(
    named: dict[str, torch.Tensor], what: str = "af.checkpoint.save_pretrained"
) -> dict[str, torch.Tensor] | None:
    """Full (detached) tensors on rank 0, None elsewhere; sharded (DTensor) ones are gathered, a collective
    every rank joins (with the same names, in the same order): `what` names the call when a rank is missing."""
    comm = Comm()
    comm.roll_call(what)
    rank0 = comm.rank == 0
    full: dict[str, torch.Tensor] = {}
    for name, t in named.items():
        if is_dtensor(t):
            t = t.full_tensor()  # type: ignore[attr-defined]  # collective: every rank takes part
        if rank0:
            full[name] = t.detach()
    return full if rank0 else None


def write_folder(final: Path, write: Callable[[Path], None], replaced: Callable[[str], bool]) -> None:
    """Rank 0: `write(tmp)` into a fresh hidden sibling, then swap it in for `final` atomically; the files
    of an existing `final` that `replaced` does not claim (tokenizer, README, ...) are kept."""
    final.parent.mkdir(parents=True, exist_ok=True)
    atomic.clean_stale(final)
    tmp = atomic.temp_sibling(final, uuid.uuid4().hex[:12])
    tmp.mkdir()
    write(tmp)
    atomic.carry_over(final, tmp, replaced)
    atomic.commit(tmp, final)


def write_weights(
    folder: Path, full: dict[str, torch.Tensor], size: int, config: Any, module: nn.Module | None = None
) -> None:
    """`model.safetensors` (or shards + index), `config.json` and, for a model that generates,
    `generation_config.json` into `folder`, each fsynced. As transformers' `save_pretrained`, the config says
    the `module`'s class (`architectures`) and the dtype of the weights written."""
    files = _split(full, size, "model", None)
    for name, tensors in files:
        io.write_file(folder / name, tensors, {"format": "pt"})
    if len(files) > 1:
        total = sum(t.numel() * t.element_size() for t in full.values())
        (folder / HF_INDEX).write_text(hf_index({k: n for n, ts in files for k in ts}, total))
        io.fsync_path(folder / HF_INDEX)
    if config is not None:
        if hasattr(config, "save_pretrained"):
            _as_written(config, full, module).save_pretrained(folder)
        else:
            (folder / "config.json").write_text(json.dumps(config, indent=2))
        io.fsync_path(folder / "config.json")
    generation = getattr(module, "generation_config", None)
    can_generate = getattr(module, "can_generate", None)
    if (
        generation is not None
        and hasattr(generation, "save_pretrained")
        and callable(can_generate)
        and can_generate()
    ):
        generation.save_pretrained(folder)
        io.fsync_path(folder / "generation_config.json")


def _as_written(config: Any, full: dict[str, torch.Tensor], module: nn.Module | None) -> Any:
    """A copy of a transformers config naming `module`'s class in `architectures` and the dtype of the first
    floating-point weight written (so `from_pretrained` rebuilds the same model in the same dtype)."""
    import copy

    config = copy.deepcopy(config)
    if (
        module is not None and hasattr(module, "config") and hasattr(module, "can_generate")
    ):  # a transformers model
        config.architectures = [type(module).__name__]
    dtype = next((t.dtype for t in full.values() if t.is_floating_point()), None)
    if dtype is not None:
        attr = "dtype" if hasattr(config, "dtype") else "torch_dtype"  # transformers 5 / 4
        setattr(config, attr, str(dtype).removeprefix("torch."))
    return config


def _is_weight_file(name: str) -> bool:
    """Files a previous `save_pretrained` wrote that the new one replaces (its weights and their index; a
    `generation_config.json` it writes replaces the old one, which is otherwise kept)."""
    return name == HF_INDEX or re.fullmatch(r"model(-\d{5}-of-\d{5})?\.safetensors", name) is not None


def _weight_files(folder: Path) -> list[Path]:
    if folder.is_file():
        return [folder]
    if not folder.exists():
        raise FileNotFoundError(f"no weights at '{folder}': the folder does not exist")
    index = folder / HF_INDEX
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [folder / f for f in sorted(set(weight_map.values()))]
    if (folder / "model.safetensors").exists():
        return [folder / "model.safetensors"]
    raise FileNotFoundError(f"'{folder}' has neither model.safetensors nor {HF_INDEX}")


@checked
def load_pretrained(
    path: str | os.PathLike[str], like: dict[str, torch.Tensor] | None = None, *, strict: bool = True
) -> dict[str, torch.Tensor]:
    """Read Hugging Face weights (one file or index + shards) as `{name: tensor}`.

    With `like` (e.g. `state.params`, donated), values are copied into its tensors (cast to their dtype,
    sliced to their DTensor shard) and names `like` lacks raise unless `strict=False`.
    """
    folder = Path(path)
    files = _weight_files(folder)
    if like is None:
        out: dict[str, torch.Tensor] = {}
        for f in files:
            out.update(io.read_file(f))
        return out
    headers = {f: io.read_header(f)[0] for f in files}
    where_of = {k: f for f, h in headers.items() for k in h if k != "__metadata__"}
    missing = [k for k in like if k not in where_of]
    unexpected = [k for k in where_of if k not in like]
    if missing or (strict and unexpected):
        raise CheckpointMismatchError(
            f"weights at '{folder}' do not match `like`: missing {missing[:5]}, unexpected {unexpected[:5]}"
            + (" (pass strict=False to ignore unexpected ones)" if unexpected else "")
        )
    targets: dict[str, Target] = {}
    used: set[Any] = set()
    for name, v in like.items():
        info = headers[where_of[name]][name]
        check_leaf(name, v.dtype, info["shape"], v, f"'{where_of[name]}'")  # dtype is cast, shape must match
        key = alias_key(v)
        local = v.to_local() if is_dtensor(v) else v  # type: ignore[attr-defined]
        targets[name] = Target(name, v, fresh=key in used or local.device.type == "meta")
        used.add(key)
    for f in files:
        names = {n for n in targets if where_of[n] == f}
        if not names:
            continue
        into = {
            n: targets[n].local
            for n in names
            if targets[n].direct({"offset": [0] * targets[n].local.ndim, "shape": headers[f][n]["shape"]})
        }
        tensors = io.read_file(f, names=names, into=into)
        for n in names:
            targets[n].fill(tensors[n], [0] * tensors[n].ndim)
    for t in targets.values():
        t.check_complete(folder)
    return {n: t.value for n, t in targets.items()}

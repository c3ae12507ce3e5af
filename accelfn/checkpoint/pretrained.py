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
import sys
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .. import dry_mode
from .._typecheck import checked
from ..stages import is_carved
from ..state import TrainState, check_not_donated
from . import atomic, experts, io
from ._dist import Comm, is_dtensor
from .format import HF_INDEX, CheckpointMismatchError, hf_index, parse_size
from .leaves import alias_key, dtype_name, dtype_of
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
    """The state's params and the persistent ones of its buffers, checked against `model` (the module it trains):
    names and shapes."""
    own = {n for n, _ in model.named_parameters(remove_duplicate=False)}
    persistent = _persistent_buffers(model)
    own_buffers = {n for n, _ in model.named_buffers(remove_duplicate=False)}
    foreign = [n for n in state.params if n not in own] + [n for n in state.buffers if n not in own_buffers]
    if foreign:
        raise ValueError(
            f"save_pretrained(): model= is not the module this state trains: it has no {foreign[:3]} "
            f"(pass the model of the step that made the state, step.model)"
        )
    out = {**state.params, **{n: b for n, b in state.buffers.items() if n in persistent}}
    _check_shapes(
        out,
        {
            **dict(model.named_parameters(remove_duplicate=False)),
            **dict(model.named_buffers(remove_duplicate=False)),
        },
    )
    return out


def _full_shape(t: torch.Tensor) -> tuple[int, ...]:
    """The tensor's whole shape: a DTensor's global one (its `.shape`), a ZeRO-3 partitioned param's `ds_shape`."""
    shape = getattr(t, "ds_shape", None)
    return tuple(t.shape if shape is None else shape)


def _check_shapes(named: dict[str, torch.Tensor], own: dict[str, torch.Tensor]) -> None:
    """Raise when a tensor of the state has another (full) shape than the model's of the same name: the
    config.json written would describe another model than the weights (a model built from another config)."""
    wrong = [
        (n, _full_shape(t), _full_shape(own[n]))
        for n, t in named.items()
        if n in own and _full_shape(t) != _full_shape(own[n])
    ]
    if wrong:
        name, got, want = wrong[0]
        more = f" (and {len(wrong) - 1} more)" if len(wrong) > 1 else ""
        raise ValueError(
            f"save_pretrained(): {name!r} has shape {got} in the state but {want} in model={more}: model= is not "
            f"the module this state trains (a model built from another config?), and its config.json would not "
            f"describe these weights; pass the model of the step that made the state, step.model"
        )


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
    merge: bool = False,
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

    A PEFT model (`peft.PeftModel`, given as the module or as `model=`) is written as
    `PeftModel.save_pretrained` writes it: `adapter_model.safetensors` + `adapter_config.json` (adapters other
    than `"default"` in subfolders of their name), which `PeftModel.from_pretrained(base, path)` and
    `AutoPeftModelForCausalLM` load (and `AutoModelForCausalLM` when the base has a name or path). With
    `merge=True`, instead the base model with the active adapter merged into its weights (as
    `save_adapter(merge=True)`), which `AutoModelForCausalLM.from_pretrained(path)` loads as a plain model.

    Fused experts (`mlp.experts.gate_up_proj`, `down_proj`, whole or `Shard(0)` over `ep`) are written per
    expert (`mlp.experts.{e}.gate_proj.weight`, ...) where transformers' own `save_pretrained` does so (the
    model types its conversion mapping converts, e.g. Qwen3-MoE).

    With a transformers config, the names written are checked against the model it describes (the module,
    or the class its `architectures` names): weights that `from_pretrained` would leave at their random
    initialisation (or ignore) raise a `ValueError` naming them, before anything is written. With `model=`,
    a tensor of the state whose shape differs from the model's of the same name (a model built from another
    config) raises a `ValueError` too, before anything is written.

    Call on every rank. Saving into an existing model folder replaces the weights (and config) atomically and
    keeps the other files there (tokenizer, README, ...); an adapter there goes too (transformers would apply
    it on top of the weights written).
    """
    from . import peft_adapters

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
    source = model if model is not None else model_or_params
    module = source if isinstance(source, nn.Module) else None
    if peft_adapters.is_peft_model(module):
        if config is not None:
            raise TypeError(
                "save_pretrained(): config= does not go with a PeftModel (its adapter_config.json is written, "
                "or with merge=True the base model's config)"
            )
        assert module is not None
        if isinstance(model_or_params, TrainState):
            _state_tensors(model_or_params, module)  # the state is the model's
            params = model_or_params.params
        else:
            params = dict(module.named_parameters())
        if dry_mode.skip(f"af.checkpoint.save_pretrained({str(path)!r})"):
            return
        peft_adapters.save_peft_pretrained(Path(path).absolute(), params, module, merge, size)
        return
    if merge:
        raise TypeError(
            "save_pretrained(): merge=True merges a PEFT adapter into its base model, but "
            f"{type(module or model_or_params).__name__} is not a peft.PeftModel"
        )
    named = _named_tensors(model_or_params, model)
    if config is None and module is not None:
        config = getattr(module, "config", None)
    check_loadable(all_names(named), module, config)
    if dry_mode.skip(f"af.checkpoint.save_pretrained({str(path)!r})"):
        return
    final = Path(path).absolute()
    atomic.check_replaceable(final, ("model.safetensors", HF_INDEX, "config.json"), keeps_others=True)
    full = gather_full(named)
    hf = _hf_model(module, config) if full is not None and experts.splits_experts(config) else None
    if (
        full is not None and hf is not None
    ):  # transformers' own layout: one key per expert, its renames undone
        full = experts.to_hf(full, hf)
    if full is not None:
        write_folder(final, lambda tmp: write_weights(tmp, full, size, config, module), _is_weight_file)
    Comm().barrier()


def _hf_model(module: nn.Module | None, config: Any) -> nn.Module | None:
    """The transformers model whose conversion mapping `save_pretrained` reverts: `module` where it is one
    (it may carry the conversions `from_pretrained` used), else the class `config.architectures` names (or
    the causal LM of its model type), built on the meta device from `config`; None without a transformers
    config."""
    transformers = _transformers()
    if transformers is None or not isinstance(config, transformers.PretrainedConfig):
        return None
    if isinstance(module, transformers.PreTrainedModel) and not is_carved(module):
        return module
    names = getattr(config, "architectures", None) or []
    cls = getattr(transformers, names[0], None) if len(names) == 1 else None
    with torch.device("meta"):
        if isinstance(cls, type) and issubclass(cls, transformers.PreTrainedModel):
            return cls(config)
        return transformers.AutoModelForCausalLM.from_config(config)


def _transformers() -> Any:
    """transformers where something imported it (no transformers model or config exists otherwise)."""
    return sys.modules.get("transformers")


def _reference_model(module: nn.Module | None, config: Any) -> tuple[nn.Module, str] | None:
    """The transformers model that `config.json` makes `from_pretrained` build, and where `module` holds it
    (`""`: it is the module): the module itself, a transformers model inside it (a wrapper's weights are named
    after the wrapper), or without a module the class `config.architectures` names, built on the meta device.
    None where that cannot be told."""
    transformers = _transformers()
    if transformers is None or not isinstance(config, transformers.PretrainedConfig):
        return None
    base = transformers.PreTrainedModel
    if module is not None:
        found = next(((m, n) for n, m in module.named_modules() if isinstance(m, base)), None)
        if found is not None and is_carved(found[0]):  # a pipeline stage: the keys of the whole model
            try:
                with torch.device("meta"):
                    return type(found[0])(found[0].config), found[1]
            except Exception:  # noqa: BLE001 - a class that cannot be built from its config: no comparison
                return None
        return found
    names = getattr(config, "architectures", None) or []
    cls = getattr(transformers, names[0], None) if len(names) == 1 else None
    if not (isinstance(cls, type) and issubclass(cls, base)):
        return None
    try:  # checkpoints of some model types (MoE experts, ...) are renamed on load: their names are not comparable
        from transformers.conversion_mapping import get_checkpoint_conversion_mapping

        if any(get_checkpoint_conversion_mapping(k) for k in (cls.__name__, config.model_type)):
            return None
    except ImportError:  # pragma: no cover - transformers 4
        pass
    try:
        with torch.device("meta"):
            return cls(config), ""
    except Exception:  # a config this class cannot build: nothing to compare with  # noqa: BLE001
        return None


def check_loadable(names: list[str], module: nn.Module | None, config: Any) -> None:
    """Raise (on every rank, before writing) when transformers' `from_pretrained` of the folder would leave
    weights of the model `config` describes uninitialised, or ignore weights written: `names` against the
    model's state_dict, as transformers matches them (tied weights once, its `base_model_prefix` added or
    stripped, the keys its class says to ignore)."""
    found = _reference_model(module, config)
    if found is None:
        return
    ref, where = found
    group_of: dict[str, Any] = {k: alias_key(t) for k, t in ref.state_dict(keep_vars=True).items()}
    expected = set(group_of)
    for target, source in (getattr(ref, "all_tied_weights_keys", None) or {}).items():
        if target in expected and source in expected:  # transformers re-ties these on load
            old, new = group_of[target], group_of[source]
            group_of.update({k: new for k, g in group_of.items() if g == old})
    groups: dict[Any, list[str]] = {}
    for k, g in group_of.items():
        groups.setdefault(g, []).append(k)
    prefix = getattr(ref, "base_model_prefix", "") or ""

    def as_loaded(k: str) -> str | None:
        if k in expected:
            return k
        if prefix and f"{prefix}.{k}" in expected:
            return f"{prefix}.{k}"
        if prefix and k.startswith(prefix + ".") and k[len(prefix) + 1 :] in expected:
            return k[len(prefix) + 1 :]
        return None

    loaded = {k: as_loaded(k) for k in names}
    hit = {v for v in loaded.values() if v is not None}

    def ignored(k: str, attr: str) -> bool:
        return any(re.search(p, k) for p in getattr(ref, attr, None) or ())

    unexpected = [
        k for k, v in loaded.items() if v is None and not ignored(k, "_keys_to_ignore_on_load_unexpected")
    ]
    missing = sorted(
        {
            g[0]
            for g in groups.values()
            if not hit & set(g) and not any(ignored(k, "_keys_to_ignore_on_load_missing") for k in g)
        }
    )
    if not missing and not unexpected:
        return
    cls = type(ref).__name__

    def some(keys: list[str]) -> str:
        return f"{len(keys)}: {keys[:3]}{' ...' if len(keys) > 3 else ''}"

    if where:
        hint = (
            f"the names are those of {type(module).__name__}, which holds the {cls} at {where!r}: pass that model "
            f"(or its weights under its own names, e.g. {{k.removeprefix({where + '.'!r}): v for k, v in "
            f"state.params.items()}} with config=...), or state.params alone for the weights without config.json"
        )
    elif any(k.startswith("base_model.model.") for k in unexpected):
        hint = (
            "these are a PEFT model's names: pass the PeftModel (model=step.model) to write its adapter, or "
            "af.checkpoint.save_adapter(path, state, model) / save_adapter(..., merge=True) for the merged model"
        )
    else:
        hint = "check that the weights are this model's (or pass config=None to write the weights alone)"
    raise ValueError(
        f"save_pretrained(): transformers' {cls} (the model config.json describes) would not load these "
        f"weights: from_pretrained would initialise the missing ones at random and skip the unexpected ones "
        f"without an error; missing {some(missing)}, unexpected {some(unexpected)}; {hint}"
    )


def all_names(named: dict[str, torch.Tensor], what: str = "af.checkpoint.save_pretrained") -> list[str]:
    """The names of `named` on every rank, together (a collective, checked by a roll call: `what` names the
    call when a rank is missing): under pipeline parallel each rank holds its stages' tensors only, and what
    is written is all of them."""
    comm = Comm()
    comm.roll_call(what)
    out = dict.fromkeys(named)
    for names in _held_by_rank(comm, named):
        out.update(dict.fromkeys(names))
    return list(out)


def gather_full(
    named: dict[str, torch.Tensor], what: str = "af.checkpoint.save_pretrained"
) -> dict[str, torch.Tensor] | None:
    """Full (detached) tensors on rank 0, None elsewhere; sharded (DTensor) ones are gathered, a collective
    every rank joins: `what` names the call when a rank is missing. Ranks holding different tensors (pipeline
    stages) send rank 0 the ones it lacks (each from the lowest rank holding it), point to point."""
    comm = Comm()
    comm.roll_call(what)
    held = _held_by_rank(comm, named)
    senders = _senders(held)
    full: dict[str, torch.Tensor] = {}
    for name, t in named.items():
        if is_dtensor(t):
            t = t.full_tensor()  # type: ignore[attr-defined]  # collective: every rank takes part
        if comm.rank == 0 or senders.get(name) == comm.rank:  # the others drop it at once (memory)
            full[name] = t.detach()
    for name, src in senders.items():  # the same order on every rank
        shape, dtype = held[src][name]
        if comm.rank == src:
            dist.send(
                full.pop(name).cpu().contiguous().reshape(-1).view(torch.uint8), dst=0, group=comm.group
            )
        elif comm.rank == 0:
            tensor = torch.empty(shape, dtype=dtype_of(dtype))
            dist.recv(tensor.reshape(-1).view(torch.uint8), src=src, group=comm.group)
            full[name] = tensor
    return full if comm.rank == 0 else None


def _held_by_rank(comm: Comm, named: dict[str, torch.Tensor]) -> list[dict[str, list[Any]]]:
    """Each rank's tensor names with their (global) shapes and dtypes, in rank order (JSON over the save's
    group)."""
    mine = {k: [list(t.shape), dtype_name(t.dtype)] for k, t in named.items()}
    return comm.all_gather_json(mine) if comm.active else [mine]


def _senders(held: list[dict[str, list[Any]]]) -> dict[str, int]:
    """For each tensor rank 0 does not hold (other pipeline stages'), the lowest rank that does."""
    out: dict[str, int] = {}
    for rank in range(1, len(held)):
        for name in held[rank]:
            if name not in held[0] and name not in out:
                out[name] = rank
    return out


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
    """Files a previous save wrote that writing model weights replaces: its weights and their index, and an
    adapter (transformers applies an adapter found beside a model's weights on top of them). A
    `generation_config.json` written replaces the old one, which is otherwise kept."""
    return (
        name in (HF_INDEX, "adapter_model.safetensors", "adapter_model.bin", "adapter_config.json")
        or re.fullmatch(r"model(-\d{5}-of-\d{5})?\.safetensors", name) is not None
    )


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
    sliced to their DTensor shard) and names `like` lacks raise unless `strict=False`. Fused experts in `like`
    (`mlp.experts.gate_up_proj [E, 2F, D]`, `down_proj`) are read from the per-expert keys transformers writes
    (`mlp.experts.{e}.gate_proj.weight`, Mixtral's `block_sparse_moe.experts.{e}.w1.weight`, ..., with the
    other keys transformers renames for that model type, as the folder's `config.json` names it); each rank
    reads only the slices of its own experts (an `ep` or FSDP shard), never the whole tensor.
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
    stored, fused = _read_plan(folder, where_of, like)
    consumed = {key for src in fused.values() for key, _ in src} | set(stored.values())
    missing = [k for k in like if k not in stored and k not in fused]
    unexpected = [k for k in where_of if k not in consumed]
    if missing or (strict and unexpected):
        raise CheckpointMismatchError(
            f"weights at '{folder}' do not match `like`: missing {missing[:5]}, unexpected {unexpected[:5]}"
            + (" (pass strict=False to ignore unexpected ones)" if unexpected else "")
        )
    targets: dict[str, Target] = {}
    used: set[Any] = set()
    for name, v in like.items():
        if name in fused:
            _check_expert_shapes(name, list(v.shape), fused[name], headers, where_of)
            targets[name] = Target(name, v, fresh=alias_key(v) in used or _is_meta(v))
            used.add(alias_key(v))
            continue
        key = stored[name]
        info = headers[where_of[key]][key]
        check_leaf(name, v.dtype, info["shape"], v, f"'{where_of[key]}'")  # dtype is cast, shape must match
        local = v.to_local() if is_dtensor(v) else v  # type: ignore[attr-defined]
        targets[name] = Target(name, v, fresh=alias_key(v) in used or local.device.type == "meta")
        used.add(alias_key(v))
    for name, sources in fused.items():
        _read_experts(targets[name], sources, where_of)
    for f in files:
        names = {stored[n]: n for n in targets if n not in fused and where_of[stored[n]] == f}  # key -> name
        if not names:
            continue
        into = {
            k: targets[n].local
            for k, n in names.items()
            if targets[n].direct({"offset": [0] * targets[n].local.ndim, "shape": headers[f][k]["shape"]})
        }
        tensors = io.read_file(f, names=set(names), into=into)
        for k, n in names.items():
            targets[n].fill(tensors[k], [0] * tensors[k].ndim)
    for t in targets.values():
        t.check_complete(folder)
    return {n: t.value for n, t in targets.items()}


def _read_plan(
    folder: Path, where_of: dict[str, Path], like: dict[str, torch.Tensor]
) -> tuple[dict[str, str], dict[str, list[tuple[str, list[int]]]]]:
    """The checkpoint key of each name of `like` read whole, and the per-expert keys of each fused expert
    tensor: as transformers renames and joins them on load where the folder's `config.json` names a model type
    it converts (Mixtral's `block_sparse_moe.experts.{e}.w1.weight`, ...); else names as stored, and fused
    experts from Qwen-style per-expert keys."""
    config = folder / "config.json" if folder.is_dir() else None
    mapping = experts.conversions(json.loads(config.read_text())) if config and config.exists() else None
    shapes = {k: list(v.shape) for k, v in like.items()}
    if mapping is not None:
        return experts.read_plan(list(where_of), shapes, mapping)
    fused = {
        k: src
        for k, shape in shapes.items()
        if k not in where_of and (src := experts.fused_sources(k, set(where_of), shape)) is not None
    }
    return {k: k for k in like if k in where_of}, fused


def _is_meta(t: torch.Tensor) -> bool:
    return (t.to_local() if is_dtensor(t) else t).device.type == "meta"  # type: ignore[attr-defined]


def _check_expert_shapes(
    name: str,
    shape: list[int],
    sources: list[tuple[str, list[int]]],
    headers: dict[Path, dict[str, Any]],
    where_of: dict[str, Path],
) -> None:
    """Raise `CheckpointMismatchError` when a per-expert key does not have its share of `name`'s `shape`."""
    rows = shape[1] // (len(sources) // shape[0])  # gate and up: two sources per expert
    for key, _ in sources:
        got = headers[where_of[key]][key]["shape"]
        if got != [rows, shape[2]]:
            raise CheckpointMismatchError(
                f"{key!r} in '{where_of[key]}' has shape {tuple(got)}, but {name!r} of shape {tuple(shape)} "
                f"needs ({rows}, {shape[2]}) per expert"
            )


def _read_experts(target: Target, sources: list[tuple[str, list[int]]], where_of: dict[str, Path]) -> None:
    """Fill this rank's piece of a fused expert tensor from the per-expert keys it overlaps, reading only
    the overlapping slice of each (`safe_open(...).get_slice`): the other ranks' experts are not read."""
    from safetensors import safe_open

    lo, size = target.offset, list(target.local.shape)
    by_file: dict[Path, list[tuple[str, list[int]]]] = {}
    for key, offset in sources:
        if lo[0] <= offset[0] < lo[0] + size[0]:  # one of this rank's experts
            by_file.setdefault(where_of[key], []).append((key, offset))
    for path, keys in by_file.items():
        with safe_open(str(path), framework="pt") as f:
            for key, (e, row, col) in keys:
                piece = f.get_slice(key)
                rows, cols = piece.get_shape()
                r0, r1 = max(lo[1] - row, 0), min(lo[1] + size[1] - row, rows)
                c0, c1 = max(lo[2] - col, 0), min(lo[2] + size[2] - col, cols)
                if r1 > r0 and c1 > c0:
                    target.fill(piece[r0:r1, c0:c1].unsqueeze(0), [e, row + r0, col + c0])

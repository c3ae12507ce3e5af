"""PEFT adapters (LoRA, ...): write and read them in PEFT's own folder layout, or export the merged model.

`save_adapter` writes `adapter_model.safetensors` (keys as `peft.get_peft_model_state_dict` writes them,
without the adapter name: `base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`) and
`adapter_config.json`, which `PeftModel.from_pretrained(base, path)` loads. With `merge=True` it writes the
base model with the adapter merged into its weights, in the Hugging Face layout `transformers` loads.
`load_adapter` reads such a folder (ours or PEFT's) into the adapter params of a state. Sharded (DTensor)
params are gathered on save and sliced on load, as `save_pretrained` / `load_pretrained` do.
`save_pretrained` of a PeftModel writes through here: all its adapters as `PeftModel.save_pretrained` does,
or the merged model with `merge=True`.

Example:
    >>> import tempfile, torch, accelfn as af
    >>> from peft import LoraConfig, get_peft_model
    >>> base = torch.nn.Sequential(torch.nn.Linear(4, 4))
    >>> model = get_peft_model(base, LoraConfig(r=2, target_modules=["0"]))
    >>> state = af.train_step(lambda m, b: m(b).pow(2).mean(), af.optim.adamw(1e-2)).init(model)
    >>> path = tempfile.mkdtemp() + "/adapter"
    >>> af.checkpoint.save_adapter(path, state, model)
    >>> state = af.checkpoint.load_adapter(path, like=state, model=model)
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import torch
from torch import nn

from .. import dry_mode
from .._typecheck import checked
from ..state import TrainState, check_not_donated
from . import atomic, io
from ._dist import Comm
from .format import HF_INDEX, CheckpointMismatchError, parse_size
from .leaves import alias_key
from .pretrained import _is_weight_file, gather_full, load_pretrained, write_folder, write_weights

__all__ = ["save_adapter", "load_adapter", "ADAPTER_WEIGHTS", "ADAPTER_CONFIG"]

ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"

Params = TypeVar("Params", TrainState, dict[str, torch.Tensor])


def _peft() -> Any:
    try:
        import peft
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError("PEFT adapters need the `peft` package: pip install peft") from e
    return peft


def _check_model(model: nn.Module, adapter_name: str | None, fn: str) -> str:
    peft = _peft()
    if not isinstance(model, peft.PeftModel):
        raise TypeError(
            f"{fn}(): `model` must be the PeftModel the state was made from (get_peft_model(base, config), "
            f"passed to step.init), got {type(model).__name__}"
        )
    name = adapter_name if adapter_name is not None else model.active_adapter
    if name not in model.peft_config:
        raise ValueError(
            f"{fn}(): the model has no adapter {name!r}; its adapters are {sorted(model.peft_config)}"
        )
    return str(name)


def _named(model: nn.Module, params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The model's state_dict names -> tensors, taking the state's params where they differ (not bound yet)."""
    named = dict(model.state_dict(keep_vars=True))
    for k, v in params.items():
        if k in named:
            named[k] = v
    return named


def _adapter_tensors(
    model: nn.Module, named: dict[str, torch.Tensor], adapter_name: str
) -> dict[str, torch.Tensor]:
    """`{key in PEFT's file: tensor}`: PEFT's own selection and renaming (adapter name removed), values as given."""
    out: dict[str, torch.Tensor] = _peft().get_peft_model_state_dict(
        model, state_dict=named, adapter_name=adapter_name
    )
    return out


@checked
def save_adapter(
    path: str | os.PathLike[str],
    state_or_params: TrainState | dict[str, torch.Tensor],
    model: nn.Module,
    *,
    merge: bool = False,
    adapter_name: str | None = None,
    max_shard_size: int | str = "5GB",
) -> None:
    """Write the adapter of `model` (a `PeftModel`) with the values of `state_or_params`, in PEFT's layout.

    `adapter_model.safetensors` + `adapter_config.json` (with `inference_mode=True`, as PEFT writes it);
    `PeftModel.from_pretrained(base, path)` loads it. With `merge=True`, instead the base model with the
    adapter merged into its weights (`model.safetensors` or shards, and `config.json`), which
    `AutoModel*.from_pretrained(path)` loads; the training model is left unchanged. Atomic like `save`;
    other files in an existing folder are kept. Call on every rank (sharded params are gathered to rank 0).
    """
    name = _check_model(model, adapter_name, "save_adapter")
    if isinstance(state_or_params, TrainState):
        check_not_donated(state_or_params, "af.checkpoint.save_adapter")
        params = state_or_params.params
    else:
        params = state_or_params
    named = _named(model, params)
    if dry_mode.skip(f"af.checkpoint.save_adapter({str(path)!r})"):
        return
    final = Path(path).absolute()
    if merge:
        _save_merged(final, model, named, name, parse_size(max_shard_size))
        return
    _save_adapters(final, model, named, {name: ""}, _is_adapter_file, "af.checkpoint.save_adapter")


def _is_adapter_file(name: str) -> bool:
    return name in (ADAPTER_WEIGHTS, ADAPTER_CONFIG)


def _save_adapters(
    final: Path,
    model: Any,
    named: dict[str, torch.Tensor],
    folders: dict[str, str],
    replaced: Callable[[str], bool],
    what: str,
) -> None:
    """Write each adapter of `folders` (`{adapter name: subfolder, "" for final itself}`) in PEFT's layout, in
    one atomic commit of `final`; `replaced` names the files of an existing `final` that are not kept."""
    atomic.check_replaceable(final, (ADAPTER_WEIGHTS, ADAPTER_CONFIG), keeps_others=True)
    written: list[tuple[str, dict[str, torch.Tensor], Any, dict[str, Any], dict[str, str] | None]] = []
    for name, sub in folders.items():  # the same order on every rank: gathering is a collective
        full = gather_full(_adapter_tensors(model, named, name), what)
        if full is not None:
            written.append((sub, full, *_adapter_config(model, name)))
    if written:

        def write(tmp: Path) -> None:
            for sub, full, config, changed, auto_mapping in written:
                folder = tmp / sub if sub else tmp
                folder.mkdir(exist_ok=True)
                io.write_file(folder / ADAPTER_WEIGHTS, full, {"format": "pt"})
                _write_config(folder, config, changed, auto_mapping)
                io.fsync_path(folder / ADAPTER_CONFIG)
                if sub:
                    io.fsync_path(folder)

        write_folder(final, write, replaced)
    Comm().barrier()


def _adapter_config(model: Any, name: str) -> tuple[Any, dict[str, Any], dict[str, str] | None]:
    """The adapter's config, the fields `PeftModel.save_pretrained` changes before writing it, and its
    `auto_mapping` (or None). The config object itself is written (not a copy): its sets (`target_modules`)
    then list in the order PEFT writes them, which a copied set need not keep."""
    config = model.peft_config[name]
    changed: dict[str, Any] = {"inference_mode": True}  # as PeftModel.save_pretrained writes it
    base_model = model.get_base_model()
    if getattr(config, "base_model_name_or_path", None) is None:  # as PEFT: the base's name, else None
        base_config = getattr(base_model, "config", None)
        changed["base_model_name_or_path"] = getattr(base_config, "_name_or_path", None) or None
    # as PeftModel.save_pretrained: without a task_type, AutoPeftModel finds the base class from this
    auto_mapping = None
    if getattr(config, "task_type", None) is None:
        base_class = type(base_model)
        auto_mapping = {"base_model_class": base_class.__name__, "parent_library": base_class.__module__}
    return config, changed, auto_mapping


def _write_config(
    folder: Path, config: Any, changed: dict[str, Any], auto_mapping: dict[str, str] | None
) -> None:
    """`config.save_pretrained(folder)` with the fields of `changed` set while it writes, then restored."""
    before = {key: getattr(config, key) for key in changed}
    try:
        for key, value in changed.items():
            setattr(config, key, value)
        config.save_pretrained(folder, auto_mapping_dict=auto_mapping)
    finally:
        for key, value in before.items():
            setattr(config, key, value)


def is_peft_model(model: Any) -> bool:
    """Whether `model` is a `peft.PeftModel` (without importing peft where nothing did: no PeftModel then)."""
    peft = sys.modules.get("peft")
    return peft is not None and isinstance(model, peft.PeftModel)


def save_peft_pretrained(
    final: Path, params: dict[str, torch.Tensor], model: Any, merge: bool, size: int
) -> None:
    """`save_pretrained` of a PeftModel: its adapters as `PeftModel.save_pretrained` writes them ("default" in
    `final`, any other in `final/<name>`), or with `merge` the base model with the active adapter merged. The
    model files of an earlier save in `final` go: transformers would load them as the base of the adapter."""
    name = _check_model(model, None, "save_pretrained")
    named = _named(model, params)
    if merge:
        _save_merged(final, model, named, name, size)
        return
    folders = {n: "" if n == "default" else n for n in model.peft_config}
    _save_adapters(
        final,
        model,
        named,
        folders,
        lambda f: _is_adapter_file(f) or _is_weight_file(f) or f == "config.json",
        "af.checkpoint.save_pretrained",
    )


def _save_merged(final: Path, model: Any, named: dict[str, torch.Tensor], adapter: str, size: int) -> None:
    base = model.get_base_model()
    prefix = next(n for n, m in model.named_modules() if m is base)  # "base_model.model"
    atomic.check_replaceable(final, ("model.safetensors", HF_INDEX, "config.json"), keeps_others=True)
    # gather every tensor once (tied ones share one full tensor), in the same order on every rank
    unique: dict[Any, str] = {}
    for k, t in named.items():
        unique.setdefault(alias_key(t), k)
    gathered = gather_full({k: named[k] for k in unique.values()}, "af.checkpoint.save_adapter(merge=True)")
    if gathered is not None:
        full = {k: gathered[unique[alias_key(t)]] for k, t in named.items()}
        merged = _merge_on_host(model, base, prefix, full, adapter)
        config = _untied_if_diverged(getattr(base, "config", None), merged, base)
        write_folder(final, lambda tmp: write_weights(tmp, merged, size, config, base), _is_weight_file)
    Comm().barrier()


def _untied_if_diverged(config: Any, merged: dict[str, torch.Tensor], base: Any) -> Any:
    """`config`, or a copy with `tie_word_embeddings=False` when the merge gave the tied input and output
    embeddings different values (an adapter on `lm_head` or `embed_tokens` of a tied model): a loader that
    re-ties them (older transformers, vLLM, ...) would otherwise drop one of the merged weights."""
    if (
        config is None
        or not getattr(config, "tie_word_embeddings", False)
        or not hasattr(base, "get_input_embeddings")
    ):
        return config
    inputs, outputs = base.get_input_embeddings(), base.get_output_embeddings()
    if inputs is None or outputs is None:
        return config
    names = {id(m): n for n, m in base.named_modules()}
    tied = [merged.get(f"{names[id(m)]}.weight") for m in (inputs, outputs) if id(m) in names]
    if len(tied) < 2 or tied[0] is None or tied[1] is None or torch.equal(tied[0], tied[1]):
        return config
    config = copy.deepcopy(config)
    config.tie_word_embeddings = False
    text = config.get_text_config() if hasattr(config, "get_text_config") else None
    if text is not None and text is not config and hasattr(text, "tie_word_embeddings"):
        text.tie_word_embeddings = False
    return config


def _merge_on_host(
    model: nn.Module, base: nn.Module, prefix: str, full: dict[str, torch.Tensor], adapter: str
) -> dict[str, torch.Tensor]:
    """The merged base model's state dict, from full tensors: PEFT's own `layer.merge` runs on copies of the
    base weights swapped into the modules for the moment, so every PEFT method that can merge is supported
    and the training model (and its state) is untouched."""
    peft = _peft()
    tuners = {n: m for n, m in base.named_modules() if isinstance(m, peft.tuners.tuners_utils.BaseTunerLayer)}
    wrappers = {n: m for n, m in base.named_modules() if isinstance(m, peft.utils.other.ModulesToSaveWrapper)}
    if not tuners:
        raise ValueError("save_adapter(merge=True): the model has no adapter layers to merge")
    base_layers = {id(m.get_base_layer()) for m in tuners.values()}
    with _swapped(model, full, clone=base_layers), torch.no_grad():
        for layer in tuners.values():
            saved = (list(layer.merged_adapters), dict(getattr(layer, "_caches", {})))
            try:
                layer.merge(safe_merge=False, adapter_names=[adapter])
            finally:
                layer.merged_adapters[:] = saved[0]
                if hasattr(layer, "_caches"):
                    layer._caches.clear()
                    layer._caches.update(saved[1])
        merged: dict[str, torch.Tensor] = {}
        for name, t in base.state_dict(keep_vars=True).items():
            out = _base_name(name, tuners, wrappers, adapter)
            if out is not None:
                merged[out] = t.detach()
    return merged


def _base_name(name: str, tuners: dict[str, Any], wrappers: dict[str, Any], adapter: str) -> str | None:
    """The name `merge_and_unload()` would give `name` (a base-model state_dict key), None if it drops it."""
    owner = max((p for p in [*tuners, *wrappers] if name.startswith(p + ".")), key=len, default=None)
    if owner is None:
        return name
    rest = name[len(owner) + 1 :]
    if owner in tuners:
        keep = "base_layer."
    elif adapter in getattr(wrappers[owner], "modules_to_save", {}):
        keep = f"modules_to_save.{adapter}."
    else:  # another adapter's modules_to_save: this adapter keeps the original module
        keep = "original_module."
    return f"{owner}.{rest[len(keep) :]}" if rest.startswith(keep) else None


@contextlib.contextmanager
def _swapped(model: nn.Module, full: dict[str, torch.Tensor], clone: set[int]) -> Iterator[None]:
    """Put the full tensors into `model`'s modules (copies in the modules listed in `clone`), then restore."""
    saved: list[tuple[dict[str, Any], str, Any]] = []
    try:
        for mod_name, mod in model.named_modules(remove_duplicate=False):
            for store in (mod._parameters, mod._buffers):
                for attr, old in list(store.items()):
                    key = f"{mod_name}.{attr}" if mod_name else attr
                    if old is None or key not in full:
                        continue
                    t = full[key].clone() if id(mod) in clone else full[key]
                    saved.append((store, attr, old))
                    store[attr] = nn.Parameter(t, requires_grad=False) if isinstance(old, nn.Parameter) else t
        yield
    finally:
        for store, attr, old in reversed(saved):
            store[attr] = old


# adapter settings that change what the same weights compute (the scaling, the layers adapted, their layout)
_MATH_KEYS = ("r", "lora_alpha", "use_rslora", "use_dora", "fan_in_fan_out", "target_modules", "alpha_pattern",
              "rank_pattern", "layers_to_transform", "layers_pattern")  # fmt: skip


def _check_config(folder: Path, saved: dict[str, Any], config: Any, name: str) -> None:
    """Refuse an adapter whose adapter_config.json differs from the model's adapter where it changes the result
    (PEFT's own loader builds the adapter from the saved config; here the model's adapter exists already)."""
    ours = config.to_dict()

    def norm(v: Any) -> Any:
        return sorted(v) if isinstance(v, (list, tuple, set)) else v

    differ = [
        k for k in _MATH_KEYS if saved.get(k) is not None and k in ours and norm(saved[k]) != norm(ours[k])
    ]  # (a key the saved file leaves out or null: not compared)
    if differ:
        parts = ", ".join(f"{k}: saved {saved[k]!r}, model {ours[k]!r}" for k in differ)
        raise CheckpointMismatchError(
            f"the adapter at '{folder}' was trained with other settings than the model's adapter {name!r} ({parts}): "
            "its weights would compute something else. Build the model with the saved adapter_config.json "
            "(peft.PeftConfig.from_pretrained(path))"
        )


@checked
def load_adapter(
    path: str | os.PathLike[str], like: Params, model: nn.Module, *, adapter_name: str | None = None
) -> Params:
    """Read a PEFT adapter folder (`save_adapter`'s or `PeftModel.save_pretrained`'s) into the adapter params of
    `like` (a `TrainState` or its params, of `model`, a `PeftModel`); returns it with the values loaded.

    The values are copied into `like`'s tensors in place (cast to their dtype, sliced to their DTensor
    shard), as `load_pretrained` does; the other params (the frozen base) are left as they are. A missing
    or unexpected adapter key, or a different shape (another rank `r`), raises `CheckpointMismatchError`.
    """
    name = _check_model(model, adapter_name, "load_adapter")
    folder = Path(path)
    weights = folder / ADAPTER_WEIGHTS
    if not weights.exists():
        if (folder / "adapter_model.bin").exists():
            raise ValueError(
                f"'{folder}' holds a pickled adapter_model.bin; only {ADAPTER_WEIGHTS} is read (no pickle)"
            )
        raise FileNotFoundError(f"no adapter at '{folder}': {ADAPTER_WEIGHTS} is missing")
    config_file = folder / ADAPTER_CONFIG
    if config_file.exists():
        saved_config = json.loads(config_file.read_text())
        stored = saved_config.get("peft_type")
        peft_model: Any = model
        ours = str(peft_model.peft_config[name].peft_type.value)
        if stored is not None and stored != ours:
            raise CheckpointMismatchError(
                f"the adapter at '{folder}' is a {stored} adapter, the model's {name!r} is {ours}"
            )
        _check_config(folder, saved_config, peft_model.peft_config[name], name)
    params = like.params if isinstance(like, TrainState) else like
    named = _named(model, params)
    names = {id(v): k for k, v in params.items()}
    keys = _adapter_tensors(model, named, name)
    targets: dict[str, torch.Tensor] = {}
    where: dict[str, str] = {}
    for key, t in keys.items():
        if id(t) not in names:
            raise CheckpointMismatchError(
                f"load_adapter(): adapter tensor {key!r} is not among the params of `like`"
            )
        targets[key], where[key] = params[names[id(t)]], names[id(t)]
    try:
        loaded = load_pretrained(weights, like=targets)
    except CheckpointMismatchError as e:  # load_pretrained's own hint (strict=False) is not an option here
        text = str(e).replace(" (pass strict=False to ignore unexpected ones)", "")
        raise CheckpointMismatchError(
            f"load_adapter(): {text}: the adapter at '{folder}' and the model's adapter {name!r} cover different "
            "layers (compare target_modules in its adapter_config.json with the model's LoraConfig)"
        ) from None
    new = {**params, **{where[k]: v for k, v in loaded.items()}}
    return like.replace(params=new) if isinstance(like, TrainState) else new  # type: ignore[return-value]

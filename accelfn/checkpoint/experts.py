"""Hugging Face's per-expert layout of mixture-of-experts weights, to and from transformers' fused tensors.

transformers 5 trains fused experts (`mlp.experts.gate_up_proj [E, 2F, D]`, `mlp.experts.down_proj [E, D, F]`)
but, for the model types its `conversion_mapping` converts, saves and loads them per expert: Qwen2/3-MoE,
OLMoE, DeepSeek-V3 as `mlp.experts.{e}.gate_proj.weight [F, D]`, `up_proj`, `down_proj`; Mixtral, PhiMoE,
MiniMax as `block_sparse_moe.experts.{e}.w1.weight` (gate), `w3` (up), `w2` (down), their routers renamed too.
`conversions` finds that mapping for a config; `to_hf` writes a state in its layout (transformers' own
reverse conversion); `read_plan` says where each fused (possibly `Shard(0)` over `ep`) tensor's pieces lie
among a checkpoint's per-expert keys, so that a rank reads only the slices of its own experts.

Example:
    >>> from transformers import MixtralConfig
    >>> moe = "model.layers.0.block_sparse_moe."  # Mixtral's names on disk: w1 (gate), w3 (up), w2 (down)
    >>> renamed, fused = read_plan(
    ...     [moe + "gate.weight", moe + "experts.0.w3.weight", moe + "experts.0.w1.weight"],
    ...     {"model.layers.0.mlp.gate.weight": [1, 4], "model.layers.0.mlp.experts.gate_up_proj": [1, 16, 4]},
    ...     conversions(MixtralConfig()),
    ... )
    >>> renamed
    {'model.layers.0.mlp.gate.weight': 'model.layers.0.block_sparse_moe.gate.weight'}
    >>> fused["model.layers.0.mlp.experts.gate_up_proj"]  # (key, where its rows go: [expert, row, col])
    [('model.layers.0.block_sparse_moe.experts.0.w1.weight', [0, 0, 0]), ('model.layers.0.block_sparse_moe.experts.0.w3.weight', [0, 8, 0])]
"""

from __future__ import annotations

import re
from typing import Any

import torch

__all__ = ["conversions", "splits_experts", "to_hf", "read_plan", "fused_sources"]

FUSED = re.compile(r"^(?P<prefix>.*\.)?experts\.(?P<kind>gate_up_proj|down_proj)$")
EXPERT_INDEX = re.compile(r"experts\.(\d+)\.")


def _config_names(config: Any) -> list[str]:
    """The names transformers looks a conversion mapping up by: the class `architectures` names, the model type
    (a `PretrainedConfig` or the dict of a `config.json`)."""
    get = config.get if isinstance(config, dict) else lambda k: getattr(config, k, None)
    archs = get("architectures") or []
    return [*([archs[0]] if len(archs) == 1 else []), *([get("model_type")] if get("model_type") else [])]


def _is_stacking(conv: Any) -> bool:
    """Whether a transformers `WeightConverter` stacks per-expert keys into one fused tensor the way this module
    reads: `MergeModulelist(dim=0)` (experts on dim 0), then for two sources `Concatenate(dim=1)` (gate, up)."""
    ops = [(type(o).__name__, getattr(o, "dim", None)) for o in getattr(conv, "operations", ())]
    n = len(conv.source_patterns)
    want = [("MergeModulelist", 0)] + ([("Concatenate", 1)] if n > 1 else [])
    return ops == want and all("experts.*." in p.replace("\\", "") for p in conv.source_patterns)


def conversions(config: Any) -> list[Any] | None:
    """transformers' checkpoint conversion mapping for `config`'s model (a config or a `config.json` dict)
    where it stores fused experts per expert, and every converter in it is such a stacking (so both directions
    are known here); None otherwise (the weights are written and read under their own names)."""
    if config is None:
        return None
    try:
        from transformers.conversion_mapping import get_checkpoint_conversion_mapping
        from transformers.core_model_loading import WeightConverter
    except ImportError:  # pragma: no cover - transformers 4 loads fused experts as saved
        return None
    for name in _config_names(config):
        mapping = get_checkpoint_conversion_mapping(name)
        if not mapping:
            continue
        converters = [c for c in mapping if isinstance(c, WeightConverter)]
        if converters and all(_is_stacking(c) for c in converters):
            return list(mapping)
        return None
    return None


def splits_experts(config: Any) -> bool:
    """Whether transformers' own `save_pretrained` of a model with this config writes its fused experts per
    expert, in a layout this module converts (Qwen2/3-MoE, OLMoE, DeepSeek-V3, Mixtral, PhiMoE, ...)."""
    return conversions(config) is not None


def to_hf(full: dict[str, torch.Tensor], model: Any) -> dict[str, torch.Tensor]:
    """`full` (whole tensors under the trained names of the transformers model `model`, which may be on the meta
    device) in the layout transformers' own `save_pretrained` writes: its reverse conversion (per-expert
    keys, the renames undone). Views where it can."""
    from transformers.core_model_loading import revert_weight_conversion

    return dict(revert_weight_conversion(model, full))


def read_plan(
    keys: list[str], shapes: dict[str, list[int]], mapping: list[Any]
) -> tuple[dict[str, str], dict[str, list[tuple[str, list[int]]]]]:
    """Where a checkpoint's `keys` go, as transformers' `from_pretrained` renames them with `mapping`, for the
    tensors of global `shapes` (trained names): `renamed` (trained name -> key, for keys read whole; only
    those renamed or kept whose name is in `shapes`) and `fused` (fused expert name -> `(key, offset of that key's
    [rows, cols] in it)`, every expert's pieces, in order; a name lacking any piece is left out)."""
    from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key

    renamings = [c for c in mapping if isinstance(c, WeightRenaming)]
    converters = [c for c in mapping if isinstance(c, WeightConverter)]
    parts = {p: (i, len(c.source_patterns)) for c in converters for i, p in enumerate(c.source_patterns)}
    renamed: dict[str, str] = {}
    pieces: dict[
        str, tuple[int, dict[tuple[int, int], str]]
    ] = {}  # name -> (sources, (expert, source) -> key)
    for key in keys:
        name, pattern = rename_source_key(key, renamings, converters)
        if pattern is None:
            if name in shapes:
                renamed[name] = key
            continue
        index = EXPERT_INDEX.findall(key)
        if name in shapes and index:
            part, n = parts[pattern]
            pieces.setdefault(name, (n, {}))[1][(int(index[-1]), part)] = key
    fused: dict[str, list[tuple[str, list[int]]]] = {}
    for name, (n, got) in pieces.items():
        shape = shapes[name]
        if len(shape) != 3:
            continue
        want = [(e, p) for e in range(shape[0]) for p in range(n)]
        if all(w in got for w in want):
            fused[name] = [(got[(e, p)], [e, p * (shape[1] // n), 0]) for e, p in want]
    return renamed, fused


def fused_sources(name: str, keys: set[str], shape: list[int]) -> list[tuple[str, list[int]]] | None:
    """Where the fused expert tensor `name` (global `shape`) lies among the per-expert `keys` (Qwen naming) of
    a checkpoint without a `config.json`: `(key, offset of that key's [rows, cols] in the fused tensor)` for
    every expert; None when `name` is not a fused expert tensor or `keys` lack one of its pieces."""
    m = FUSED.match(name)
    if m is None or len(shape) != 3:
        return None
    prefix = m["prefix"] or ""
    projs = (
        [("gate_proj", 0), ("up_proj", shape[1] // 2)] if m["kind"] == "gate_up_proj" else [("down_proj", 0)]
    )
    out = [
        (f"{prefix}experts.{e}.{proj}.weight", [e, row, 0]) for e in range(shape[0]) for proj, row in projs
    ]
    return out if all(k in keys for k, _ in out) else None

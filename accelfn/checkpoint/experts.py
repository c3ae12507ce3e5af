"""Hugging Face's per-expert layout of mixture-of-experts weights, to and from transformers' fused tensors.

transformers 5 trains fused experts (`mlp.experts.gate_up_proj [E, 2F, D]`, `mlp.experts.down_proj [E, D, F]`)
but, for the model types its `conversion_mapping` converts, saves and loads them per expert
(`mlp.experts.{e}.gate_proj.weight [F, D]`, `up_proj.weight [F, D]`, `down_proj.weight [D, F]`). `split` writes
that layout; `ExpertSource` reads a rank's piece of a fused (possibly `Shard(0)` over `ep`) tensor from it, one
expert slice at a time, without reading the other ranks' experts.

Example:
    >>> import torch
    >>> full = {"mlp.experts.gate_up_proj": torch.arange(8.0).view(1, 4, 2)}
    >>> {k: v.tolist() for k, v in split(full).items()}
    {'mlp.experts.0.gate_proj.weight': [[0.0, 1.0], [2.0, 3.0]], 'mlp.experts.0.up_proj.weight': [[4.0, 5.0], [6.0, 7.0]]}
"""

from __future__ import annotations

import re
from typing import Any

import torch

__all__ = ["splits_experts", "split", "fused_sources", "PER_EXPERT"]

FUSED = re.compile(r"^(?P<prefix>.*\.)?experts\.(?P<kind>gate_up_proj|down_proj)$")
PER_EXPERT = re.compile(
    r"^(?P<prefix>.*\.)?experts\.(?P<e>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$"
)


def splits_experts(config: Any) -> bool:
    """Whether transformers' own `save_pretrained` of a model with this config writes its fused experts per
    expert: its checkpoint conversion mapping for the model type joins `mlp.experts.*.gate_proj/up_proj` into
    `mlp.experts.gate_up_proj` (Qwen2/3-MoE, OLMoE, DeepSeek-V3, ...), with no other rename of those keys."""
    model_type = getattr(config, "model_type", None)
    if not model_type:
        return False
    try:
        from transformers.conversion_mapping import get_checkpoint_conversion_mapping
    except ImportError:  # pragma: no cover - transformers 4 loads fused experts as saved
        return False
    for conv in get_checkpoint_conversion_mapping(model_type) or ():
        sources = [str(p) for p in getattr(conv, "source_patterns", None) or []]
        targets = [str(t) for t in getattr(conv, "target_patterns", None) or []]
        if sources == ["mlp.experts.*.gate_proj.weight", "mlp.experts.*.up_proj.weight"] and targets == [
            "mlp.experts.gate_up_proj"
        ]:
            return True
    return False  # other renames (Mixtral's block_sparse_moe.experts.*.w1, ...) are not written: see the docs


def split(full: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`full` with each fused expert tensor replaced by its per-expert weights (views, in order), as
    transformers writes them: `gate_up_proj[e]` is `cat([gate_proj.weight, up_proj.weight])`, `down_proj[e]`
    is `down_proj.weight`."""
    out: dict[str, torch.Tensor] = {}
    for name, t in full.items():
        m = FUSED.match(name)
        if m is None or t.ndim != 3:
            out[name] = t
            continue
        prefix = m["prefix"] or ""
        for e in range(t.shape[0]):
            if m["kind"] == "gate_up_proj":
                if t.shape[1] % 2:
                    raise ValueError(f"{name!r} has shape {tuple(t.shape)}: dim 1 (gate and up) is not even")
                gate, up = t[e].chunk(2, dim=0)
                out[f"{prefix}experts.{e}.gate_proj.weight"] = gate.contiguous()
                out[f"{prefix}experts.{e}.up_proj.weight"] = up.contiguous()
            else:
                out[f"{prefix}experts.{e}.down_proj.weight"] = t[e].contiguous()
    return out


def fused_sources(name: str, keys: set[str], shape: list[int]) -> list[tuple[str, list[int]]] | None:
    """Where the fused expert tensor `name` (global `shape`) lies among the per-expert `keys` of a checkpoint:
    `(key, offset of that key's [rows, cols] in the fused tensor)` for every expert; None when `name` is not a
    fused expert tensor or `keys` lack one of its pieces."""
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

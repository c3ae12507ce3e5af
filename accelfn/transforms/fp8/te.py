"""Transformer Engine backend of `af.autocast_fp8` (NVIDIA only; imported lazily).

Written against TE's documented API (`transformer_engine.pytorch.Linear`, `fp8_autocast`,
`transformer_engine.common.recipe.DelayedScaling`); tested here with a fake module, not on real TE.
"""

from __future__ import annotations

import contextlib
import importlib
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

if TYPE_CHECKING:
    from ...engine import Plan
    from . import ModuleFilter


def _te() -> Any:
    try:
        return importlib.import_module("transformer_engine.pytorch")
    except ImportError as e:
        raise ImportError(
            "autocast_fp8(backend='te') needs NVIDIA Transformer Engine: pip install 'accelfn[te]' on a CUDA "
            "machine (or use backend='torchao')"
        ) from e


def _recipe(name: str | None) -> Any:
    recipe_mod = importlib.import_module("transformer_engine.common.recipe")
    if name in (None, "delayed"):
        return recipe_mod.DelayedScaling(
            fp8_format=recipe_mod.Format.HYBRID, amax_history_len=16, amax_compute_algo="max"
        )
    if name in ("current", "tensorwise"):
        return recipe_mod.Float8CurrentScaling()
    raise ValueError(f"autocast_fp8(backend='te'): recipe must be 'delayed' or 'current', got {name!r}")


def convert(plan: Plan, keep: ModuleFilter, recipe_name: str | None) -> int:
    """Swap eligible `nn.Linear` for `te.Linear` (weights copied) and run the forward under fp8_autocast."""
    te = _te()
    recipe = _recipe(recipe_name)
    swapped = 0
    for fqn, module in list(plan.module.named_modules()):
        for child_name, child in list(module.named_children()):
            full = f"{fqn}.{child_name}" if fqn else child_name
            if isinstance(child, nn.Linear) and keep(child, full):
                # TE layers live where the model will compute (a host-built model moves there under af.shard)
                device = plan.device if child.weight.device.type in ("cpu", "meta") else child.weight.device
                new = te.Linear(
                    child.in_features,
                    child.out_features,
                    bias=child.bias is not None,
                    params_dtype=child.weight.dtype,
                    device=device,
                )
                with torch.no_grad():
                    new.weight.copy_(child.weight)
                    if child.bias is not None:
                        new.bias.copy_(child.bias)
                setattr(module, child_name, new)
                swapped += 1
    # amax is reduced over the processes that see different tokens (TE's fp8_group); None: this process
    shard = next((t for t in plan.transforms if t.kind == "shard"), None)
    group = shard.mesh.grad_group() if shard is not None and shard.mesh.grad_size > 1 else None
    plan.forward_contexts.append(
        lambda: (
            te.fp8_autocast(enabled=True, fp8_recipe=recipe, fp8_group=group)
            if hasattr(te, "fp8_autocast")
            else contextlib.nullcontext()
        )
    )
    return swapped


def extra_state(module: nn.Module) -> dict[str, Any]:
    """TE's per-module FP8 scaling state (amax history, scales), to keep in `state.extra`."""
    return {
        name: m.get_extra_state()
        for name, m in module.named_modules()
        if type(m).__module__.startswith("transformer_engine") and hasattr(m, "get_extra_state")
    }

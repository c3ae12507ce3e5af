"""A `transformers` MoE model's experts in autocast's dtype when it runs them itself (no `ep` axis).

`transformers`' `grouped_mm` experts cast the rows to the weights' dtype (`torch._grouped_mm` is not autocast-
enabled, pytorch#174763), so fp32 master weights under `af.autocast(step, "bf16")` ask for an fp32 grouped GEMM,
which CUDA's kernel refuses (bf16 only); its `batched_mm` gathers every row's expert weights (1.6 TB for
Qwen3-235B at 4,096 tokens). `grouped_mm_in_autocast_dtype(model)` makes the experts cast their weights to
autocast's dtype for the call instead, as autocast does for a Linear's weight (the fp32 gradients flow back
through the cast). With an `ep` axis accelfn's own experts forward does this already (`accelfn.moe.experts`).

Example:
    >>> import torch
    >>> from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
    >>> from accelfn.moe.autocast_experts import grouped_mm_in_autocast_dtype
    >>> cfg = Qwen3MoeConfig(vocab_size=32, hidden_size=16, intermediate_size=32, moe_intermediate_size=16,
    ...                      num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2, num_experts=4,
    ...                      num_experts_per_tok=2, head_dim=8)
    >>> model = Qwen3MoeForCausalLM(cfg)
    >>> grouped_mm_in_autocast_dtype(model)
    >>> model.config._experts_implementation
    'accelfn_autocast_grouped_mm'
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["NAME", "grouped_mm_in_autocast_dtype"]

NAME = "accelfn_autocast_grouped_mm"
_CAST = ("gate_up_proj", "up_proj", "down_proj", "gate_up_proj_bias", "up_proj_bias", "down_proj_bias")


class _InDtype:
    """The experts module as `transformers`' experts forward reads it, its weights cast to `dtype`."""

    def __init__(self, experts: torch.nn.Module, dtype: torch.dtype) -> None:
        self._experts = experts
        for name in _CAST:
            value = getattr(experts, name, None)
            if isinstance(value, torch.Tensor) and value.is_floating_point():
                setattr(self, name, value.to(dtype))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._experts, name)


def _forward(
    self: torch.nn.Module, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
):  # type: ignore[no-untyped-def]
    from transformers.integrations.moe import grouped_mm_experts_forward

    device = hidden.device.type
    if torch.is_autocast_enabled(device):
        dtype = torch.get_autocast_dtype(device)
        return grouped_mm_experts_forward(_InDtype(self, dtype), hidden.to(dtype), top_k_index, top_k_weights)  # type: ignore[arg-type]
    return grouped_mm_experts_forward(self, hidden, top_k_index, top_k_weights)


def grouped_mm_in_autocast_dtype(model: torch.nn.Module) -> None:
    """Run `model`'s experts (a `transformers` MoE model) as `grouped_mm` in autocast's dtype (see the module)."""
    from transformers.integrations.moe import ExpertsInterface

    ExpertsInterface.register(NAME, _forward)
    set_impl = getattr(model, "set_experts_implementation", None)
    if set_impl is None:
        raise ValueError(
            f"{type(model).__name__} is not a transformers model with experts (no set_experts_implementation)"
        )
    set_impl(NAME)

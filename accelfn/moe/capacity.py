"""Expert capacity with token dropping (GShard/Switch; Megatron's `moe_expert_capacity_factor`), set on a model's
experts modules: optional, dropless stays the default.

`set_capacity(model, capacity_factor)` marks every experts module of the model's expert-parallel plan (its own,
`config.base_model_ep_plan`, or `ep_plan`): each expert takes at most `ceil(capacity_factor * rows / E)` rows of
the global batch (rows: tokens x top-k over every data-parallel rank, per micro-batch), first come first served
in the global batch's order; a dropped choice adds zero (the token keeps its residual). In one process the
experts' forward becomes the dispatching one over one rank, so one process is the reference; under `af.shard`
with an `ep` axis the ep dispatcher takes the factor and `metrics["moe_dropped"]` is the dropped fraction.

Example (one process, a tiny Qwen3-MoE; a factor this small drops most choices):
    >>> import torch
    >>> from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
    >>> from accelfn.moe import set_capacity, step_metrics
    >>> cfg = Qwen3MoeConfig(vocab_size=32, hidden_size=16, intermediate_size=32, moe_intermediate_size=8,
    ...                      num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, num_experts=4,
    ...                      num_experts_per_tok=2)
    >>> _ = torch.manual_seed(0)
    >>> model = Qwen3MoeForCausalLM(cfg)
    >>> dispatchers = set_capacity(model, 0.25)
    >>> _ = model(input_ids=torch.randint(0, 32, (2, 8)))  # 32 rows, 2 per expert kept
    >>> step_metrics(dispatchers)["moe_dropped"].item()
    0.75
"""

from __future__ import annotations

import functools
from collections.abc import Mapping

from torch import nn

from .dispatch import AllToAllDispatcher
from .experts import ep_forward

__all__ = ["set_capacity", "CAPACITY"]

CAPACITY = "moe_capacity_factor"  # the experts module's attribute that expert parallel's lowering reads


def set_capacity(
    model: nn.Module, capacity_factor: float, ep_plan: Mapping[str, str] | None = None
) -> list[AllToAllDispatcher]:
    """Drop rows over `capacity_factor` in every experts module of `model` (see the module docs). Call before
    `step.init(model)`. Returns the one-process dispatchers, one per experts module (`step_metrics(them)` gives the
    dropped fraction without expert parallel; under `af.shard` with an `ep` axis, the step's metrics carry it).
    ValueError: a model without an expert-parallel plan, a factor that is not a number > 0."""
    from ..transforms.shard.expert_parallel import expert_params, model_ep_plan

    plan = dict(ep_plan) if ep_plan is not None else model_ep_plan(model)
    if plan is None:
        raise ValueError(
            f"set_capacity: {type(model).__name__} has no expert-parallel plan (config.base_model_ep_plan); pass "
            "ep_plan={'layers.*.experts.w': 'grouped_gemm', 'layers.*.experts': 'ep_dispatch_experts'}"
        )
    owners: dict[str, int] = {}
    for name, owner in expert_params(model, plan).items():
        owners.setdefault(owner, model.get_parameter(name).shape[0])
    out = []
    for owner, experts in owners.items():
        dispatcher = AllToAllDispatcher(None, experts, 1, capacity_factor=capacity_factor)
        module = model.get_submodule(owner)
        setattr(module, CAPACITY, float(capacity_factor))
        module.forward = functools.partial(ep_forward, module, dispatcher)  # type: ignore[method-assign]
        out.append(dispatcher)
    return out

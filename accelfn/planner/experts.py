"""How many experts a script's model has per MoE layer: what lets the planner add an `ep` axis.

The planner's probe (a one-process dry run of the script) sees the model the script builds (`dry_run(on_model=...)`);
`count_experts` reads it as expert parallel's lowering does: the model's own ep plan (`transformers`'
`config.base_model_ep_plan`), the parameters it stacks over experts (`grouped_gemm`, experts on dim 0). A model
without a plan, or whose plan matches nothing, has none (0): its script gets no `ep` candidates.

Example:
    >>> from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
    >>> cfg = Qwen3MoeConfig(vocab_size=32, hidden_size=16, intermediate_size=32, moe_intermediate_size=8,
    ...                      num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, num_experts=4,
    ...                      num_experts_per_tok=2)
    >>> count_experts(Qwen3MoeForCausalLM(cfg)), count_experts(nn.Linear(2, 2))
    (4, 0)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn

__all__ = ["count_experts", "recording_experts"]


def count_experts(model: nn.Module) -> int:
    """The experts of each MoE layer of `model` (the fewest, if its layers differ), 0 without an ep plan."""
    from ..transforms.shard.expert_parallel import expert_params, model_ep_plan

    plan = model_ep_plan(model)
    if not plan:
        return 0
    try:
        stacked = expert_params(model, plan)
    except ValueError:  # the plan names nothing of this model (e.g. its MoE layers cut away)
        return 0
    sizes = [model.get_parameter(name).shape[0] for name in stacked]
    return int(min(sizes)) if sizes else 0


def recording_experts(
    hook: Callable[[nn.Module], None] | None, seen: dict[str, Any]
) -> Callable[[nn.Module], None]:
    """A `dry_run(on_model=...)` hook that records `count_experts(model)` in `seen["experts"]`, then runs `hook`.

    Example:
        >>> seen = {}
        >>> recording_experts(None, seen)(nn.Linear(2, 2)); seen
        {'experts': 0}
    """

    def record(model: nn.Module) -> None:
        seen["experts"] = count_experts(model)
        if hook is not None:
            hook(model)

    return record

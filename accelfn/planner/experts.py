"""How many experts a script's model has per MoE layer, and their bytes: what lets the planner add an `ep` axis.

The planner's probe (a one-process dry run of the script) sees the model the script builds (`dry_run(on_model=...)`);
`count_experts` reads it as expert parallel's lowering does: the plan the script gives `af.shard(..., ep_plan=)`
(recorded by `af.shard` in `expert_parallel.GIVEN`, as `launch_env.ASKED` records the knobs a script asks for),
else the model's own (`transformers`' `config.base_model_ep_plan`); the parameters it stacks over experts
(`grouped_gemm`, experts on dim 0). A model without a plan, or whose plan matches nothing, has none (0): its
script gets no `ep` candidates. `expert_bytes` is the bytes of those parameters: the part of the model's states
that expert parallel splits more finely than the dense layers (the planner's states bound, `prune.States`).

Example:
    >>> from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
    >>> cfg = Qwen3MoeConfig(vocab_size=32, hidden_size=16, intermediate_size=32, moe_intermediate_size=8,
    ...                      num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, num_experts=4,
    ...                      num_experts_per_tok=2)
    >>> count_experts(Qwen3MoeForCausalLM(cfg)), count_experts(nn.Linear(2, 2))
    (4, 0)
    >>> expert_bytes(Qwen3MoeForCausalLM(cfg))  # 4 experts x (2 x 8 x 16 + 16 x 8) fp32
    6144
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from torch import nn

__all__ = ["count_experts", "expert_bytes", "moe_shape", "recording_shapes"]


def _stacked(model: nn.Module, plan: Mapping[str, str] | None) -> list[nn.Parameter]:
    """The params `plan` (default: the model's own) stacks over experts; none without a plan or a match of the
    model's own plan; a ValueError naming the entry of a given `plan` that does not fit the model."""
    from ..transforms.shard.expert_parallel import expert_params, model_ep_plan

    if plan is not None:  # the script's own: one that does not fit its model is its error, named
        stacked = expert_params(model, plan)
    else:
        own = model_ep_plan(model)
        if not own:
            return []
        try:
            stacked = expert_params(model, own)
        except ValueError:  # the plan names nothing of this model (e.g. its MoE layers cut away)
            return []
    return [model.get_parameter(name) for name in stacked]


def count_experts(model: nn.Module, plan: Mapping[str, str] | None = None) -> int:
    """The experts of each MoE layer of `model` under `plan` (default: its own; the fewest, if its layers
    differ), 0 without a plan."""
    sizes = [p.shape[0] for p in _stacked(model, plan)]
    return int(min(sizes)) if sizes else 0


def expert_bytes(model: nn.Module, plan: Mapping[str, str] | None = None) -> int:
    """The bytes of `model`'s params stacked over experts under `plan` (default: its own), 0 without a plan."""
    return sum(p.numel() * p.element_size() for p in _stacked(model, plan))


def moe_shape(model: nn.Module, plan: Mapping[str, str] | None = None) -> dict[str, int]:
    """What the all-to-alls of expert parallel move, as far as the model says: its MoE `layers` (the experts
    modules of `plan`, default its own), the width of a routed row (`hidden`: `config.hidden_size`, what each
    token's row is, `accelfn.moe.experts.ep_forward`) and the experts each token goes to (`top_k`:
    `config.num_experts_per_tok`); an empty dict without a plan, or a config that gives neither.

    Example:
        >>> from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
        >>> cfg = Qwen3MoeConfig(vocab_size=32, hidden_size=16, intermediate_size=32, moe_intermediate_size=8,
        ...                      num_hidden_layers=3, num_attention_heads=2, num_key_value_heads=1, num_experts=4,
        ...                      num_experts_per_tok=2)
        >>> moe_shape(Qwen3MoeForCausalLM(cfg)), moe_shape(nn.Linear(2, 2))
        ({'layers': 3, 'hidden': 16, 'top_k': 2}, {})
    """
    from ..transforms.shard.expert_parallel import expert_params, model_ep_plan

    plan = plan if plan is not None else model_ep_plan(model)
    config = getattr(model, "config", None)
    hidden, top_k = getattr(config, "hidden_size", None), getattr(config, "num_experts_per_tok", None)
    if not plan or not isinstance(hidden, int) or not isinstance(top_k, int):
        return {}
    try:
        owners = set(expert_params(model, plan).values())
    except ValueError:
        return {}
    return {"layers": len(owners), "hidden": hidden, "top_k": top_k} if owners else {}


def recording_shapes(
    hook: Callable[[nn.Module], None] | None, seen: dict[str, Any]
) -> Callable[[nn.Module], None]:
    """A `dry_run(on_model=...)` hook that records `count_experts(model)` in `seen["experts"]`,
    `expert_bytes(model)` in `seen["expert_bytes"]` and `moe_shape(model)` in `seen["moe"]`, under the last plan
    the script gave `af.shard` since the hook was made (if any: a plan given before, by another script or test in
    this process, is forgotten), `critical.decoder_shape(model)` in `seen["decoder"]` and
    `zero3.zero3_shape(model)` in `seen["zero3"]`, then runs `hook`.

    Example:
        >>> seen = {}
        >>> recording_shapes(None, seen)(nn.Linear(2, 2)); seen
        {'experts': 0, 'expert_bytes': 0, 'moe': {}, 'decoder': {}, 'zero3': {'persistent': 1.0, 'reused': 0.0}}
    """
    from ..transforms.shard.expert_parallel import GIVEN
    from .critical import decoder_shape
    from .zero3 import zero3_shape

    GIVEN.clear()  # only what the script run with this hook gives af.shard

    def record(model: nn.Module) -> None:
        plan = GIVEN[-1] if GIVEN else None
        seen["experts"] = count_experts(model, plan)
        seen["expert_bytes"] = expert_bytes(model, plan)
        seen["moe"] = moe_shape(model, plan)
        seen["decoder"] = decoder_shape(model)
        seen["zero3"] = zero3_shape(model)
        if hook is not None:
            hook(model)

    return record

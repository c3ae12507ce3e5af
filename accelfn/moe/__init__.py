"""Mixture-of-experts pieces for expert parallelism (`af.shard` over an `ep` mesh axis): the swappable
`Dispatcher` (`dispatch`), the experts' forward (`experts`), the load-balancing and router z-losses of the
global batch (`balance`), aux-loss-free balancing by an expert bias (`bias`), the capacity factor with token
dropping (`capacity`), the step's MoE metrics (`metrics`), how a dry run routes its fake rows (`routing_model`), a `transformers` model's own experts in autocast's dtype
(`autocast_experts`).
See `accelfn.transforms.shard.expert_parallel`.
"""

from .autocast_experts import grouped_mm_in_autocast_dtype
from .balance import add_aux_loss, load_balancing_loss, router_z_loss
from .bias import add_expert_bias, biased_topk, register_expert_bias, update_expert_bias
from .capacity import set_capacity
from .dispatch import AllToAllDispatcher, Dispatcher, DispatchHandle
from .experts import ep_forward, local_experts, local_part
from .metrics import step_metrics

__all__ = [
    "add_aux_loss",
    "load_balancing_loss",
    "router_z_loss",
    "add_expert_bias",
    "biased_topk",
    "register_expert_bias",
    "update_expert_bias",
    "AllToAllDispatcher",
    "Dispatcher",
    "DispatchHandle",
    "ep_forward",
    "local_experts",
    "local_part",
    "grouped_mm_in_autocast_dtype",
    "set_capacity",
    "step_metrics",
]

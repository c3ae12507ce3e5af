"""Mixture-of-experts pieces for expert parallelism (`af.shard` over an `ep` mesh axis): the swappable
`Dispatcher` (`dispatch`), the experts' forward (`experts`), the load-balancing loss of the global batch
(`balance`). See `accelfn.transforms.shard.expert_parallel`.
"""

from .balance import add_aux_loss, load_balancing_loss
from .dispatch import AllToAllDispatcher, Dispatcher, DispatchHandle
from .experts import ep_forward, local_experts, local_part

__all__ = [
    "add_aux_loss",
    "load_balancing_loss",
    "AllToAllDispatcher",
    "Dispatcher",
    "DispatchHandle",
    "ep_forward",
    "local_experts",
    "local_part",
]

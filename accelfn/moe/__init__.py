"""Mixture-of-experts pieces for expert parallelism (`af.shard` over an `ep` mesh axis): the swappable
`Dispatcher` (`dispatch`), the experts' forward (`experts`). See `accelfn.transforms.shard.expert_parallel`.
"""

from .dispatch import AllToAllDispatcher, Dispatcher, DispatchHandle
from .experts import ep_forward, local_experts, local_part

__all__ = ["AllToAllDispatcher", "Dispatcher", "DispatchHandle", "ep_forward", "local_experts", "local_part"]

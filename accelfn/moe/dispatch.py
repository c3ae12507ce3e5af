"""Dispatch and combine for expert parallelism: token rows to the ranks that hold their experts, and back.

A `Dispatcher` is swappable (a DeepEP-style one on GPUs implements the same two methods); the default,
`AllToAllDispatcher`, is torchtitan's dropless scheme over an `ep` process group: the number of rows per
expert is exchanged first (one small `all_to_all_single`), then the rows move in one variable-split
`all_to_all_single` (differentiable: its backward is the reverse exchange), and are regrouped by local expert.
Every rank takes part in both exchanges whatever it sends or receives, so a rank with no rows does not hang.

With a `capacity_factor` (GShard/Switch, Megatron's `moe_expert_capacity_factor`; off by default: dropless),
each expert takes at most `ceil(capacity_factor * rows / E)` rows of the *global* batch (`rows`: tokens x k
over every data-parallel rank), first come first served in the global batch's order (data rank, then position;
a token's k choices go to k different experts, so the order is total); the rows over capacity are not sent,
and come back from `combine` as zeros (the token keeps its residual). The rows before this rank's, per expert,
come from one all-gather of the counts over `data_group`, so `ep=2` drops exactly what one process does on the
global batch.

Example (one process: the group of one rank keeps every row):
    >>> import torch
    >>> from accelfn.moe.dispatch import AllToAllDispatcher
    >>> d = AllToAllDispatcher(group=None, num_experts=4, size=1)
    >>> x, experts = torch.arange(6.0).reshape(3, 2), torch.tensor([2, 0, 2])
    >>> rows, counts, handle = d.dispatch(x, experts)
    >>> counts.tolist(), torch.equal(d.combine(rows, handle), x)
    ([1, 0, 2, 0], True)
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple, Protocol

import attrs
import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import is_fake

from .. import dry_mode
from .routing_model import routed_counts

__all__ = ["Dispatcher", "AllToAllDispatcher", "DispatchHandle"]


class Dispatcher(Protocol):
    """Moves rows (one per token and chosen expert) to the ranks holding their experts and back.

    `dispatch(x, experts)`: `x` [N, D] rows, `experts` [N] global expert ids (or [T, k]: row t*k + j is token
    t's j-th choice, which tells a dry run's routing model k); returns the rows this rank
    received, grouped by local expert (local expert 0's rows first), the number of rows per local expert
    ([local experts], int64) and a handle. `combine(y, handle)`: `y` laid out like those received rows;
    returns [N, ...] rows in the order of `x`. Both are differentiable.
    """

    def dispatch(self, x: torch.Tensor, experts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, Any]: ...

    def combine(self, y: torch.Tensor, handle: Any) -> torch.Tensor: ...


class DispatchHandle(NamedTuple):
    """What `combine` needs to send rows back: the two permutations and the split sizes of each direction."""

    order: (
        torch.Tensor | None
    )  # rows of x sent, sorted by expert (hence by destination rank); None: a dry run's
    regroup: torch.Tensor | None  # received rows (by source rank, then expert) sorted by local expert
    send: list[int]  # rows sent to each rank
    recv: list[int]  # rows received from each rank
    rows: int = -1  # rows of x (more than `order` holds when rows were dropped over capacity)


class _AllToAll(torch.autograd.Function):
    """The variable-split all-to-all of rows; its backward sends the gradients back the way the rows came."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, recv: list[int], send: list[int], group: Any) -> torch.Tensor:
        ctx.recv, ctx.send, ctx.group = recv, send, group
        out = x.new_empty((sum(recv), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), recv, send, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        return _AllToAll.apply(grad.contiguous(), ctx.send, ctx.recv, ctx.group), None, None, None


def _exchange(x: torch.Tensor, recv: list[int], send: list[int], group: Any) -> torch.Tensor:
    """Rows `x` (`send[r]` of them to rank r, in rank order) exchanged for `recv[r]` rows from each rank r."""
    return _AllToAll.apply(x, recv, send, group)  # type: ignore[no-any-return]


def _counting() -> bool:
    """A training forward: gradients on, and not the recomputation that full remat runs inside the backward."""
    return torch.is_grad_enabled() and torch._C._current_graph_task_id() == -1


@attrs.define(eq=False)
class AllToAllDispatcher:
    """Token-choice dispatch over `group` (`size` ranks, each holding `num_experts // size` consecutive experts:
    rank r holds experts r*E/size ... (r+1)*E/size - 1); dropless, or with a `capacity_factor` counted on the
    global batch of `data_group` (None: `group`'s ranks read the whole batch)."""

    group: Any
    num_experts: int
    size: int
    tokens: torch.Tensor | None = (
        None  # rows this rank routed to each expert since `take_tokens` (a statistic)
    )
    capacity_factor: float | None = None
    data_group: Any = None
    dropped: torch.Tensor | None = None  # rows this rank dropped over capacity since `take_dropped`
    _model: tuple[Any, torch.Tensor] | None = attrs.field(default=None, init=False)  # dry run: key, counts

    def __attrs_post_init__(self) -> None:
        if self.num_experts % self.size:
            raise ValueError(
                f"expert parallel: {self.num_experts} experts cannot be split over ep={self.size} ranks "
                "(the number of experts must be a multiple of ep)"
            )
        factor = self.capacity_factor
        if factor is not None and (isinstance(factor, bool) or not float(factor) > 0):
            raise ValueError(f"capacity_factor must be a number > 0 (or None: dropless), got {factor!r}")

    @property
    def local_experts(self) -> int:
        return self.num_experts // self.size

    def take_tokens(self) -> torch.Tensor:
        """The rows this rank routed to each expert ([num_experts]) since the last call; resets the count."""
        tokens = self.tokens if self.tokens is not None else torch.zeros(self.num_experts, dtype=torch.int64)
        self.tokens = None
        return tokens

    def take_dropped(self) -> torch.Tensor:
        """The rows this rank dropped over capacity (a 0-d int64) since the last call; resets the count."""
        dropped = self.dropped if self.dropped is not None else torch.zeros((), dtype=torch.int64)
        self.dropped = None
        return dropped

    def _kept(self, experts: torch.Tensor, order: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Of the rows sorted by expert (`order`), those within capacity: a bool mask in sorted order."""
        group = self.data_group if self.data_group is not None else self.group
        world = dist.get_world_size(group) if group is not None and dist.is_initialized() else 1
        if world > 1:  # every data rank's rows per expert: the rows before mine, and the global total
            every = counts.new_empty(world * self.num_experts)  # flat: gloo takes no 2-D output
            gather = (
                getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
            )  # renamed in 2.13
            gather(every, counts, group=group)
            every = every.view(world, self.num_experts)
            before, total = every[: dist.get_rank(group)].sum(0), int(every.sum())
        else:
            before, total = torch.zeros_like(counts), int(counts.sum())
        assert self.capacity_factor is not None
        capacity = math.ceil(self.capacity_factor * total / self.num_experts)
        by_expert = experts[order]
        first = counts.cumsum(0) - counts  # where each expert's rows start in sorted order
        place = torch.arange(order.numel(), device=order.device) - first[by_expert] + before[by_expert]
        return place < capacity

    def dispatch(
        self, x: torch.Tensor, experts: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, DispatchHandle]:
        if dry_mode.active() is not None and is_fake(x):  # a dry run (not a real run measured by its watcher)
            return self._modelled(x, experts.shape[1] if experts.ndim == 2 else 1)
        experts = experts.reshape(-1)
        n_local, n = self.local_experts, x.shape[0]
        order = torch.argsort(experts, stable=True)
        counts = torch.bincount(experts, minlength=self.num_experts)
        counting = _counting()
        if counting:  # a training forward (not full remat's recomputation): the step's statistics
            self.tokens = counts if self.tokens is None else self.tokens + counts
        if self.capacity_factor is not None:
            kept = self._kept(experts, order, counts)
            order = order[kept]
            routed, counts = counts, torch.bincount(experts[order], minlength=self.num_experts)
            if counting:
                gone = (routed - counts).sum()
                self.dropped = gone if self.dropped is None else self.dropped + gone
        if self.size == 1:
            return x[order], counts, DispatchHandle(order, torch.arange(0), [len(order)], [len(order)], n)
        got = torch.empty_like(counts)  # [source rank, local expert]: rows each rank sends to each of mine
        dist.all_to_all_single(got, counts, group=self.group)
        send = counts.view(self.size, n_local).sum(1).tolist()
        recv = got.view(self.size, n_local).sum(1).tolist()
        rows = _exchange(x[order], recv, send, self.group)
        expert_of_row = torch.arange(n_local, device=got.device).repeat(self.size)
        regroup = torch.argsort(torch.repeat_interleave(expert_of_row, got), stable=True)
        per_expert = got.view(self.size, n_local).sum(0)
        return rows[regroup], per_expert, DispatchHandle(order, regroup, send, recv, n)

    def _modelled(self, x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor, DispatchHandle]:
        """A dry run (fake tensors: no expert ids to read): the rows move as the dry run's routing model sends them
        (`accelfn.moe.routing_model`, `Assumptions.moe_routing`), through the same all-to-all, so its traffic and
        the experts' work are counted. Every ep rank's rows per expert are modelled, and this rank is given the
        busiest ep rank's (the most rows received; the step waits on it): its own rows sent, the rows the
        others send to its experts received. Under "even" this rank's own share, as every rank's is alike."""
        watcher = dry_mode.active()
        assert watcher is not None
        routing, layer = watcher.moe_routing(), watcher.moe_layer(self)
        n_local, tokens = self.local_experts, x.shape[0] // k
        key = (routing, tokens, k, layer)
        with watcher.untracked():  # the model's sampling: no part of the real step's memory or kernels
            if self._model is None or self._model[0] != key:
                counts = routed_counts(
                    routing, tokens=tokens, k=k, num_experts=self.num_experts, sources=self.size, layer=layer
                )
                self._model = (key, counts)
            counts = self._model[1]
            loads = counts.view(self.size, self.size, n_local).sum(2)  # [source rank, destination rank]
            if routing == "even":
                me = dist.get_rank(self.group) if self.size > 1 else 0
            else:
                me = int(loads.sum(0).argmax())  # the busiest ep rank (the first of equals)
            send, recv = loads[me].tolist(), loads[:, me].tolist()
            received = counts[:, me * n_local : (me + 1) * n_local].sum(0).tolist()
            routed = counts[me].tolist()
        with dry_mode.real_tensors():  # small host tensors, as the real run's counts (on its device)
            mine = torch.tensor(received)
            self.tokens = torch.tensor(routed) if self.tokens is None else self.tokens + torch.tensor(routed)
        watcher.moe_routed(layer, counts, me)
        rows = _exchange(x, recv, send, self.group) if self.size > 1 else x
        return rows, mine, DispatchHandle(None, None, send, recv)

    def combine(self, y: torch.Tensor, handle: DispatchHandle) -> torch.Tensor:
        if handle.order is None:  # a dry run's modelled routing: no permutation
            return _exchange(y, handle.send, handle.recv, self.group) if self.size > 1 else y
        if self.size > 1:
            assert handle.regroup is not None
            y = y[torch.argsort(handle.regroup)]  # back to (source rank, expert) order
            y = _exchange(y, handle.send, handle.recv, self.group)
        if len(handle.order) == handle.rows:  # dropless: a permutation
            return y[torch.argsort(handle.order)]
        return y.new_zeros((handle.rows, *y.shape[1:])).index_copy(0, handle.order, y)  # dropped rows: zeros

"""Dispatch and combine for expert parallelism: token rows to the ranks that hold their experts, and back.

A `Dispatcher` is swappable (a DeepEP-style one on GPUs implements the same two methods); the default,
`AllToAllDispatcher`, is torchtitan's dropless scheme over an `ep` process group: the number of rows per
expert is exchanged first (one small `all_to_all_single`), then the rows move in one variable-split
`all_to_all_single` (differentiable: its backward is the reverse exchange), and are regrouped by local expert.
Every rank takes part in both exchanges whatever it sends or receives, so a rank with no rows does not hang.

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

from typing import Any, NamedTuple, Protocol

import attrs
import torch
import torch.distributed as dist

from .. import dry_mode

__all__ = ["Dispatcher", "AllToAllDispatcher", "DispatchHandle"]


class Dispatcher(Protocol):
    """Moves rows (one per token and chosen expert) to the ranks holding their experts and back.

    `dispatch(x, experts)`: `x` [N, D] rows, `experts` [N] global expert ids; returns the rows this rank
    received, grouped by local expert (local expert 0's rows first), the number of rows per local expert
    ([local experts], int64) and a handle. `combine(y, handle)`: `y` laid out like those received rows;
    returns [N, ...] rows in the order of `x`. Both are differentiable.
    """

    def dispatch(self, x: torch.Tensor, experts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, Any]: ...

    def combine(self, y: torch.Tensor, handle: Any) -> torch.Tensor: ...


class DispatchHandle(NamedTuple):
    """What `combine` needs to send rows back: the two permutations and the split sizes of each direction."""

    order: torch.Tensor | None  # rows of x sorted by expert (hence by destination rank); None: a dry run's
    regroup: torch.Tensor | None  # received rows (by source rank, then expert) sorted by local expert
    send: list[int]  # rows sent to each rank
    recv: list[int]  # rows received from each rank


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


@attrs.define(eq=False)
class AllToAllDispatcher:
    """Dropless token-choice dispatch over `group` (`size` ranks, each holding `num_experts // size`
    consecutive experts: rank r holds experts r*E/size ... (r+1)*E/size - 1)."""

    group: Any
    num_experts: int
    size: int
    tokens: torch.Tensor | None = None  # rows this rank sent to each expert since `take_tokens` (a statistic)

    def __attrs_post_init__(self) -> None:
        if self.num_experts % self.size:
            raise ValueError(
                f"expert parallel: {self.num_experts} experts cannot be split over ep={self.size} ranks "
                "(the number of experts must be a multiple of ep)"
            )

    @property
    def local_experts(self) -> int:
        return self.num_experts // self.size

    def take_tokens(self) -> torch.Tensor:
        """The rows this rank routed to each expert ([num_experts]) since the last call; resets the count."""
        tokens = self.tokens if self.tokens is not None else torch.zeros(self.num_experts, dtype=torch.int64)
        self.tokens = None
        return tokens

    def dispatch(
        self, x: torch.Tensor, experts: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, DispatchHandle]:
        if dry_mode.active() is not None:
            return self._modelled(x)
        n_local = self.local_experts
        order = torch.argsort(experts, stable=True)
        counts = torch.bincount(experts, minlength=self.num_experts)
        self.tokens = counts.detach() if self.tokens is None else self.tokens + counts.detach()
        if self.size == 1:
            return x[order], counts, DispatchHandle(order, torch.arange(0), [x.shape[0]], [x.shape[0]])
        got = torch.empty_like(counts)  # [source rank, local expert]: rows each rank sends to each of mine
        dist.all_to_all_single(got, counts, group=self.group)
        send = counts.view(self.size, n_local).sum(1).tolist()
        recv = got.view(self.size, n_local).sum(1).tolist()
        rows = _exchange(x[order], recv, send, self.group)
        expert_of_row = torch.arange(n_local, device=got.device).repeat(self.size)
        regroup = torch.argsort(torch.repeat_interleave(expert_of_row, got), stable=True)
        per_expert = got.view(self.size, n_local).sum(0)
        return rows[regroup], per_expert, DispatchHandle(order, regroup, send, recv)

    def _modelled(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, DispatchHandle]:
        """A dry run (fake tensors: no expert ids to read): the rows move as a balanced router sends them (each
        expert `rows / E`), through the same all-to-all, so its traffic and the experts' work are counted."""
        n, n_local = x.shape[0], self.local_experts
        counts = [n // self.num_experts + (e < n % self.num_experts) for e in range(self.num_experts)]
        send = [sum(counts[r * n_local : (r + 1) * n_local]) for r in range(self.size)]
        me = dist.get_rank(self.group) if self.size > 1 else 0
        recv = [send[me]] * self.size  # every rank routes alike
        with dry_mode.real_tensors():
            mine = torch.tensor(counts[me * n_local : (me + 1) * n_local]) * self.size
            self.tokens = torch.tensor(counts) if self.tokens is None else self.tokens + torch.tensor(counts)
        rows = _exchange(x, recv, send, self.group) if self.size > 1 else x
        return rows, mine, DispatchHandle(None, None, send, recv)

    def combine(self, y: torch.Tensor, handle: DispatchHandle) -> torch.Tensor:
        if handle.order is None:  # a dry run's modelled routing: no permutation
            return _exchange(y, handle.send, handle.recv, self.group) if self.size > 1 else y
        if self.size > 1:
            assert handle.regroup is not None
            y = y[torch.argsort(handle.regroup)]  # back to (source rank, expert) order
            y = _exchange(y, handle.send, handle.recv, self.group)
        return y[torch.argsort(handle.order)]

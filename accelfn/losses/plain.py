"""The plain cross entropy (`F.cross_entropy` on the fp32 logits) in the loss's profiler scopes, forward and backward.

Its backward is autograd's own (no function of ours runs in it), so two identity functions bracket it: the one on
the loss opens the scope `accelfn.losses.cross_entropy.backward` when the backward reaches the loss, the one on the
logits closes it once their gradient is made. The dry run's tracker labels what is allocated in between as the
loss's (its three fp32 copies of the logits).

Example:
    >>> import torch
    >>> from accelfn.losses.plain import plain_cross_entropy
    >>> logits = torch.randn(6, 10, requires_grad=True)
    >>> labels = torch.tensor([1, 2, -100, 4, 5, 9])
    >>> total = plain_cross_entropy(logits, labels, -100)
    >>> total.backward()
    >>> bool(torch.allclose(total, torch.nn.functional.cross_entropy(logits, labels, reduction="sum")))
    True
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from accelfn.losses.chunked import SCOPE, scope

__all__ = ["plain_cross_entropy"]


class _OpenInBackward(torch.autograd.Function):
    """Identity; its backward (the first of the loss's) opens the backward's profiler scope."""

    @staticmethod
    def forward(x: torch.Tensor, opened: list[Any]) -> torch.Tensor:  # type: ignore[override]
        return x

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
        ctx.opened = inputs[1]

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        rf = torch.profiler.record_function(SCOPE + ".backward")
        rf.__enter__()
        ctx.opened.append(rf)
        return grad, None


class _CloseInBackward(torch.autograd.Function):
    """Identity; its backward (the last of the loss's: the logits' gradient is made) closes the scope."""

    @staticmethod
    def forward(x: torch.Tensor, opened: list[Any]) -> torch.Tensor:  # type: ignore[override]
        return x

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
        ctx.opened = inputs[1]

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        if ctx.opened:
            ctx.opened.pop().__exit__(None, None, None)
        return grad, None


def _scoped(logits: torch.Tensor) -> bool:
    """Whether the backward scope can bracket this call: a plain (or fake) tensor that takes gradients, eagerly,
    outside torch.func transforms (which need more of an autograd.Function) and tensor subclasses."""
    from torch._subclasses.fake_tensor import FakeTensor

    return (
        logits.requires_grad
        and torch.is_grad_enabled()
        and not torch.compiler.is_compiling()
        and not torch._C._functorch.is_functorch_wrapped_tensor(logits)
        and (type(logits) in (torch.Tensor, torch.nn.Parameter) or isinstance(logits, FakeTensor))
    )


def plain_cross_entropy(logits: torch.Tensor, labels: torch.Tensor, ignore_index: int) -> torch.Tensor:
    """`F.cross_entropy(logits.float(), labels, reduction="sum")` over `logits` `(*, classes)` and flat `labels`,
    forward and backward in the loss's profiler scopes (where they can be: see `_scoped`)."""
    opened: list[Any] = []
    bracket = _scoped(logits)
    with scope(SCOPE):
        x = _CloseInBackward.apply(logits, opened) if bracket else logits
        total = F.cross_entropy(
            x.reshape(-1, x.shape[-1]).float(), labels, ignore_index=ignore_index, reduction="sum"
        )
    return _OpenInBackward.apply(total, opened) if bracket else total  # type: ignore[no-any-return]

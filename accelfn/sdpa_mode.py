"""A torch function mode that reroutes `torch.nn.functional.scaled_dot_product_attention` calls: the base of
context parallel's all-gather attention (`accelfn.transforms.shard.context_parallel`) and the dry run's fused
dropout attention (`accelfn.dryrun.fused_attention`). A subclass writes `attention` with SDPA's signature; every
other torch function runs as it would.

Example:
    >>> import torch
    >>> class Counting(SDPAMode):
    ...     calls = 0
    ...
    ...     def attention(self, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
    ...                   enable_gqa=False):
    ...         self.calls += 1
    ...         return SDPA(query, key, value, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa)
    >>> q = torch.randn(1, 2, 4, 8)
    >>> with Counting() as mode:
    ...     out = torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)
    >>> mode.calls, tuple(out.shape)
    (1, (1, 2, 4, 8))
"""

from __future__ import annotations

import abc
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

__all__ = ["SDPA", "SDPAMode"]

SDPA = torch.nn.functional.scaled_dot_product_attention


class SDPAMode(TorchFunctionMode, abc.ABC):
    """Inside it, `scaled_dot_product_attention(...)` calls `self.attention(...)` (positional and keyword
    arguments bound by SDPA's signature); anything else runs unchanged."""

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is not SDPA:
            return func(*args, **kwargs)
        return self.attention(*args, **kwargs)

    @abc.abstractmethod
    def attention(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attn_mask: torch.Tensor | None = None,
        dropout_p: float = 0.0,
        is_causal: bool = False,
        scale: float | None = None,
        enable_gqa: bool = False,
    ) -> torch.Tensor:
        """The attention in place of SDPA's (the torch function mode is off inside: call `SDPA` freely)."""

"""Attention with dropout in a dry run of a GPU job: the GPU's fused SDPA kernel, not the CPU's math path.

The dry run executes on the CPU, whose `scaled_dot_product_attention` has no fused kernel with dropout: a call
with `dropout_p > 0` (GPT-2's and BERT's `attn_pdrop` / `attention_probs_dropout_prob`, 0.1 by default, while
training) falls back to the math path, which materialises the attention scores, their softmax and the dropout
mask (three B x H x L x L tensors per layer, held for the backward) and runs as matmuls and memory-bound ops. On
the GPU, SDPA's flash and memory-efficient kernels take dropout themselves (torch's `sdp_utils`: dropout is one of
their inputs, drawn from a Philox seed, no mask stored). Under `fused_dropout_attention`
such a call runs as the CPU's fused flash kernel with the same dropout (fake tensors: its shapes and saved
tensors, the output and a log-sum-exp, are all the dry run needs; its real CPU kernel refuses dropout), so it is
held and timed as the attention kernel it is on the GPU. Measured on GPT-2 small (768 wide, 12 layers), 1,024
tokens x 2 sequences per rank: activations 6.23 GiB without it, 2.95 GiB with it, as with `attn_pdrop=0`.

Not rerouted (the math path stays): real tensors (only fake ones and traces of them are), DTensors, grouped-query
calls (`enable_gqa` with fewer key heads: the CPU's flash kernel takes equal heads), other than 4-D inputs, and
calls under Dynamo. The partitioned graphs of `af.compile(regions="blocks")` (accelfn/dryrun/compiled.py) are
traced with it: the fused kernel is in them (GPT-2 small as above, compiled: 2.29 GiB, as without dropout).

Example:
    >>> import torch
    >>> from torch._subclasses.fake_tensor import FakeTensorMode
    >>> with FakeTensorMode(), fused_dropout_attention() as mode:
    ...     q = torch.randn(2, 4, 64, 16, requires_grad=True)
    ...     out = torch.nn.functional.scaled_dot_product_attention(q, q, q, dropout_p=0.1, is_causal=True)
    >>> tuple(out.shape), mode.fused
    ((2, 4, 64, 16), 1)
"""

from __future__ import annotations

import torch
from torch._guards import detect_fake_mode
from torch.distributed.tensor import DTensor

from .. import dry_mode
from ..sdpa_mode import SDPA, SDPAMode

__all__ = ["fused_dropout_attention"]


class fused_dropout_attention(SDPAMode):  # noqa: N801  (a context manager, named as one)
    """Inside it, `scaled_dot_product_attention` with dropout runs as one fused flash kernel (module docs);
    `fused` counts the calls rerouted."""

    def __init__(self) -> None:
        super().__init__()
        self.fused = 0

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
        tensors = (query, key, value) + ((attn_mask,) if attn_mask is not None else ())
        # fake tensors (or a compiled region's trace of them); real ones run the CPU kernel, which refuses dropout;
        # DTensors have no sharding rule for it
        fake = detect_fake_mode(tensors) is not None and not any(isinstance(t, DTensor) for t in tensors)
        if (
            dropout_p <= 0.0
            or torch.compiler.is_compiling()
            or not fake
            or any(t.dim() != 4 or t.device.type != "cpu" for t in (query, key, value))
            or key.shape[1] != query.shape[1]
            or query.dtype not in (torch.float32, torch.float16, torch.bfloat16)
        ):
            gqa = {"enable_gqa": True} if enable_gqa else {}
            return SDPA(query, key, value, attn_mask, dropout_p, is_causal, scale=scale, **gqa)
        if attn_mask is not None and attn_mask.dtype == torch.bool:  # as SDPA converts it: -inf where masked
            attn_mask = torch.zeros_like(attn_mask, dtype=query.dtype).masked_fill(~attn_mask, float("-inf"))
        self.fused += 1
        dry_mode.note(
            "attention with dropout (SDPA's dropout_p > 0) lowered as the GPU's fused SDPA kernel with dropout, "
            "not the CPU's unfused math path (no scores, probabilities or dropout mask held)"
        )
        out = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            query, key, value, dropout_p, is_causal, attn_mask=attn_mask, scale=scale
        )
        return out[0]

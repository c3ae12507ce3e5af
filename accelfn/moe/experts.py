"""The experts of an MoE layer under expert parallelism: the forward that dispatches, computes the local experts,
combines, and applies the routing weights in fp32 on the token's owner.

The experts module keeps the `transformers` interface, `experts(hidden [T, D], top_k_index [T, k],
top_k_weights [T, k]) -> [T, D]`, and the fused layout `gate_up_proj [E, 2F, D]`, `down_proj [E, D, F]` (gate
then up, no bias, not transposed; `act_fn`), of which each rank holds `E / ep` experts. A module with another
layout defines `ep_local_forward(rows, counts) -> rows`: its local experts on rows grouped by local expert
(`accelfn.moe.local_part(p)`: this rank's experts of a parameter). Under `af.autocast_fp8` the fused layout's two
GEMMs run through torchao's fp8 grouped GEMM (`FP8_RECIPE`, set on the module by the fp8 lowering).

Example (one process, 4 experts, top-2; the same output as the dense loop):
    >>> import torch
    >>> from torch import nn
    >>> from accelfn.moe.dispatch import AllToAllDispatcher
    >>> from accelfn.moe.experts import ep_forward
    >>> m = nn.Module(); m.act_fn = nn.SiLU()
    >>> m.gate_up_proj, m.down_proj = nn.Parameter(torch.randn(4, 6, 2)), nn.Parameter(torch.randn(4, 2, 3))
    >>> h, idx, w = torch.randn(5, 2), torch.randint(0, 4, (5, 2)), torch.rand(5, 2)
    >>> y = ep_forward(m, AllToAllDispatcher(None, 4, 1), h, idx, w)
    >>> def one(t, e): g, u = (h[t] @ m.gate_up_proj[e].T).chunk(2); return (nn.functional.silu(g) * u) @ m.down_proj[e].T
    >>> ref = torch.stack([sum(w[t, j] * one(t, idx[t, j]) for j in range(2)) for t in range(5)])
    >>> torch.allclose(y, ref, atol=1e-5)
    True
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .dispatch import Dispatcher

__all__ = ["ep_forward", "local_experts", "local_part", "fp8_grouped", "FP8_RECIPE", "FP8_ALIGN"]

FP8_RECIPE = "moe_fp8_grouped_mm"  # an experts module's attribute: the torchao recipe of its grouped GEMMs
# rows per group (and K, N multiples) each recipe takes: fp8 rowwise's `_scaled_grouped_mm` 16, mxfp8 its 32-blocks
FP8_ALIGN = {"rowwise": 16, "mxfp8": 32, "mxfp8_emulated": 32, "fp8_modelled": 16}


def local_part(p: torch.Tensor) -> torch.Tensor:
    """This rank's experts of a parameter (a DTensor sharded over ep: its local piece, in autograd)."""
    return p.to_local() if hasattr(p, "to_local") else p  # type: ignore[no-any-return]


def _gate(module: nn.Module, gate_up: torch.Tensor) -> torch.Tensor:
    apply = getattr(module, "_apply_gate", None)  # transformers' (gate, up) -> act(gate) * up
    if apply is not None:
        return apply(gate_up)  # type: ignore[no-any-return]
    gate, up = gate_up.chunk(2, dim=-1)
    return module.act_fn(gate) * up  # type: ignore[no-any-return,operator]


def _grouped_ok(rows: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> bool:
    """`torch._grouped_mm` takes these: some rows, and rows of every operand 16-byte aligned."""
    size = rows.element_size()
    return rows.shape[0] > 0 and all(n * size % 16 == 0 for n in (*gate_up.shape[1:], down.shape[1]))


def _math_dtype(rows: torch.Tensor, weight: torch.Tensor) -> torch.dtype | None:
    """The dtype the experts' GEMMs run in: autocast's where it is on (as it casts `linear`'s operands: fp32
    master weights under `af.autocast` bf16 run bf16 GEMMs), else the rows' when the weights share it."""
    kind = rows.device.type
    if torch.is_autocast_enabled(kind):
        return torch.get_autocast_dtype(kind)
    return rows.dtype if weight.dtype == rows.dtype else None


def _grouped(module: nn.Module, rows: torch.Tensor, counts: torch.Tensor, gate_up: torch.Tensor,
             down: torch.Tensor) -> torch.Tensor:  # fmt: skip
    """The local experts as two grouped GEMMs (`torch._grouped_mm`, offsets from `counts`)."""
    offs = counts.cumsum(0).to(torch.int32)
    hidden = _gate(module, torch._grouped_mm(rows, gate_up.transpose(-2, -1), offs=offs))
    return torch._grouped_mm(hidden, down.transpose(-2, -1), offs=offs)


def _column_major(t: torch.Tensor) -> torch.Tensor:
    return t.transpose(-2, -1).contiguous().transpose(-2, -1)


def _scaled(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor, rows: Any, cols: Any) -> torch.Tensor:
    """`torch._scaled_grouped_mm` of fp8 copies of `a` (row-major) and `b` (column-major), unit scales of shapes
    `rows` and `cols`."""
    f8, one = torch.float8_e4m3fn, torch.float32
    return torch._scaled_grouped_mm(a.to(f8), _column_major(b.to(f8)), a.new_ones(rows, dtype=one),
                                    a.new_ones(cols, dtype=one), offs=offs, out_dtype=torch.bfloat16)  # fmt: skip


class _ModelledFP8(torch.autograd.Function):
    """A dry run's stand-in for torchao's fp8 grouped GEMM, whose kernels (triton's, sm100's) do not run on fake
    tensors: its three grouped GEMMs (output, input gradient, weight gradient) as `torch._scaled_grouped_mm` on fp8
    operands (unit scales: the values are fake), so the dry run counts them as fp8 matmuls, at the fp8 peak."""

    @staticmethod
    def forward(ctx: Any, a: torch.Tensor, b_t: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(a, b_t, offs)
        return _scaled(a, b_t, offs, a.shape[0], (b_t.shape[0], b_t.shape[2]))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        a, b_t, offs = ctx.saved_tensors
        experts, k, n = b_t.shape
        dgrad = _scaled(grad, b_t.transpose(-2, -1), offs, grad.shape[0], (experts, k))
        wgrad = _scaled(grad.t().contiguous(), a, offs, n * experts, k * experts)  # [E, N, K]
        return dgrad.to(a.dtype), wgrad.transpose(-2, -1).to(b_t.dtype), None


def _fp8_mm(recipe: str) -> Any:
    """torchao's differentiable fp8 grouped GEMM for `recipe`, as `mm(a [M, K], b_t [E, K, N], offs) -> [M, N]`
    bf16 (torchao.prototype.moe_training, as torchtitan's MoE fp8 training calls it); "fp8_modelled": a dry run's
    stand-in (`_ModelledFP8`)."""
    if recipe == "fp8_modelled":
        return _ModelledFP8.apply
    if recipe == "rowwise":
        from torchao.prototype.moe_training import _to_fp8_rowwise_then_scaled_grouped_mm as rowwise

        return lambda a, b, offs: rowwise(
            a, b, offs, out_dtype=torch.bfloat16, pad_token_groups_for_grouped_mm=False
        )
    from torchao.prototype.moe_training import _to_mxfp8_then_scaled_grouped_mm as mxfp8
    from torchao.quantization.quantize_.common import KernelPreference

    kernels = KernelPreference.EMULATED if recipe == "mxfp8_emulated" else KernelPreference.AUTO
    return lambda a, b, offs: mxfp8(a, b, offs=offs, out_dtype=torch.bfloat16, kernel_preference=kernels)


def fp8_grouped(
    module: nn.Module,
    rows: torch.Tensor,
    counts: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    recipe: str,
) -> torch.Tensor:
    """The local experts' two GEMMs in fp8 through torchao (`recipe`: "rowwise" on sm90, "mxfp8" on sm100,
    "mxfp8_emulated" anywhere, for tests): each expert's rows padded with zero rows to a multiple of
    `FP8_ALIGN[recipe]` (what the kernels take; the weight gradient's scaling blocks then stay within one expert),
    the padding dropped after; the result in the rows' dtype. The weights are quantized from their own dtype
    (fp32 master weights included), as torchao's wrapper tensors do.

    Example (emulated mxfp8, 2 experts, 90 rows; the SQNR vs the fp32 GEMMs is above 22 dB: torchao's 27 dB per
    GEMM, three quantized products in series, gate, up and down):
        >>> import torch
        >>> from torch import nn
        >>> from torchao.quantization.utils import compute_error
        >>> _ = torch.manual_seed(0)
        >>> m = nn.Module(); m.act_fn = nn.SiLU()
        >>> gate_up, down = torch.randn(2, 128, 64) / 8, torch.randn(2, 64, 64) / 8
        >>> rows, counts = torch.randn(90, 64), torch.tensor([55, 35])
        >>> y = fp8_grouped(m, rows, counts, gate_up, down, "mxfp8_emulated")
        >>> bool(compute_error(_grouped(m, rows, counts, gate_up, down), y) > 22)
        True
    """
    align = FP8_ALIGN[recipe]
    padded = (counts + align - 1) // align * align
    shift = (padded.cumsum(0) - padded) - (
        counts.cumsum(0) - counts
    )  # each group's start: padded minus packed
    place = torch.repeat_interleave(shift, counts) + torch.arange(rows.shape[0], device=rows.device)
    x = rows.new_zeros((int(padded.sum()), rows.shape[1])).index_copy(0, place, rows)
    offs = padded.cumsum(0).to(torch.int32)
    mm = _fp8_mm(recipe)
    with torch.autocast(rows.device.type, enabled=False):  # torchao picks its own dtypes
        hidden = _gate(module, mm(x, gate_up.transpose(-2, -1), offs))
        out = mm(hidden, down.transpose(-2, -1), offs)
    return out[place].to(rows.dtype)


def local_experts(
    module: nn.Module, rows: torch.Tensor, counts: torch.Tensor, grouped: tuple[torch.dtype, ...] = ()
) -> torch.Tensor:
    """This rank's experts on `rows` grouped by local expert (`counts[e]` rows for local expert e): two grouped
    GEMMs where `grouped` (the platform's `grouped_mm_dtypes()`) has the dtype they compute in (autocast's, else
    the rows' and weights'), else a loop over every local
    expert, also those with no rows (their weights then get zero gradients, not none)."""
    custom = getattr(module, "ep_local_forward", None)
    if custom is not None:
        return custom(rows, counts)  # type: ignore[no-any-return]
    for flag, want in (("is_transposed", False), ("has_bias", False), ("has_gate", True)):
        if getattr(module, flag, want) != want:
            raise ValueError(
                f"expert parallel: {type(module).__name__}.{flag} is {not want}; the built-in expert loop takes the "
                "fused layout gate_up_proj [E, 2F, D], down_proj [E, D, F] (define ep_local_forward(rows, counts) "
                "for another layout)"
            )
    gate_up, down = local_part(module.gate_up_proj), local_part(module.down_proj)  # type: ignore[arg-type]
    recipe = getattr(module, FP8_RECIPE, None)  # af.autocast_fp8
    if recipe is not None and rows.shape[0] > 0:
        return fp8_grouped(module, rows, counts, gate_up, down, recipe)
    dtype = _math_dtype(rows, gate_up)
    if dtype in grouped and _grouped_ok(rows.to(dtype), gate_up, down):
        return _grouped(module, rows.to(dtype), counts, gate_up.to(dtype), down.to(dtype))
    outs = []
    for e, part in enumerate(rows.split(counts.tolist())):
        hidden = _gate(module, nn.functional.linear(part, gate_up[e]))
        outs.append(nn.functional.linear(hidden, down[e]))
    return torch.cat(outs)


# `torch._disable_dynamo` is `torch.compiler.disable` that imports dynamo on the first call, not at import:
# importing dynamo costs every process of a launch about a second.
@torch._disable_dynamo  # type: ignore[misc]
def ep_forward(
    module: nn.Module,
    dispatcher: Dispatcher,
    hidden: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    grouped: tuple[torch.dtype, ...] = (),
    **_: Any,
) -> torch.Tensor:
    """The experts' output for `hidden` [T, D] routed to `top_k_index` [T, k] with `top_k_weights` [T, k]:
    each (token, choice) row dispatched, computed by its expert's rank, combined back, then weighted in fp32 and
    summed over the k choices in a fixed order. `grouped`: the dtypes in which to use `torch._grouped_mm`.

    Never compiled (`torch.compiler.disable`): under `af.compile` the blocks around it are (the attention, the
    router), and the dispatch (data-dependent splits, collectives) and the experts' DTensor pieces run eagerly."""
    tokens, k = top_k_index.shape
    kind = hidden.device.type
    # under autocast the rows travel in its dtype, which the experts' GEMMs would cast them to anyway: a bf16 run
    # with an fp32 residual stream (af.autocast) moves half the bytes both ways, the same values
    moved = hidden.to(torch.get_autocast_dtype(kind)) if torch.is_autocast_enabled(kind) else hidden
    rows = moved.repeat_interleave(k, dim=0)  # row t*k + j: token t's j-th choice
    received, counts, handle = dispatcher.dispatch(rows, top_k_index)  # [T, k]: k for a dry run's model
    back = dispatcher.combine(local_experts(module, received, counts, grouped), handle).view(tokens, k, -1)
    out = (back.float() * top_k_weights.float().unsqueeze(-1)).sum(1)
    return out.to(hidden.dtype)

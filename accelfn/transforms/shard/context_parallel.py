"""Context parallel over the mesh's `cp` axis: each rank of a `cp` group computes on a part of every sequence.

Long sequences do not fit one device's activation memory; context parallel splits the sequence dimension
(dim 1 of every batch tensor with two or more dims) over the `cp` ranks, which read the same rows. Attention
is the one place where tokens meet: every call of `torch.nn.functional.scaled_dot_product_attention` during
the training step all-gathers the keys and values over the `cp` group (autograd: a reduce-scatter of their
gradients in the backward) and attends this rank's queries to them — the all-gather form of context
parallelism used to train Llama 3, and the one torch's own flex-attention context parallel uses.

Causal attention skips the masked half, as a single device's kernel does: each of this rank's two chunks
attends to the keys up to and including its own chunk (global order), a causal mask aligned to the lower right
(`torch.nn.attention.bias.causal_lower_right`), which SDPA runs on FlashAttention or the memory-efficient
kernel where they apply (CUDA; not yet run on a GPU: tests/test_gpu.py), and as a boolean mask elsewhere (the
CPU). No mask over the whole gathered sequence is built. Grouped-query keys and values are repeated to the query
heads after the all-gather (torch's `CausalBias` hands `enable_gqa` to its explicit-mask fallback only), which
the backward keeps: query-heads-wide keys and values of the keys each chunk sees.

Load balance: the sequence is cut into `2 * cp` chunks and rank `r` takes chunks `r` and `2*cp - 1 - r` (as
torch's and torchtitan's head-tail balancer), so every rank attends to as many keys under a causal mask.

Gradients are summed over the data axes and `cp` (each cp rank holds a part of every gradient), and the loss
is `Loss(total, count)` summed over all of them, so a step equals one process on the global batch.

What the model and the data must do (checked where it can be):
- labels aligned with the inputs position by position (`labels[:, i]` is the target of `input_ids[:, i]`; -100
  for none), as torchtitan's and Accelerate's context parallel require: a loss that slices the sequence
  (`logits[:, :-1]` against `ids[:, 1:]`) would pair tokens across the cut. A model input shorter than the
  split batch (e.g. `ids[:, :-1]`) is refused at the first attention call.
- positions: a Hugging Face model (also inside a wrapper such as PEFT's) gets `position_ids` (the global
  positions of this rank's tokens) when none are passed; a model with its own position embedding must take `position_ids` from the batch (split like the
  tokens).
- attention through SDPA: a Hugging Face model is switched to `attn_implementation="sdpa"`; a step whose
  forward calls no SDPA is refused (its attention would see only this rank's tokens). Causal or full
  self-attention without `attn_mask` (padding masks are refused: pack sequences instead).

With tensor parallel (`cp` and `tp` on one mesh): the attention gets this tp rank's heads (plain tensors, the
sequence gathered over tp by sequence parallel), and gathers their keys and values over the cp ranks holding
the same heads.

Training steps only: an `eval_step` on a `cp` mesh runs each rank on whole sequences (the same result on every
cp rank). hsdp shards over fsdp x cp and replicates over dp. Not combined with DeepSpeed in this version (a
clear error).
"""

from __future__ import annotations

import contextlib
import inspect
import sys
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import attrs
import optree
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import nn
from torch._guards import detect_fake_mode
from torch.nn.attention.bias import causal_lower_right

from ... import dry_mode
from ... import tree as _tree
from ...mesh import Mesh
from ...sdpa_mode import SDPA, SDPAMode
from .._base import TransformBase

if TYPE_CHECKING:
    from ...engine import Plan

__all__ = ["ContextParallel", "chunk_positions", "split_sequence", "global_order", "gathered_attention"]

_gather = getattr(funcol, "all_gather_single_autograd", None) or funcol.all_gather_tensor_autograd


def chunk_positions(local_len: int, rank: int, size: int, device: torch.device | None = None) -> torch.Tensor:
    """The global positions of the `local_len` tokens rank `rank` of `size` holds (head-tail chunks).

    Example:
        >>> chunk_positions(4, 0, 2).tolist(), chunk_positions(4, 1, 2).tolist()
        ([0, 1, 6, 7], [2, 3, 4, 5])
    """
    half = local_len // 2
    head = torch.arange(rank * half, (rank + 1) * half, device=device)
    tail = torch.arange((2 * size - 1 - rank) * half, (2 * size - rank) * half, device=device)
    return torch.cat([head, tail])


def split_sequence(t: torch.Tensor, rank: int, size: int, dim: int = 1) -> torch.Tensor:
    """This rank's part of `t` along `dim`: chunks `rank` and `2*size - 1 - rank` of `2*size`.

    Example:
        >>> split_sequence(torch.arange(8).reshape(1, 8), 1, 2).tolist()
        [[2, 3, 4, 5]]
    """
    chunks = t.chunk(2 * size, dim=dim)
    return torch.cat([chunks[rank], chunks[2 * size - 1 - rank]], dim=dim)


@attrs.define(eq=False)
class _Runtime:
    """What the batch split tells the attention: this step's local sequence length and positions."""

    rank: int
    size: int
    group: dist.ProcessGroup
    local_len: int | None = None
    calls: int = 0
    biases: dict[tuple[int, int], Any] = attrs.Factory(dict)

    def positions(self, device: torch.device) -> torch.Tensor:
        assert self.local_len is not None
        return chunk_positions(self.local_len, self.rank, self.size, device)

    def set_length(self, local_len: int) -> None:
        """This step's local sequence length. The lower-right causal biases of this rank's two chunks are built
        here, outside the step's compiled regions (Dynamo traces a `CausalBias` passed in, not one built); a dry
        run, whose allocation tracking refuses the tensor subclass, builds none (`_prefix_causal`)."""
        if local_len != self.local_len:
            self.local_len = local_len
            half = local_len // 2
            self.biases = (
                {}
                if dry_mode.active() is not None
                else {
                    (half, n * half): causal_lower_right(half, n * half)
                    for n in (self.rank + 1, 2 * self.size - self.rank)
                }
            )


class _AttentionMode(SDPAMode):
    """Routes `scaled_dot_product_attention` through the all-gather of keys and values over the cp group."""

    def __init__(self, runtime: _Runtime) -> None:
        super().__init__()
        self.runtime = runtime

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
        rt = self.runtime
        rt.calls += 1
        if attn_mask is not None:
            raise ValueError(
                "context parallel: scaled_dot_product_attention was called with an attn_mask "
                f"(shape {tuple(attn_mask.shape)}); masks over a split sequence are not supported. Pass no "
                "attention_mask (causal attention is kept by position), and pack sequences instead of padding"
            )
        n = query.shape[-2]
        if rt.local_len is not None and (n != rt.local_len or key.shape[-2] != rt.local_len):
            raise ValueError(
                f"context parallel: attention over {n} queries and {key.shape[-2]} keys, but this rank's part of "
                f"the batch has {rt.local_len} positions. The model must see whole sequence parts: give labels "
                "aligned with the inputs in the batch (labels[:, i] is the target of input_ids[:, i]) instead of "
                "slicing the sequence (ids[:, :-1]) in the loss, and no cross-attention"
            )
        if n % 2:
            raise ValueError(
                f"context parallel: attention over {n} positions on this rank, not its two chunks of equal length"
            )
        k = _gather(key.contiguous(), key.dim() - 2, rt.group)
        v = _gather(value.contiguous(), value.dim() - 2, rt.group)
        return gathered_attention(
            query,
            k,
            v,
            rt.rank,
            rt.size,
            causal=is_causal,
            dropout_p=dropout_p,
            scale=scale,
            enable_gqa=enable_gqa,
            biases=rt.biases,
        )


def global_order(gathered: torch.Tensor, size: int, dim: int = -2) -> torch.Tensor:
    """Every rank's part (gathered rank by rank along `dim`: chunks `r` and `2*size - 1 - r` each) put back in
    sequence order.

    Example:
        >>> seq = torch.arange(8).reshape(1, 8)
        >>> gathered = torch.cat([split_sequence(seq, r, 2) for r in (0, 1)], dim=1)
        >>> gathered.tolist(), global_order(gathered, 2, dim=1).tolist()
        ([[0, 1, 6, 7, 2, 3, 4, 5]], [[0, 1, 2, 3, 4, 5, 6, 7]])
    """
    dim = dim % gathered.dim()
    parts = gathered.unflatten(dim, (size, 2, -1))  # rank, head/tail, position
    heads = parts.select(dim + 1, 0)
    tails = parts.select(dim + 1, 1).flip(dim)
    return torch.cat([heads, tails], dim=dim).flatten(dim, dim + 1)


def gathered_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    rank: int,
    size: int,
    *,
    causal: bool,
    dropout_p: float = 0.0,
    scale: float | None = None,
    enable_gqa: bool = False,
    biases: dict[tuple[int, int], Any] | None = None,
) -> torch.Tensor:
    """SDPA of rank `rank`'s queries (its chunks `rank` and `2*size - 1 - rank`) over every rank's keys and values
    (all-gathered, rank by rank): causal by global position, each chunk over the keys up to its own end (the
    masked half skipped), or full attention.

    Example:
        >>> q, k = torch.randn(1, 2, 16, 4), torch.randn(1, 2, 16, 4)
        >>> whole = torch.nn.functional.scaled_dot_product_attention(q, k, k, is_causal=True)
        >>> gathered = torch.cat([split_sequence(k, r, 2, dim=2) for r in (0, 1)], dim=2)
        >>> got = gathered_attention(split_sequence(q, 1, 2, dim=2), gathered, gathered, 1, 2, causal=True)
        >>> torch.allclose(got, split_sequence(whole, 1, 2, dim=2), atol=1e-6)
        True
    """
    if not causal:
        kw: dict[str, Any] = {"enable_gqa": True} if enable_gqa else {}
        return SDPA(query, key, value, dropout_p=dropout_p, scale=scale, **kw)
    half = query.shape[-2] // 2
    # the keys up to the end of this rank's later chunk (2*size - 1 - rank), in sequence order
    reach = (2 * size - rank) * half
    key = global_order(key, size)[..., :reach, :]
    value = global_order(value, size)[..., :reach, :]
    if enable_gqa and key.shape[-3] != query.shape[-3]:
        # repeated to the query heads (after the reordering, on the keys used): the lower-right mask's kernels
        # are called without enable_gqa (torch's CausalBias passes it to its explicit-mask fallback only)
        if query.shape[-3] % key.shape[-3]:
            raise ValueError(
                f"context parallel: {query.shape[-3]} query heads are not a multiple of {key.shape[-3]} key/value "
                "heads (grouped-query attention needs each key head shared by as many query heads)"
            )
        repeats = query.shape[-3] // key.shape[-3]
        key, value = key.repeat_interleave(repeats, dim=-3), value.repeat_interleave(repeats, dim=-3)
    outs = [
        _prefix_causal(query[..., i * half : (i + 1) * half, :], key[..., :n, :], value[..., :n, :],
                       dropout_p, scale, biases)
        for i, n in enumerate(((rank + 1) * half, reach))
    ]  # fmt: skip
    return torch.cat(outs, dim=-2)


def _lower_right_bias(query: torch.Tensor) -> bool:
    """Whether the lower-right mask goes to SDPA as torch's `CausalBias` (its fused kernels on CUDA and other
    accelerators) rather than as an explicit boolean mask (the CPU, where `CausalBias` builds that mask)."""
    return query.device.type != "cpu"


def _prefix_causal(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    dropout_p: float,
    scale: float | None,
    biases: dict[tuple[int, int], Any] | None,
) -> torch.Tensor:
    """Causal attention of queries that are the last `query.shape[-2]` positions of the keys' sequence."""
    lq, lk = query.shape[-2], key.shape[-2]
    if lq == lk or (dry_mode.models_a_device() and detect_fake_mode((query, key, value)) is not None):
        # equal lengths: SDPA's own causal mask. The dry run of a GPU job (fake tensors on the host): the GPU's
        # flash kernel, whose `is_causal` aligns to the lower right (`CausalBias`'s flash path), timed as such;
        # the CPU kernel's meta function gives the same shapes
        return SDPA(query, key, value, dropout_p=dropout_p, is_causal=True, scale=scale)
    if not _lower_right_bias(query):  # what `CausalBias` gives the CPU kernel, without the tensor subclass
        mask = torch.ones(lq, lk, dtype=torch.bool, device=query.device).tril(lk - lq)
        return SDPA(query, key, value, attn_mask=mask, dropout_p=dropout_p, scale=scale)
    bias = (biases or {}).get((lq, lk))
    if bias is None:
        bias = causal_lower_right(lq, lk)
    return SDPA(query, key, value, attn_mask=bias, dropout_p=dropout_p, scale=scale)


def _batch_split(runtime: _Runtime, inner: Any) -> Any:
    """Compose the shard's batch transform with the sequence split."""

    def split(batch: Any) -> Any:
        if inner is not None:
            batch = inner(batch)
        lengths: dict[str, int] = {}

        def one(path: tuple[Any, ...], t: Any) -> Any:
            if not isinstance(t, torch.Tensor) or t.dim() < 2:
                return t
            where = "batch" + "".join(f"[{p!r}]" for p in path)
            n = t.shape[1]
            if n % (2 * runtime.size):
                raise ValueError(
                    f"context parallel: {where} has {n} positions along dim 1, not divisible by 2 x cp = "
                    f"{2 * runtime.size} (each rank takes two of {2 * runtime.size} chunks, to balance causal "
                    "attention); pad or cut the sequences to a multiple"
                )
            lengths[where] = n
            return split_sequence(t, runtime.rank, runtime.size)

        out = optree.tree_map_with_path(one, batch, namespace=_tree.NAMESPACE)
        if not lengths:
            raise ValueError(
                "context parallel: the batch has no tensor with a sequence dimension (dim 1) to split"
            )
        if len(set(lengths.values())) > 1:
            raise ValueError(
                f"context parallel: the batch's sequences differ in length ({lengths}); every tensor with two or "
                "more dims is split along dim 1, so they must have one length"
            )
        runtime.set_length(next(iter(lengths.values())) // runtime.size)
        return out

    return split


def _hf_position_hook(runtime: _Runtime, module: nn.Module) -> Any:
    """A Hugging Face model called without `position_ids` gets this rank's global positions."""
    sig = inspect.signature(module.forward)
    names = list(sig.parameters)

    def hook(
        mod: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        mask = kwargs.get("attention_mask")
        if mask is None and "attention_mask" in names and len(args) > names.index("attention_mask"):
            mask = args[names.index("attention_mask")]
        if mask is not None:  # refused on every rank alike (its zeros may lie in another rank's part)
            raise ValueError(
                "context parallel: the model was called with an attention_mask; padding masks over a split "
                "sequence are not supported. Pass no attention_mask (causal attention is kept by position), "
                "and pack sequences instead of padding"
            )
        if kwargs.get("position_ids") is not None or len(args) > names.index("position_ids"):
            return args, kwargs
        ids = kwargs.get("input_ids", args[0] if args else None)
        if ids is None:
            ids = kwargs.get("inputs_embeds")
        if ids is None or runtime.local_len is None:
            return args, kwargs
        if ids.shape[1] != runtime.local_len:
            raise ValueError(
                f"context parallel: the model was called on {ids.shape[1]} positions, but this rank's part of the "
                f"batch has {runtime.local_len}. Give labels aligned with the inputs in the batch (labels[:, i] is "
                "the target of input_ids[:, i]) instead of slicing the sequence (ids[:, :-1]) in the loss"
            )
        kwargs = {**kwargs, "position_ids": runtime.positions(ids.device)[None, :]}
        return args, kwargs

    return hook


@contextlib.contextmanager
def _positions_are_not_packing() -> Iterator[None]:
    """Hugging Face reads a jump in `position_ids` as the start of another packed sequence (when the model runs
    without a cache, e.g. `use_cache=False`) and builds a block mask; under context parallel the jump is the
    seam between this rank's head and tail chunks, and attention is causal by global position. Its detection is
    turned off while the step's forward runs (the attention refuses any mask)."""
    masking: Any = sys.modules.get("transformers.masking_utils")
    found = getattr(masking, "find_packed_sequence_indices", None)
    if found is None:
        yield
        return
    masking.find_packed_sequence_indices = _no_packed_sequences
    try:
        yield
    finally:
        masking.find_packed_sequence_indices = found


def _no_packed_sequences(position_ids: torch.Tensor) -> None:
    return None


def _position_taker(module: nn.Module) -> nn.Module | None:
    """The outermost Hugging Face model inside `module` (itself included) whose forward takes `position_ids`:
    the model itself, or the one a wrapper (PEFT's PeftModel, whose forward takes **kwargs) calls."""
    for m in module.modules():
        if _hf_config(m) is None:
            continue
        try:
            if "position_ids" in inspect.signature(m.forward).parameters:
                return m
        except (TypeError, ValueError):  # pragma: no cover - a forward without a signature
            continue
    return None


def _hf_config(module: nn.Module) -> Any:
    """A Hugging Face model's config (None for other modules)."""
    cfg = getattr(module, "config", None)
    return cfg if cfg is not None and hasattr(cfg, "_attn_implementation") else None


@attrs.frozen(eq=False)
class ContextParallel(TransformBase):
    mesh: Mesh
    kind: str = "context_parallel"

    def describe(self) -> str:
        return f"context_parallel(cp={self.mesh.axis_size('cp')})"

    def lower(self, plan: Plan) -> None:
        if plan.kind != "train":
            plan.notes.append("context parallel: eval steps run whole sequences on every cp rank")
            return
        mesh = self.mesh
        runtime = _Runtime(mesh.axis_rank("cp"), mesh.axis_size("cp"), mesh.group("cp"))
        plan.batch_transform = _batch_split(runtime, plan.batch_transform)
        model, config = plan.module, _hf_config(plan.module)
        if config is not None:
            if getattr(model, "is_gradient_checkpointing", False):
                raise ValueError(
                    "context parallel: the model has Hugging Face gradient checkpointing enabled, whose "
                    "recomputation would attend to this rank's tokens only; use af.remat(step) instead "
                    "(model.gradient_checkpointing_disable())"
                )
            impl = config._attn_implementation
            if impl != "sdpa":
                switch = getattr(model, "set_attn_implementation", None)
                if switch is not None:
                    try:
                        switch("sdpa")
                    except ValueError as e:  # no SDPA path in transformers (Gemma-2: its soft-capping)
                        # the model's own class (FSDP2 makes a subclass FSDP<name> of it)
                        name = next(
                            c.__name__ for c in type(model).__mro__ if not c.__name__.startswith("FSDP")
                        )
                        raise ValueError(
                            f"context parallel: {name} has no SDPA attention in transformers (it runs {impl!r}), "
                            "and a cp axis splits sequences through torch's scaled_dot_product_attention: train "
                            "this model without a cp axis"
                        ) from e
                else:  # pragma: no cover - older transformers
                    config._attn_implementation = "sdpa"
                plan.notes.append(f"context parallel: attention switched from {impl!r} to 'sdpa'")
            taker = _position_taker(model)
            if taker is not None:
                taker.register_forward_pre_hook(_hf_position_hook(runtime, taker), with_kwargs=True)
            else:
                plan.notes.append(
                    "context parallel: no module takes position_ids: positions must come from the batch"
                )

        @contextlib.contextmanager
        def forward() -> Iterator[None]:
            before = runtime.calls
            with _AttentionMode(runtime), _positions_are_not_packing():
                yield
            # (a dry run's partitioned graph of a compiled block replays its trace's SDPA calls without the mode:
            # there, once any forward of this runtime went through it, the model is known to attend through SDPA)
            if runtime.calls == before and not (dry_mode.active() is not None and runtime.calls):
                raise ValueError(
                    "context parallel: the forward pass called no torch.nn.functional.scaled_dot_product_attention; "
                    "a model computing attention otherwise would attend only to this rank's part of each sequence "
                    "(for a Hugging Face model use attn_implementation='sdpa')"
                )

        plan.forward_contexts.append(forward)  # af.remat re-enters the mode for its recomputation
        plan.notes.append(
            f"context parallel over cp={runtime.size} (all-gathered keys and values, head-tail chunks)"
        )

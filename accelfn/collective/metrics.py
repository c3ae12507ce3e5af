"""`gather_for_metrics`: every rank gets the whole evaluation batch, each sample once, padding dropped.

Example:
    >>> import torch, accelfn as af
    >>> loader = af.data.DataLoader(torch.arange(5), batch_size=4)
    >>> [af.dist.gather_for_metrics(b * 10, loader).tolist() for b in loader]
    [[0, 10, 20, 30], [40]]
    >>> [af.dist.gather_for_metrics([f"s{i}" for i in b.tolist()], loader) for b in loader]
    [['s0', 's1', 's2', 's3'], ['s4']]
"""

from __future__ import annotations

import zlib
from typing import TYPE_CHECKING, Any

import torch

from .. import tree as _tree
from .collectives import gather, gather_object

if TYPE_CHECKING:
    from ..data.loader import DataLoader

__all__ = ["gather_for_metrics"]


def gather_for_metrics(x: Any, loader: DataLoader) -> Any:
    """Gather `x` (a tensor or pytree of tensors whose dim 0 are the samples of the batch `loader` yielded
    last, or a list of Python objects, one per sample: generated text) from all data-parallel ranks, in
    data-rank order, without the loader's wrap-around padding.

    Over a whole unshuffled epoch the results, concatenated, are the dataset's samples in order, each once.
    Every rank must call it for the same batch (with `even_batches=False`, a rank that has no batch for
    this step would make the others wait: use the default `even_batches=True` for evaluation).
    """
    info = loader.last_batch
    if info is None:
        raise RuntimeError(
            "gather_for_metrics: the loader has not yielded a batch yet; call it inside `for batch in loader:`"
        )
    lay = loader.layout
    mine, width = info.sizes[lay.data_rank], loader.batch_size
    keep = sum(info.sizes) - info.padding
    shards = lay.first_rank_of_each_shard()
    leaves, spec = _tree.flatten(x)
    objects = isinstance(x, (list, tuple)) and not any(isinstance(v, torch.Tensor) for v in leaves)
    problem: str | None = None
    signature: list[Any] = [("objects",)] if objects else []
    for path, leaf in [] if objects else _tree.flatten_with_path(x):
        name = "x" + ("[" + repr(path) + "]" if path else "")
        if not isinstance(leaf, torch.Tensor) or leaf.ndim == 0 or leaf.shape[0] != mine:
            what = f"shape {tuple(leaf.shape)}" if isinstance(leaf, torch.Tensor) else type(leaf).__name__
            problem = problem or (
                f"gather_for_metrics: {name} has {what}, but dim 0 must be the {mine} samples of this rank's batch "
                f"(global batch {info.step} of the epoch)"
            )
        else:
            signature.append((name, tuple(leaf.shape[1:]), str(leaf.dtype)))
    # every rank takes the same collectives: a problem on one rank is an error on all of them, not a hang
    if lay.world_size > 1:
        _agree(signature, problem, info.step)
    if problem:
        raise ValueError(problem)
    if objects:
        # Python objects (generated text, ids): one per sample, gathered as objects (Accelerate's fallback); the
        # lengths are checked after the one collective, so a wrong one is an error on every rank, not a hang
        ranks = gather_object(list(x))
        wrong = {g: len(ranks[g]) for d, g in enumerate(shards) if len(ranks[g]) != info.sizes[d]}
        if wrong:
            raise ValueError(
                f"gather_for_metrics: x is a list of objects, one per sample of the rank's batch, but ranks "
                f"{sorted(wrong)} passed {[wrong[g] for g in sorted(wrong)]} for batches of {list(info.sizes)} "
                f"(global batch {info.step} of the epoch)"
            )
        return [v for d, g in enumerate(shards) for v in ranks[g][: info.sizes[d]]][:keep]
    uneven = any(n != width for n in info.sizes)
    if uneven:  # pad every rank to the full width so the all-gather sees equal shapes
        leaves = [torch.cat([t, t.new_zeros((width - mine, *t.shape[1:]))]) for t in leaves]
    gathered = gather(_tree.unflatten(spec, leaves))
    if lay.world_size == lay.data_size and not uneven and info.padding == 0:
        return gathered

    def trim(t: torch.Tensor) -> torch.Tensor:
        parts = t.split(width)
        return torch.cat([parts[g][: info.sizes[d]] for d, g in enumerate(shards)])[:keep]

    return _tree.map(trim, gathered)


def _agree(signature: list[Any], problem: str | None, step: int) -> None:
    """Every rank passed the same kind of `x` (objects, or tensors of the same shapes beyond dim 0 and dtypes)
    and none has a problem of its own: one all-gather of a checksum; where they differ, the ranks' signatures
    and problems in a `ValueError` on every rank (a generation padded to each rank's own longest sequence
    would otherwise fail inside the backend's all-gather)."""
    code = zlib.crc32(repr((signature, problem is not None)).encode())
    codes = gather(torch.tensor([code], dtype=torch.int64))
    if bool((codes == code).all()):
        return  # (the same problem on every rank: each raises it)
    # every rank saw the mismatch, so every rank takes this second collective
    every = gather_object((signature, problem))

    def described(sig: list[Any]) -> str:
        if sig == [("objects",)]:
            return "a list of Python objects"
        return ", ".join(
            f"{name} ({', '.join(['n', *map(str, shape)])}) {dtype.removeprefix('torch.')}"
            for name, shape, dtype in sig
        )

    problems = [f"rank {rank}: {p}" for rank, (_, p) in enumerate(every) if p]
    if problems:
        raise ValueError("; ".join(problems))
    shown = "; ".join(f"rank {rank}: {described(sig)}" for rank, (sig, _) in enumerate(every))
    raise ValueError(
        f"gather_for_metrics: the ranks passed different x beyond dim 0 (global batch {step} of the epoch): "
        f"{shown}. Pad them to one shape first, e.g. af.dist.pad_across_processes(x, dim=1) for sequences "
        "each rank padded to its own longest"
    )

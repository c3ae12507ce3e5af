"""Splitting a model into pipeline stages: where the cuts go, which module belongs to which stage, and the
param-free stand-ins that take the place of other stages' modules on a rank.

Shared by the pipeline-parallel training combinator (`af.pipeline(step, ...)`) and the inference runner
(`af.pipeline(model, split_points, mesh, ...)`).

A split is a list of *split points*: module names, each the first module of a new stage (`["layers.8"]` makes
two stages). Every parameter-holding module belongs to the stage of the last split point at or before it in
`named_modules()` order (registration order, which for Hugging Face decoders and torchtitan-style models is the
forward order): the embeddings go with the first stage, the final norm and the head with the last. A Hugging
Face decoder splits automatically by its decoder layers, balanced by parameter count (`balanced_split`).

Example:
    >>> from torch import nn
    >>> model = nn.Sequential(*[nn.Linear(4, 4) for _ in range(6)])
    >>> split = balanced_split(model, 3)
    >>> split.points
    ('2', '4')
    >>> split.stage_params
    (40, 40, 40)
"""

from __future__ import annotations

import contextlib
import difflib
import math
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import attrs
import torch
from torch import nn

from . import dry_mode
from .blocks import no_split_blocks

__all__ = [
    "holds_stage_params",
    "Split",
    "balanced_split",
    "split_at",
    "decoder_layers",
    "carve",
    "Skip",
    "bypass_forward",
]


@attrs.frozen
class Split:
    """Where a model is cut: `points` (the first module of each stage but the first), the stage of every
    parameter-holding module (`owner`, by module name), and each stage's parameter count."""

    points: tuple[str, ...]
    owner: dict[str, int] = attrs.field(eq=False, repr=False)
    stage_params: tuple[int, ...]
    stage_modules: tuple[tuple[str, ...], ...] = attrs.field(eq=False, repr=False)

    @property
    def n_stages(self) -> int:
        return len(self.points) + 1

    def stages_under(self, name: str) -> set[int]:
        """The stages of the parameter-holding modules at or under the module `name`."""
        return {s for n, s in self.owner.items() if n == name or n.startswith(name + ".")}

    def describe(self) -> str:
        """One line per stage: where it starts and ends and its parameter count (printed at lowering)."""
        lines = []
        for s, (mods, n) in enumerate(zip(self.stage_modules, self.stage_params)):
            start = self.points[s - 1] if s > 0 else (mods[0] if mods else "-")
            end = f"before {self.points[s]}" if s < len(self.points) else (mods[-1] if mods else "-")
            lines.append(f"stage {s}: {start} .. {end} ({n / 1e6:.2f}M params)")
        return "\n".join(lines)


def _holders(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The modules that hold parameters directly, in registration order."""
    return [(n, m) for n, m in model.named_modules() if any(True for _ in m.parameters(recurse=False))]


def split_at(model: nn.Module, points: Sequence[str], *, who: str = "af.pipeline") -> Split:
    """The split of `model` before each module named in `points` (in forward order). Raises ValueError naming
    a point that is no module (with the closest names), points out of order, or a stage left without params.
    """
    names = [n for n, _ in model.named_modules()]
    position = {n: i for i, n in enumerate(names)}
    for p in points:
        if p not in position:
            close = difflib.get_close_matches(p, names, n=3)
            hint = f"; did you mean {close}?" if close else f"; some module names: {names[1:6]}"
            raise ValueError(f"{who}: split point {p!r} is not a module of the model{hint}")
    at = [position[p] for p in points]
    if len(set(points)) != len(points) or at != sorted(at):
        raise ValueError(
            f"{who}: split points {list(points)} must be distinct and in forward (registration) order"
        )
    holders = _holders(model)
    owner: dict[str, int] = {}
    modules: list[list[str]] = [[] for _ in range(len(points) + 1)]
    counts = [0] * (len(points) + 1)
    seen: set[int] = set()
    for name, m in holders:
        stage = sum(1 for a in at if a <= position[name])
        owner[name] = stage
        modules[stage].append(name)
        for param in m.parameters(recurse=False):
            if id(param) not in seen:  # a tied weight counts once, with its first holder
                seen.add(id(param))
                counts[stage] += param.numel()
    empty = [s for s, mods in enumerate(modules) if not mods]
    if empty:
        raise ValueError(
            f"{who}: stage {empty[0]} of {len(modules)} has no parameters with split points {list(points)}: "
            "every stage needs at least one module with parameters"
        )
    return Split(tuple(points), owner, tuple(counts), tuple(tuple(m) for m in modules))


def decoder_layers(model: nn.Module) -> list[str]:
    """The names of the model's repeated blocks, in order: a Hugging Face model's `_no_split_modules` blocks
    (`accelfn.blocks.no_split_blocks`: those in a layer stack, so not BERT's `BertEmbeddings`), else the children
    of the `nn.ModuleList` holding the most parameters."""
    found = [name for name, _ in no_split_blocks(model)]
    if found:
        return found
    best, size = None, 0
    for name, m in model.named_modules():
        if isinstance(m, (nn.ModuleList, nn.Sequential)) and len(m) > 1:
            n = sum(p.numel() for p in m.parameters())
            if n > size:
                best, size = name, n
    if best is None:
        raise ValueError(
            "af.pipeline: the model has no repeated blocks to split between stages (no Hugging Face "
            "`_no_split_modules`, no nn.ModuleList of layers): give split_points=['layers.4', ...]"
        )
    prefix = f"{best}." if best else ""
    return [f"{prefix}{c}" for c, _ in model.get_submodule(best).named_children()]


def balanced_split(model: nn.Module, n_stages: int) -> Split:
    """Cut the model's decoder layers into `n_stages` contiguous runs with the largest stage's parameter count
    (embeddings with the first, norm and head with the last) as small as possible."""
    layers = decoder_layers(model)
    if n_stages > len(layers):
        raise ValueError(
            f"af.pipeline: {n_stages} pipeline stages but the model has only {len(layers)} decoder layers "
            f"({layers[0]} .. {layers[-1]}): use a pp size of at most {len(layers)}"
        )
    if n_stages == 1:
        return split_at(model, [])
    size = [sum(p.numel() for p in model.get_submodule(n).parameters()) for n in layers]
    position = {n: i for i, n in enumerate(n for n, _ in model.named_modules())}
    first = position[layers[0]]
    before = sum(  # params before the first layer (the embeddings)
        p.numel() for n, m in _holders(model) if position[n] < first for p in m.parameters(recurse=False)
    )
    after = sum(p.numel() for p in model.parameters()) - before - sum(size)
    if callable(getattr(model, "get_output_embeddings", None)) and _tied_head(model):
        head: Any = getattr(model, "get_output_embeddings")()  # noqa: B009 - nn.Module's attributes type as Tensor
        after += head.weight.numel()  # a tied head still costs its matmul
    cost = list(size)
    cost[0] += before
    cost[-1] += after
    cuts = _min_max_partition(cost, n_stages)
    return split_at(model, [layers[c] for c in cuts])


def _tied_head(model: nn.Module) -> bool:
    head, embed = model.get_output_embeddings(), model.get_input_embeddings()  # type: ignore[operator]
    return (
        head is not None
        and embed is not None
        and getattr(head, "weight", None) is getattr(embed, "weight", 0)
    )


def _min_max_partition(cost: list[int], parts: int) -> list[int]:
    """Start indices (after 0) of `parts` contiguous non-empty runs of `cost` minimising the largest run's sum
    (dynamic programming; ties go to the earliest cut)."""
    n = len(cost)
    prefix = [0]
    for c in cost:
        prefix.append(prefix[-1] + c)
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(parts + 1)]
    cut = [[0] * (n + 1) for _ in range(parts + 1)]
    best[0][0] = 0
    for k in range(1, parts + 1):
        for i in range(k, n + 1):
            for j in range(k - 1, i):
                v = max(best[k - 1][j], prefix[i] - prefix[j])
                if v < best[k][i]:
                    best[k][i], cut[k][i] = v, j
    out, i = [], n
    for k in range(parts, 0, -1):
        i = cut[k][i]
        out.append(i)
    return sorted(out)[1:]


_CARVED: weakref.WeakSet[nn.Module] = weakref.WeakSet()  # models cut down to some pipeline stages


def is_carved(model: nn.Module) -> bool:
    """Whether `model` was cut down to some pipeline stages (its other modules are stand-ins)."""
    return model in _CARVED


def holds_stage_params(params: dict[str, Any]) -> bool:
    """Whether `params` (a state's) are those of a model cut down to its pipeline stages: such a state holds a
    part of a checkpoint's leaves (the other stages' are in the same checkpoint, for the other ranks)."""
    if not _CARVED:
        return False
    ids = {id(p) for m in list(_CARVED) for p in m.parameters()}
    return any(id(v) in ids for v in params.values())


# ---- stand-ins for other stages' modules ------------------------------------------------------------------------
_RECORDING: list[set[str]] = []  # the sets `recording_made_up` is filling


@contextlib.contextmanager
def recording_made_up() -> Iterator[set[str]]:
    """The class names of the modules whose stand-ins make up NaN inside it (`af.pipeline` records a stage's
    first micro-batch, and names them if its output is NaN); outside it, stand-ins record nothing.

    Example:
        >>> with recording_made_up() as names:
        ...     _ = bypass_forward(nn.Linear(2, 3))(torch.ones(1, 2))
        >>> names
        {'Linear'}
    """
    names: set[str] = set()
    _RECORDING.append(names)
    try:
        yield names
    finally:
        _RECORDING.remove(names)


def bypass_forward(module: nn.Module) -> Callable[..., Any]:
    """A forward that costs nothing and returns what the model's next module expects in shape: zeros of the
    output shape for an embedding or a Linear (an embedding's output feeds the residual stream), the hidden
    state (first argument, or `hidden_states=` / `inputs_embeds=`) unchanged for anything else (a decoder layer, a
    norm); token ids into a module holding an embedding (BERT's `BertEmbeddings(input_ids=...)`) give zeros of its
    width. A module holding a layer stack (a `ModuleList` of several) called without a positional input is not a
    split point: a TypeError. The made-up tensors are NaN outside a dry run: the stage's own input replaces them,
    and a model that reads one by another path (Gemma3n's per-layer inputs, T5's position bias) shows NaN rather
    than training on zeros; a dry run's are zeros (fake tensors: only their shapes count).

    Example:
        >>> emb = bypass_forward(nn.Embedding(10, 4))
        >>> emb(torch.tensor([[1, 2]])).shape, bool(emb(torch.tensor([[1]])).isnan().all())
        (torch.Size([1, 2, 4]), True)
    """

    def made_up(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        if dry_mode.active() is not None or not dtype.is_floating_point:
            return torch.zeros(shape, dtype=dtype, device=device)
        for names in _RECORDING:
            names.add(type(module).__name__)
        return torch.full(shape, math.nan, dtype=dtype, device=device)

    if isinstance(module, nn.Embedding):
        dim, dtype = module.embedding_dim, module.weight.dtype

        def embedding(ids: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
            return made_up((*ids.shape, dim), dtype, ids.device)

        return embedding
    if isinstance(module, nn.Linear):
        out, dtype = module.out_features, module.weight.dtype

        def linear(x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
            return made_up((*x.shape[:-1], out), dtype, x.device)

        return linear

    inner = next((m for m in module.modules() if isinstance(m, nn.Embedding)), None)
    stack = any(isinstance(m, nn.ModuleList) and len(m) > 1 for m in module.modules())

    def passthrough(*args: Any, **kwargs: Any) -> Any:
        named = (kwargs.get(k) for k in ("hidden_states", "inputs_embeds", "input_ids"))
        x = args[0] if args else next((v for v in named if v is not None), None)
        if x is None or (stack and not args):
            what = (
                "with keywords only, and it holds a layer stack (a split point would be inside it)"
                if x is not None
                else "without a positional input or hidden_states / inputs_embeds / input_ids"
            )
            raise TypeError(
                f"af.pipeline: a {type(module).__name__} of another stage was called {what}: split points must be "
                "modules that take the hidden state as their first argument"
            )
        if inner is not None and isinstance(x, torch.Tensor) and not x.is_floating_point():
            # token ids into a module holding the embeddings (BERT's `bert.embeddings`, called with keywords)
            return made_up((*x.shape, inner.embedding_dim), inner.weight.dtype, x.device)
        return x

    return passthrough


class Skip(nn.Module):
    """The stand-in for a module another pipeline stage owns: no parameters of its own (except `keep`, weights
    tied to a module this stage owns, held under their original names), and a forward that computes nothing
    (`bypass_forward`). What it makes up (an embedding's or a Linear's output) is NaN outside a dry run: the
    stage's received input replaces it, so a model that reads it by another path (Gemma3n's per-layer inputs,
    Zamba's shared blocks, T5's position bias) gives a NaN loss (`metrics["loss"]`; af's step does not stop on
    it, an fp16 step skips every update; the stage's first micro-batch warns, naming the stand-ins it called)
    rather than training on zeros. A dry run's are zeros (fake tensors: only shapes count). A keywords-only call
    of a module holding a layer stack raises TypeError (a wrong carve).

    Example:
        >>> skip = Skip(nn.Embedding(10, 4), {})
        >>> skip, bool(skip(torch.tensor([[1, 2]])).isnan().all())
        (Skip(stands for Embedding), True)
    """

    def __init__(self, original: nn.Module, keep: dict[str, nn.Parameter]) -> None:
        super().__init__()
        self.stands_for = type(original).__name__
        self._bypass = bypass_forward(original)
        for name, p in keep.items():
            self.register_parameter(name, p)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self._bypass(*args, **kwargs)

    def extra_repr(self) -> str:
        return f"stands for {self.stands_for}"


def carve(model: nn.Module, split: Split, stages: Sequence[int]) -> dict[str, tuple[int, ...]]:
    """Keep on `model` only the modules of `stages` (this rank's): every outermost module whose parameters all
    belong to other stages becomes a `Skip` (one holding, deeper down, a weight tied to this rank's stages stays,
    its children become `Skip`s). A weight tied between modules of several stages (a head tied to the
    embedding) stays on each stage that uses it, under its first holder's name. Returns `{param name: stages
    holding it}` for the tied weights this rank holds that more than one stage uses (their gradients are summed
    between those stages)."""
    mine = set(stages)
    holders_of: dict[int, list[tuple[str, str, int]]] = {}
    for name, m in _holders(model):
        for pname, p in m.named_parameters(recurse=False):
            holders_of.setdefault(id(p), []).append((name, pname, split.owner[name]))
    tied: dict[str, tuple[int, ...]] = {}
    for uses in holders_of.values():
        owners = tuple(sorted({s for _, _, s in uses}))
        if len(owners) > 1 and any(s in mine for s in owners):
            first, pname, _ = uses[0]
            tied[f"{first}.{pname}" if first else pname] = owners

    def visit(prefix: str, module: nn.Module) -> None:
        for child, sub in list(module.named_children()):
            name = f"{prefix}.{child}" if prefix else child
            under = split.stages_under(name)
            if not under or under & mine:
                if under:
                    visit(name, sub)
                continue
            keep: dict[str, nn.Parameter] = {}
            for pname, p in sub.named_parameters():
                uses = holders_of[id(p)]
                if any(s in mine for _, _, s in uses) and f"{uses[0][0]}.{uses[0][1]}" == f"{name}.{pname}":
                    keep[pname] = p  # this stage uses the weight, and this module is its first holder
            deep = [pname for pname in keep if "." in pname]
            if deep and not any(True for _ in sub.parameters(recurse=False)):
                # a tied weight inside (BERT's word embeddings inside `bert.embeddings`, tied to the head): the
                # module stays, its children become stand-ins (the weight's holder keeps it), so its forward runs
                # on stand-ins and takes its arguments as it always does (BertEmbeddings takes keywords)
                visit(name, sub)
                continue
            if deep:
                raise NotImplementedError(
                    f"af.pipeline: {name}.{deep[0]} is tied to a module of this stage but sits inside {name}, which "
                    "another stage owns and which holds parameters of its own: split so that tied weights' holders "
                    "are leaves"
                )
            module.register_module(child, Skip(sub, keep))

    visit("", model)
    _CARVED.add(model)
    return tied

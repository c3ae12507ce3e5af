"""A Hugging Face model's repeated blocks (its decoder layers), by one rule shared by `af.pipeline`'s split
(`accelfn.stages.decoder_layers`), `af.remat` and sequence parallel.

transformers' `_no_split_modules` names the classes a device map keeps whole: the layers, but also modules that
are not repeated, such as BERT's `BertEmbeddings`. The blocks are the outermost modules of those classes that are
items of an `nn.ModuleList` / `nn.Sequential` (the layer stacks: BERT's `encoder.layer`, both of T5's stacks, a
vision-language model's vision tower and language model); where no match is such an item, every outermost match
(a model whose blocks sit elsewhere keeps them). Matches that are items of an `nn.ModuleDict` beside those of a list
are named in a warning, and taken instead of the list's where they hold more parameters (the larger stack is the
model's layer stack).

Example:
    >>> from transformers import BertConfig, BertModel
    >>> bert = BertModel(BertConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64))
    >>> sorted(bert._no_split_modules)
    ['BertEmbeddings', 'BertLayer']
    >>> [name for name, _ in no_split_blocks(bert)]
    ['encoder.layer.0', 'encoder.layer.1']
"""

from __future__ import annotations

import warnings
from collections.abc import Collection

from torch import nn

__all__ = ["no_split_blocks", "outermost"]


def outermost(
    model: nn.Module, classes: Collection[str], *, repeated: bool = False
) -> list[tuple[str, nn.Module]]:
    """`(name, module)` of the outermost modules whose class name is in `classes`, in registration order;
    `repeated=True`: only those that are items of an `nn.ModuleList` / `nn.Sequential` (the search goes on
    inside the others).

    Example:
        >>> net = nn.Sequential(nn.Linear(2, 2), nn.ModuleDict({"head": nn.Linear(2, 2)}))
        >>> [n for n, _ in outermost(net, ["Linear"])], [n for n, _ in outermost(net, ["Linear"], repeated=True)]
        (['0', '1.head'], ['0'])
    """
    found: list[tuple[str, nn.Module]] = []
    stack: list[tuple[str, nn.Module, nn.Module | None]] = [("", model, None)]
    while stack:
        name, m, parent = stack.pop()
        if (
            name
            and type(m).__name__ in classes
            and (not repeated or isinstance(parent, (nn.ModuleList, nn.Sequential)))
        ):
            found.append((name, m))
            continue
        children = [(f"{name}.{c}" if name else c, sub, m) for c, sub in m.named_children()]
        stack.extend(reversed(children))
    return found


def no_split_blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The model's blocks by its `_no_split_modules` (the module docstring's rule), `(name, module)` in
    registration order; empty for a model without `_no_split_modules` or with no module of those classes."""
    classes = set(getattr(model, "_no_split_modules", None) or [])
    if not classes:
        return []
    blocks = outermost(model, classes, repeated=True)
    if not blocks:
        return outermost(model, classes)
    names = [n for n, _ in blocks]
    keyed = [  # matches held in a ModuleDict, outside the blocks found: not a list's items, so not taken
        f"{p}.{c}" if p else c
        for p, m in model.named_modules()
        if isinstance(m, nn.ModuleDict)
        for c, sub in m.named_children()
        if type(sub).__name__ in classes
    ]
    left = [  # outside the blocks found, not holding one (a ModuleDict of whole models), outermost
        k
        for k in keyed
        if not any(k == n or k.startswith(n + ".") or n.startswith(k + ".") for n in names)
        and not any(k.startswith(o + ".") for o in keyed)
    ]
    if not left:
        return blocks
    held = [(k, model.get_submodule(k)) for k in left]
    if _size(held) > _size(blocks):
        # the ModuleDict holds the larger stack: it is the model's layer stack (as `decoder_layers`' fallback takes
        # the list holding the most parameters); a pipeline balances stages by blocks, remat saves by them
        taken, other, where = held, names, "in a layer list"
    else:
        taken, other, where = blocks, left, "in a ModuleDict"
    warnings.warn(
        f"{type(model).__name__}: {' / '.join(sorted(classes))} modules sit both in a layer list and in a ModuleDict; the "
        f"blocks (pipeline split points, remat, compile regions) are the larger stack, {taken[0][0]} ... "
        f"({len(taken)}); not taken, {where}: {', '.join(other[:4])}{' ...' if len(other) > 4 else ''}",
        stacklevel=2,
    )
    return taken


def _size(modules: list[tuple[str, nn.Module]]) -> int:
    return sum(p.numel() for _, m in modules for p in m.parameters())

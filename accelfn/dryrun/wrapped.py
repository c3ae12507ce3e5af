"""The tensors a wrapper tensor subclass holds (a DTensor's local shard, torchao's float8 data and scale), read
without running any op on them.

`__tensor_flatten__` names them, but some implementations read a value to decide: torchao's
`WeightWithDynamicFloat8CastTensor` asks `if self._precomputed_scale:` (a tensor's truth value), which a fake
tensor cannot answer once FSDP's float8 scales are precomputed (the second step of a dry run: its micro-batch
search). There the tensors are taken from the instance's attributes instead.

Example:
    >>> import torch
    >>> from accelfn.dryrun.wrapped import inner_tensors
    >>> inner_tensors(torch.ones(2))  # a plain tensor holds no others
    []
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

__all__ = ["inner_tensors"]


def inner_tensors(x: Any) -> list[torch.Tensor]:
    """The tensors wrapper subclass `x` holds, in `__tensor_flatten__`'s order; [] for anything else."""
    if not is_traceable_wrapper_subclass(x):
        return []
    # a flatten that reads a value fails on a fake tensor (DataDependentOutputException) or a meta one: then the
    # tensors the instance holds as attributes (any cached beside them counted too; none in __slots__)
    try:
        names = list(x.__tensor_flatten__()[0])
    except RuntimeError:
        names = [name for name, value in vars(x).items() if isinstance(value, torch.Tensor)]
    return [getattr(x, name) for name in names]

"""Data loading for data-parallel training: a sharded, resumable `DataLoader` and `gather_for_metrics`.

Example:
    >>> import accelfn as af
    >>> loader = af.data.DataLoader(range(6), batch_size=2, shuffle=True, seed=0)
    >>> sorted(i for b in loader for i in b.tolist())
    [0, 1, 2, 3, 4, 5]
"""

from ..collective.metrics import gather_for_metrics
from .batches import BatchInfo
from .layout import DataLayout
from .loader import DataLoader

__all__ = ["DataLoader", "gather_for_metrics", "BatchInfo", "DataLayout"]

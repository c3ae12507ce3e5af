"""Count the bytes of tensor storage allocated and still alive inside a block, and their peak (tests only).

torch.cuda's memory statistics do not exist on CPU; this dispatch mode sees every op's outputs (DTensor's too:
it lets DTensor lower an op to local ops, which come back here) and watches each new storage until it is freed.

    with LiveBytes() as live:
        loss = f(logits); loss.backward()
    live.peak  # the most bytes allocated inside the block alive at once
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class LiveBytes(TorchDispatchMode):
    """Peak and current bytes of the storages created by the ops run inside it (inputs made before are free);
    `fake=True`: of fake tensors too (a run on fake tensors)."""

    def __init__(self, *, fake: bool = False) -> None:
        super().__init__()
        self._fake = fake  # count fake tensors too (a dry run's); else they hold no memory (DTensor's shape
        # propagation makes fake tensors of an op's arguments)
        self.now = 0
        self.peak = 0
        self._live: dict[int, tuple[int, Any]] = {}

    def _freed(self, key: int) -> None:
        nbytes, _ = self._live.pop(key, (0, None))
        self.now -= nbytes

    def _see(self, t: torch.Tensor, *, new: bool) -> None:
        """Watch `t`'s storage; count its bytes if `new` (an op's output), else (an input from before) not."""
        if t.device.type == "meta" or (not self._fake and getattr(t, "fake_mode", None) is not None):
            return
        try:
            st = t.untyped_storage()
        except Exception:  # noqa: BLE001 - storage-less tensors
            return
        key = st._cdata
        if key in self._live:
            return
        nbytes = st.nbytes() if new else 0
        self._live[key] = (nbytes, weakref.ref(st, lambda _r, key=key: self._freed(key)))
        self.now += nbytes
        self.peak = max(self.peak, self.now)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if any(t.__name__ == "DTensor" for t in types):
            return NotImplemented
        for t in tree_leaves((args, kwargs or {})):
            if isinstance(t, torch.Tensor):
                self._see(t, new=False)
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self._see(t, new=True)
        return out

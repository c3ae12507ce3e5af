"""Peak memory by category (activations, temporaries, ...) of a CPU step, from torch.profiler's memory profile.

torch's memory timeline (`torch.profiler._memory_profiler`, what `export_memory_timeline` draws) tells each
allocation's category: parameters, optimizer state, gradients, activations (tensors kept for the backward),
temporaries. On a CPU, where no allocator statistics exist, it is the one way to see activation memory.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch.profiler import ProfilerActivity, profile


def peak_bytes(run: Callable[[], Any]) -> dict[str, int]:
    """Run `run()` under the profiler; the peak live bytes of each category and of all together ("total")."""
    from torch.profiler._memory_profiler import Action

    with profile(
        activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True, with_stack=True
    ) as prof:
        run()
    mp = prof._memory_profile()
    live: dict[str, int] = {}
    peak: dict[str, int] = {}

    def name(key: Any, version: int) -> str:
        c = mp._categories.get(key, version)
        return c.name.lower() if c is not None else "unknown"

    def add(cat: str, n: int) -> None:
        live[cat] = live.get(cat, 0) + n
        live["total"] = live.get("total", 0) + n
        for k in (cat, "total"):
            peak[k] = max(peak.get(k, 0), live[k])

    for _, action, (key, version), size in mp.timeline:
        if action in (Action.PREEXISTING, Action.CREATE):
            add(name(key, version), size)
        elif action == Action.INCREMENT_VERSION:
            add(name(key, version), -size)
            add(name(key, version + 1), size)
        elif action == Action.DESTROY:
            add(name(key, version), -size)
    return peak

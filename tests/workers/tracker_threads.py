"""Count the storages the dry run's tracker saw freed on a thread other than the main one: gloo's worker thread
dropping a collective's tensors after the wait returned, at a point of the step that varies from run to run (a
real run measured a block's gradients, 726,016 B, live at an fsdp --bf16 rank's peak in 1 run of 15). A real run
compared with a dry run should see none: `measure_real` gives the backend copies.

    with counting_frees_off_the_main_thread() as off:
        measure_real(script, args)
    off  # {"frees": 0, "bytes": 0}
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

from accelfn.dryrun.tracker import StepTracker


@contextlib.contextmanager
def counting_frees_off_the_main_thread() -> Iterator[dict[str, int]]:
    """The frees (and their bytes) any `StepTracker` made inside the block sees on another thread."""
    counts = {"frees": 0, "bytes": 0}
    freed = StepTracker._freed

    def counting(self: StepTracker, key: int) -> None:
        if threading.current_thread() is not threading.main_thread():
            rec = self._live.get(key)
            counts["frees"] += 1
            counts["bytes"] += rec.nbytes if rec is not None else 0
        freed(self, key)

    StepTracker._freed = counting  # type: ignore[method-assign]
    try:
        yield counts
    finally:
        StepTracker._freed = freed  # type: ignore[method-assign]

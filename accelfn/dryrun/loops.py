"""Where the script's training loop ends: a step object called again right after its own call is either the whole
loop coming round, or an inner loop (a GAN's 5 critic steps per generator step). The dry run tells them apart
from the script's own code: the call's innermost loop in its frame (a backward jump in the bytecode) and a loop
around it in the same frame. With no loop around it, the loop came round. With one, a line tracer on that frame
says when the inner loop is left: still inside the outer loop (the rest of the iteration runs, other step
objects are called), or past it too (the script's loop ended: it is stopped there, before the code after the
loop runs).

Example:
    >>> import sys
    >>> def body():
    ...     found = []
    ...     for _ in range(2):
    ...         for _ in range(3):
    ...             found.append(loop_ranges(sys._getframe()))
    ...     return found[0]
    >>> inner, outer = body()
    >>> inner[0] > outer[0] and inner[1] < outer[1]
    True
"""

from __future__ import annotations

import dis
import sys
from pathlib import Path
from types import CodeType, FrameType
from typing import Any

__all__ = ["loop_ranges", "script_frame", "LoopWatch"]

_LIBRARY = (str(Path(__file__).parent.parent), str(Path(dis.__file__).parent))


def _loops(code: CodeType) -> list[tuple[int, int]]:
    """(start, end) byte offsets of the loops of `code`: every backward jump, from its target to itself."""
    out = []
    for ins in dis.get_instructions(code):
        if ins.opcode in dis.hasjrel and isinstance(ins.argval, int) and ins.argval < ins.offset:
            out.append((ins.argval, ins.offset))
    return out


def loop_ranges(frame: FrameType) -> tuple[tuple[int, int] | None, tuple[int, int] | None]:
    """The innermost loop of `frame`'s code around the instruction it is running, and the innermost loop around
    that one (None where there is none)."""
    at = frame.f_lasti
    around = sorted((r for r in _loops(frame.f_code) if r[0] <= at <= r[1]), key=lambda r: r[1] - r[0])
    inner = around[0] if around else None
    outer = (
        next((r for r in around[1:] if r[0] <= inner[0] and inner[1] <= r[1] and r != inner), None)
        if inner
        else None
    )
    return inner, outer


def script_frame() -> FrameType | None:
    """The innermost frame of the user's code (outside accelfn, torch and the standard library)."""
    import torch

    library = (*_LIBRARY, str(Path(torch.__file__).parent))
    frame = sys._getframe(1)
    while frame is not None and (
        frame.f_code.co_filename.startswith(library) or frame.f_code.co_filename.startswith("<")
    ):
        frame = frame.f_back
    return frame


class LoopWatch:
    """Traces the lines of `frame`: `inner_done` once it leaves the `inner` loop within `outer`; raises `stop`
    (an exception instance) in the frame when it leaves `outer` (the script's loop ended, before the code after
    it runs). `end()` stops the tracing (the dry run calls it at the next training call)."""

    def __init__(
        self, frame: FrameType, inner: tuple[int, int], outer: tuple[int, int], stop: BaseException
    ) -> None:
        self.frame, self.inner, self.outer, self.stop = frame, inner, outer, stop
        self.inner_done = False
        self.index = 0  # the step object whose calls are skipped
        self._saved: Any = None
        self._active = False

    def start(self) -> None:
        self._saved = sys.gettrace()
        sys.settrace(
            self._global if self._saved is None else self._saved
        )  # tracing on (the frame's own tracer)
        self.frame.f_trace_lines = True
        self.frame.f_trace = self._trace
        self._active = True

    def end(self) -> None:
        if not self._active:
            return
        self._active = False
        self.frame.f_trace = None
        sys.settrace(self._saved)

    @staticmethod
    def _global(frame: FrameType, event: str, arg: Any) -> None:
        return None  # other frames are not traced

    def _trace(self, frame: FrameType, event: str, arg: Any) -> Any:
        if event == "line" and frame is self.frame:
            at = frame.f_lasti
            if not self.outer[0] <= at <= self.outer[1]:  # past both loops: the script's loop ended
                self.end()
                raise self.stop
            if not self.inner[0] <= at <= self.inner[1]:  # the rest of the outer loop's body (traced until
                self.inner_done = True  # the next training call ends the tracing)
        elif event == "return" and frame is self.frame:
            self.end()
            return None
        return self._trace

"""Where the script's training loop ends: a step object called again right after its own call is either the whole
loop coming round, or an inner loop (a GAN's 5 critic steps per generator step). The dry run tells them apart
from the script's own source: the innermost `for` / `while` around the call, and a loop around that one in the
same function. With no loop around it, the loop came round. With one, a line tracer on the script's frame says
when the inner loop is left: still inside the outer loop (the rest of the iteration runs, other step objects
are called), or past it too (the script's loop ended: it is stopped there, before the code after the loop).
Lines, not bytecode, decide (`with`, `try` and `continue` compile to jumps that differ by Python version).

Example:
    >>> import sys
    >>> def body():
    ...     found = []
    ...     for _ in range(2):
    ...         for _ in range(3):
    ...             found.append(loop_lines(sys._getframe()))
    ...     return found[0]
    >>> inner, outer = body()
    >>> inner[0] == outer[0] + 1 and inner[1] == outer[1]
    True
"""

from __future__ import annotations

import ast
import linecache
import os
import sys
from pathlib import Path
from types import FrameType
from typing import Any

__all__ = ["loop_lines", "script_frame", "LoopWatch"]

_DEFS = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
_LOOPS = (ast.For, ast.AsyncFor, ast.While)


def _loops_around(tree: ast.AST, line: int) -> list[ast.AST]:
    """The loops of `tree` around `line` in the same function as it, outermost first: those around the
    deepest node that spans the line (a function or class resets them: its loops are its own)."""
    best: list[ast.AST] = []

    def visit(node: ast.AST, loops: list[ast.AST]) -> None:
        nonlocal best
        for child in ast.iter_child_nodes(node):
            lo, hi = getattr(child, "lineno", None), getattr(child, "end_lineno", None)
            if lo is None or hi is None:
                visit(child, loops)
                continue
            if not lo <= line <= hi:
                continue
            inside = (
                [] if isinstance(child, _DEFS) else [*loops, child] if isinstance(child, _LOOPS) else loops
            )
            best = inside
            visit(child, inside)

    visit(tree, [])
    return best


def loop_lines(frame: FrameType) -> tuple[tuple[int, int] | None, tuple[int, int] | None]:
    """The (first, last) lines of the innermost loop around the line `frame` is running, and of the innermost
    loop around that one in the same function (None where there is none, or the source is unavailable)."""
    lines = linecache.getlines(frame.f_code.co_filename, frame.f_globals)
    if not lines:
        return None, None
    try:
        tree = ast.parse("".join(lines))
    except SyntaxError:
        return None, None
    loops = _loops_around(tree, frame.f_lineno)
    spans = [(n.lineno, n.end_lineno or n.lineno) for n in loops]  # type: ignore[attr-defined]
    inner = spans[-1] if spans else None
    outer = spans[-2] if len(spans) > 1 else None
    return inner, outer


def script_frame() -> FrameType | None:
    """The innermost frame of the user's code (outside accelfn, torch and the standard library)."""
    import torch

    library = tuple(
        str(p) + os.sep
        for p in (Path(__file__).parent.parent, Path(torch.__file__).parent, Path(ast.__file__).parent)
    )
    frame: FrameType | None = sys._getframe(1)
    while frame is not None and (
        frame.f_code.co_filename.startswith(library) or frame.f_code.co_filename.startswith("<")
    ):
        frame = frame.f_back
    return frame


class LoopWatch:
    """Traces the lines of `frame`: `inner_done` once it leaves the `inner` loop's lines within `outer`'s;
    raises `stop` (an exception instance) in the frame when it leaves `outer` (the script's loop ended, before
    the code after it runs). `end()` stops the tracing (the dry run calls it at the next training call) and
    `restore()` puts back the tracers that were installed before."""

    def __init__(
        self, frame: FrameType, inner: tuple[int, int], outer: tuple[int, int], stop: BaseException
    ) -> None:
        self.frame, self.inner, self.outer, self.stop = frame, inner, outer, stop
        self.inner_done = False
        self.index = 0  # the step object whose calls are skipped
        self._saved: Any = None
        self._saved_frame: Any = None
        self._active = False

    def start(self) -> None:
        self._saved, self._saved_frame = sys.gettrace(), self.frame.f_trace
        sys.settrace(
            self._global if self._saved is None else self._saved
        )  # tracing on (the frame's own tracer)
        self.frame.f_trace_lines = True
        self.frame.f_trace = self._trace
        self._active = True

    def end(self) -> None:
        if self._active:
            self._active = False
            self.restore()

    def restore(self) -> None:
        self.frame.f_trace = self._saved_frame
        sys.settrace(self._saved)

    @staticmethod
    def _global(frame: FrameType, event: str, arg: Any) -> None:
        return None  # other frames are not traced

    def _trace(self, frame: FrameType, event: str, arg: Any) -> Any:
        if event == "line" and frame is self.frame:
            line = frame.f_lineno
            if not self.outer[0] <= line <= self.outer[1]:  # past both loops: the script's loop ended
                self.end()
                raise self.stop
            if not self.inner[0] <= line <= self.inner[1]:  # the rest of the outer loop's body (traced until
                self.inner_done = True  # the next training call ends the tracing)
        elif event == "return" and frame is self.frame:
            self.end()
            return None
        return self._trace

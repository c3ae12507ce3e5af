"""Worker entry point: run the user's script (or ``-m module``) and record an uncaught exception.

The launcher starts ``python -u <this file> [-m] target args...`` in every process. The exception is
written in torch elastic's error-file format (``TORCHELASTIC_ERROR_FILE``), so the launcher can name
the failing rank and show its traceback even when the script does not use ``@record``. Executed by
path, so it imports neither torch nor accelfn: the worker starts as fast as with ``python script.py``.
"""

import json
import os
import runpy
import sys
import time
import traceback


def _user_traceback(exc: BaseException) -> str:
    """The traceback without this file's and runpy's frames: it starts in the user's code."""
    tb = exc.__traceback__
    while tb is not None and (
        tb.tb_frame.f_code.co_filename in (__file__, "<frozen runpy>")
        or tb.tb_frame.f_code.co_filename.endswith("runpy.py")
    ):
        tb = tb.tb_next
    return "".join(traceback.format_exception(type(exc), exc, tb))


def _rich_traceback(exc: BaseException, plain: str) -> str:
    """With ``ACCELFN_RICH=1``: the traceback rendered by rich (source lines around each frame, locals with
    ``ACCELFN_RICH=locals``), as plain text so that logs and the launcher's report stay readable. Falls back to
    the plain traceback, saying why, when rich is not installed."""
    mode = os.environ.get("ACCELFN_RICH", "").strip().lower()
    if mode in ("", "0", "false", "no"):
        return plain
    try:
        import io

        from rich.console import Console
        from rich.traceback import Traceback
    except ImportError:
        return plain + "(ACCELFN_RICH is set but rich is not installed: pip install 'accelfn[rich]')\n"
    tb = exc.__traceback__
    while tb is not None and (
        tb.tb_frame.f_code.co_filename == __file__ or "runpy" in tb.tb_frame.f_code.co_filename
    ):
        tb = tb.tb_next
    console = Console(file=io.StringIO(), width=110, color_system=None, record=True)
    console.print(Traceback.from_exception(type(exc), exc, tb, show_locals=mode == "locals", width=110))
    return console.export_text()


def _record(exc: BaseException, text: str) -> None:
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path or os.path.exists(path):  # a script using torch's @record wrote it already
        return
    data = {
        "message": {
            "message": f"{type(exc).__name__}: {exc}",
            "extraInfo": {"py_callstack": text, "timestamp": str(int(time.time()))},
        }
    }
    try:
        with open(path, "w") as f:
            json.dump(data, f)
    except OSError:
        pass


def _die_with_the_launcher() -> None:
    """Ask Linux to SIGTERM this worker if the launcher dies, even by SIGKILL (the OOM killer, `timeout -s
    KILL`), so no worker is left running with nobody to collect it."""
    if not sys.platform.startswith("linux"):
        return
    try:
        import ctypes
        import signal

        libc = ctypes.CDLL(None, use_errno=True)
        pr_set_pdeathsig = 1
        libc.prctl(pr_set_pdeathsig, signal.SIGTERM, 0, 0, 0)
        if os.getppid() == 1:  # the launcher died before prctl: do not run orphaned
            sys.exit("accelfn launch exited before this worker started")
    except (OSError, AttributeError):
        pass


def main() -> None:
    _die_with_the_launcher()
    args = sys.argv[1:]
    if not args:
        sys.exit("usage: _bootstrap.py [-m] TARGET [ARGS...]")
    try:
        if args[0] == "-m":
            sys.argv = [args[1], *args[2:]]
            sys.path[0] = os.getcwd()  # as `python -m` does
            runpy.run_module(args[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = list(args)
            sys.path[0] = os.path.dirname(os.path.abspath(args[0]))  # as `python script.py` does
            runpy.run_path(args[0], run_name="__main__")
    except (SystemExit, KeyboardInterrupt):
        raise
    except BaseException as exc:
        text = _rich_traceback(exc, _user_traceback(exc))
        _record(exc, text)
        sys.stderr.write(text)
        sys.stderr.flush()
        sys.exit(1)


if __name__ == "__main__":
    main()

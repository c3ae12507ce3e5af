"""`ACCELFN_RICH=1`: rich tracebacks for scripts run without the launcher (the launcher's workers render theirs
in `accelfn/launch/_bootstrap.py`, so that the launcher's failure report shows them).

`ACCELFN_RICH=locals` also shows each frame's local variables. Nothing happens unless it is set.
"""

from __future__ import annotations

import os
import sys

__all__ = ["install_if_requested"]


def install_if_requested() -> bool:
    """Install rich's traceback handler when `ACCELFN_RICH` asks for it (and rich is installed)."""
    mode = os.environ.get("ACCELFN_RICH", "").strip().lower()
    if mode in ("", "0", "false", "no") or "accelfn.launch._bootstrap" in sys.modules:
        return False
    try:
        from rich.traceback import install
    except ImportError:
        sys.stderr.write(
            "accelfn: ACCELFN_RICH is set but rich is not installed: pip install 'accelfn[rich]'\n"
        )
        return False
    install(show_locals=mode == "locals", width=110)
    return True

"""`notebook_launch`: run a function on N processes from a notebook or a Python session (torch's elastic agent).

Example:
    >>> from accelfn.launch.notebook import notebook_launch
    >>> callable(notebook_launch)
    True
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from .. import launch_env as contract
from .launcher import LaunchOptions, _failure_report, launch_config, resolve

__all__ = ["notebook_launch"]


@contextlib.contextmanager
def _environ(changes: Mapping[str, str]) -> Iterator[None]:
    """Set ``changes`` in ``os.environ`` (which the agent hands to every worker) and restore the whole
    environment afterwards (the agent adds variables of its own too), so the session keeps its own."""
    saved = dict(os.environ)
    os.environ.update(changes)
    try:
        yield
    finally:
        for k in set(os.environ) - set(saved):
            del os.environ[k]
        os.environ.update(saved)


def _interactive(fn: Callable[..., Any]) -> bool:
    """Whether `fn` lives in a ``__main__`` that a spawned process cannot import (a notebook, a REPL, a script
    read from stdin: ``__file__`` ``'<stdin>'``)."""
    main = sys.modules.get("__main__")
    where = getattr(main, "__file__", None)
    return getattr(fn, "__module__", None) == "__main__" and (not where or str(where).startswith("<"))


def _recorded(failure: Any) -> bool:
    """Whether a failed worker recorded a Python error (torch writes "<NONE>" when there is no error file)."""
    data = failure.error_file_data or {}
    message = data.get("message") if isinstance(data, dict) else None
    return isinstance(message, dict) or (isinstance(message, str) and message != "<NONE>")


def _start_method(fn: Callable[..., Any], requested: str | None) -> str:
    method = requested or ("fork" if _interactive(fn) else "spawn")
    if method not in ("spawn", "fork", "forkserver"):
        raise ValueError(f"start_method={method!r} is not one of spawn, fork, forkserver")
    if method == "fork":
        from .. import platforms

        started = "/".join(p.kind.upper() for p in platforms.initialized())
        if started:
            raise RuntimeError(
                f"notebook_launch: {started} was initialized in this process before the workers were forked, and "
                f"a forked process cannot use it. Restart the kernel and call notebook_launch before any {started} "
                "work (move the model to the device inside the function), or define the function in a module "
                "and pass start_method='spawn'"
            )
    return method


def notebook_launch(
    fn: Callable[..., Any],
    args: Sequence[Any] = (),
    *,
    nproc: int = 2,
    device: str = "auto",
    mesh: str | Mapping[str, int] | None = None,
    mixed_precision: str | None = None,
    log_with: str | Sequence[str] | None = None,
    config_file: str | None = None,
    max_restarts: int = 0,
    monitor_interval: float | None = None,
    log_dir: str | None = None,
    tee: str = "none",
    start_method: str | None = None,
) -> list[Any]:
    """Run ``fn(*args)`` on `nproc` processes of this machine and return their results, by rank.

    The processes run on torch's elastic agent, as with `accelfn launch` (`elastic_launch(config, fn)(*args)`),
    with the same environment: ``ACCELFN_DEVICE``, ``ACCELFN_MESH``, ``ACCELFN_MIXED_PRECISION``, ... and
    torch's ``RANK``/``WORLD_SIZE``/``MASTER_ADDR``, so `af.Mesh.from_env()` inside `fn` makes the job's mesh.
    Settings resolve as for `accelfn launch` (these arguments > the config file > defaults; the default config
    file is read when it exists; SLURM variables are ignored): `device` ``"cpu"`` runs on gloo, ``"auto"``
    detects the accelerator (with ``nproc`` processes, not its device count). This session's environment is
    left as it was. A failing rank raises a `RuntimeError` with that rank's traceback (later failures
    first, the root cause last).

    `fn` and `args` go to the workers by pickle. From a notebook or REPL, where functions live in an
    unimportable ``__main__``, the workers are forked (`start_method` ``"fork"``; CUDA must not be initialized
    in the notebook yet); a function defined in a module is run in spawned processes.

    Example:
        >>> from accelfn.launch.notebook import notebook_launch
        >>> def train(lr):                       # doctest: +SKIP
        ...     import accelfn as af
        ...     mesh = af.Mesh.from_env()
        ...     return mesh.rank, lr
        >>> notebook_launch(train, (1e-3,), nproc=2, device="cpu")  # doctest: +SKIP
        [(0, 0.001), (1, 0.001)]
    """
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import elastic_launch

    if not callable(fn):
        raise TypeError(f"notebook_launch: fn must be a function, got {type(fn).__name__}")
    if isinstance(nproc, bool) or not isinstance(nproc, int) or nproc < 1:
        raise ValueError(f"notebook_launch: nproc={nproc!r}: expected an integer >= 1")
    if os.environ.get(contract.ACCELFN_LAUNCHED) == "1" and "TORCHELASTIC_RUN_ID" in os.environ:
        raise RuntimeError(
            "notebook_launch was called inside a launched worker; call fn directly there "
            "(or call notebook_launch from the notebook, outside `accelfn launch`)"
        )
    if isinstance(mesh, Mapping):
        mesh = contract.format_mesh(mesh)
    if log_with is not None and not isinstance(log_with, str):
        log_with = ",".join(log_with) or "none"
    name = getattr(fn, "__qualname__", repr(fn))
    opts = LaunchOptions(
        script=f"<{name}>",
        nproc_per_node=nproc,
        nnodes=1,
        device=device,
        mesh=mesh,
        mixed_precision=mixed_precision,
        log_with=log_with,
        config_file=config_file,
        max_restarts=max_restarts,
        monitor_interval=monitor_interval,
        log_dir=log_dir,
        tee=tee,
        use_slurm=False,
    )
    plan = resolve(opts)
    method = _start_method(fn, start_method)
    if method != "fork" and "<locals>" in getattr(fn, "__qualname__", ""):
        raise ValueError(
            f"notebook_launch: {fn.__qualname__} is defined inside a function, so workers started with "
            f"{method!r} cannot import it: define it at the top level of a module (or pass start_method='fork')"
        )
    config = launch_config(plan, start_method=method)
    try:
        with _environ(plan.env):
            results = elastic_launch(config=config, entrypoint=fn)(*args)
    except ChildFailedError as err:
        report = _failure_report(err, prog=f"notebook_launch({name})")
        if method != "fork" and not any(_recorded(f) for f in err.failures.values()):
            report += (
                f"\nnotebook_launch({name}): no rank recorded a Python error, so the workers failed before running "
                f"{name}: a worker started with {method!r} imports {getattr(fn, '__module__', '?')}.{name}, which "
                "fails for a function defined under `if __name__ == '__main__':` or anywhere the import does not "
                "reach (the workers' tracebacks are on stderr above); define it at the top level of a module"
            )
        raise RuntimeError(report) from None
    return [results[rank] for rank in sorted(results)]

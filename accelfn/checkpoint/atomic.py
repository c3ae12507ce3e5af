"""Atomic folder commits: write into a hidden temporary sibling, fsync, then rename it into place.

A crash at any point leaves either the previous folder or the new one under the final name, never a
half-written one. Replacing an existing folder swaps the two atomically (Linux `renameat2`
`RENAME_EXCHANGE`; elsewhere the old one is renamed aside first) and deletes the old one afterwards.

Example:
    >>> import tempfile, pathlib
    >>> from accelfn.checkpoint import atomic
    >>> root = pathlib.Path(tempfile.mkdtemp())
    >>> tmp = atomic.temp_sibling(root / "ckpt", "abc")
    >>> tmp.mkdir(); _ = (tmp / "a.txt").write_text("1")
    >>> atomic.commit(tmp, root / "ckpt"); sorted(p.name for p in root.iterdir())
    ['ckpt']
"""

from __future__ import annotations

import ctypes
import errno
import os
import shutil
import uuid
from collections.abc import Callable
from pathlib import Path

from .io import fsync_path

__all__ = ["temp_sibling", "commit", "remove", "clean_stale", "is_hidden", "check_replaceable"]

_AT_FDCWD = -100
_RENAME_EXCHANGE = 2


def temp_sibling(path: Path, token: str) -> Path:
    """The hidden temporary folder a save of `path` writes into: `.tmp-<name>-<token>` beside it."""
    return path.parent / f".tmp-{path.name}-{token}"


def is_hidden(name: str) -> bool:
    """Folders whose name starts with a dot (temporary, or set aside) are never checkpoints."""
    return name.startswith(".")


def _exchange(a: Path, b: Path) -> bool:
    """Atomically swap two paths (Linux >= 3.15); False where the platform or filesystem cannot."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.renameat2
    except (OSError, AttributeError):
        return False
    rc = fn(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE)
    if rc == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP):
        return False
    raise OSError(err, f"cannot swap '{a}' and '{b}': {os.strerror(err)}")


def commit(tmp: Path, final: Path) -> None:
    """Move the finished folder `tmp` to `final` atomically (replacing an existing `final`), durably."""
    fsync_path(tmp)
    if final.exists():
        if _exchange(tmp, final):
            fsync_path(final.parent)
            remove(tmp)
            return
        aside = final.parent / f".old-{final.name}-{uuid.uuid4().hex[:8]}"
        os.rename(final, aside)
        os.rename(tmp, final)
        fsync_path(final.parent)
        remove(aside)
        return
    os.rename(tmp, final)
    fsync_path(final.parent)


def remove(path: Path) -> None:
    """Delete a folder so that no crash leaves a partial copy under a visible name (hide it, then delete)."""
    if not path.exists():
        return
    if not is_hidden(path.name):
        hidden = path.parent / f".old-{path.name}-{uuid.uuid4().hex[:8]}"
        os.rename(path, hidden)
        fsync_path(path.parent)
        path = hidden
    shutil.rmtree(path, ignore_errors=True)


def check_replaceable(final: Path, markers: tuple[str, ...], *, keeps_others: bool = False) -> None:
    """Refuse to replace an existing path unless it is an empty folder or holds one of `markers` (a
    checkpoint or weights folder): a save never deletes a user's unrelated files. With `keeps_others` (a save
    that carries the other files over: Hugging Face weights and adapters beside a tokenizer or README) any
    folder is fine."""
    if not final.exists():
        return
    if not final.is_dir():
        raise FileExistsError(f"'{final}' exists and is a file; a checkpoint is written as a folder")
    if keeps_others:
        return
    if any(final.iterdir()) and not any((final / m).exists() for m in markers):
        raise FileExistsError(
            f"'{final}' exists and is not a checkpoint (it has none of {list(markers)}); "
            "refusing to replace it: choose another path or remove it"
        )


def carry_over(final: Path, tmp: Path, replaced: Callable[[str], bool]) -> None:
    """Before `commit(tmp, final)`: hard-link (or copy) into `tmp` every entry of an existing `final` that
    the new save neither writes nor `replaced` names (e.g. a tokenizer beside model weights), so that
    replacing the folder keeps them."""
    if not final.is_dir():
        return
    for entry in final.iterdir():
        dest = tmp / entry.name
        if dest.exists() or replaced(entry.name) or is_hidden(entry.name):
            continue
        if entry.is_dir():
            shutil.copytree(entry, dest, copy_function=_link_or_copy)
        else:
            _link_or_copy(str(entry), str(dest))


def _link_or_copy(src: str, dst: str) -> None:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def clean_stale(final: Path) -> None:
    """Delete leftovers of earlier, interrupted saves of `final` (`.tmp-<name>-*`, `.old-<name>-*`)."""
    if not final.parent.exists():
        return
    for p in final.parent.iterdir():
        if p.name.startswith((f".tmp-{final.name}-", f".old-{final.name}-")):
            shutil.rmtree(p, ignore_errors=True)

"""The on-disk layout of a checkpoint folder: file names, `state.json`, the Hugging Face index, sizes.

Example:
    >>> from accelfn.checkpoint import format as fmt
    >>> fmt.parse_size("5GB"), fmt.parse_size("20KB"), fmt.parse_size(1000)
    (5000000000, 20000, 1000)
    >>> fmt.file_name("model", 2, 3), fmt.file_name("model", 1, 1), fmt.file_name("optimizer", 1, 1, rank=1)
    ('model-00002-of-00003.safetensors', 'model.safetensors', 'optimizer-rank00001.safetensors')
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

__all__ = [
    "FORMAT",
    "VERSION",
    "STATE_FILE",
    "GROUPS",
    "INLINE",
    "CheckpointError",
    "CorruptCheckpointError",
    "CheckpointMismatchError",
    "parse_size",
    "file_name",
    "hf_index",
    "read_state_json",
    "step_of_name",
]

FORMAT = "accelfn-checkpoint"
VERSION = 1
STATE_FILE = "state.json"
HF_INDEX = "model.safetensors.index.json"
# TrainState field -> base name of its safetensors file(s); `step` and `rng` are written into state.json.
GROUPS = {"params": "model", "buffers": "buffers", "opt_state": "optimizer", "extra": "extra"}
INLINE = ("step", "rng")

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "KIB": 2**10, "MIB": 2**20,
          "GIB": 2**30, "TIB": 2**40}  # fmt: skip


class CheckpointError(Exception):
    """A checkpoint folder is not usable (not a checkpoint, unknown version, ...)."""


class CorruptCheckpointError(CheckpointError, ValueError):
    """A file of a checkpoint is truncated or its bytes do not match the checksum recorded at save time."""


class CheckpointMismatchError(CheckpointError, ValueError):
    """The checkpoint does not fit `like`: a pytree path, shape or dtype differs."""


def parse_size(size: int | str) -> int:
    """Bytes in `size`: an int, or a string like `"5GB"`, `"500MB"`, `"20KB"`, `"1GiB"` (as transformers)."""
    if isinstance(size, int):
        n = size
    else:
        m = re.fullmatch(r"\s*([0-9.]+)\s*([KMGT]?I?B?)\s*", size.upper())
        if m is None or m.group(2) not in _UNITS:
            raise ValueError(f"max_shard_size={size!r} is not a size like '5GB', '500MB' or 1000000")
        n = int(float(m.group(1)) * _UNITS[m.group(2)])
    if n <= 0:
        raise ValueError(f"max_shard_size must be positive, got {size!r}")
    return n


def file_name(base: str, index: int, count: int, *, rank: int | None = None) -> str:
    """`model.safetensors` / `model-00001-of-00002.safetensors`; with `rank` (a rank's own shards of a
    sharded state) `model-rank00001.safetensors` / `model-rank00001-00001-of-00002.safetensors`."""
    stem = base if rank is None else f"{base}-rank{rank:05d}"
    if count == 1:
        return f"{stem}.safetensors"
    return f"{stem}-{index:05d}-of-{count:05d}.safetensors"


def hf_index(weight_map: dict[str, str], total_size: int) -> str:
    """The text of `model.safetensors.index.json` in the Hugging Face layout."""
    return json.dumps({"metadata": {"total_size": total_size}, "weight_map": dict(sorted(weight_map.items()))},
                      indent=2) + "\n"  # fmt: skip


def read_state_json(folder: Path) -> dict[str, Any]:
    """The parsed `state.json` of a checkpoint folder, checked for format and version."""
    if not folder.exists():
        raise FileNotFoundError(f"no checkpoint at '{folder}': the folder does not exist")
    if not folder.is_dir():
        raise NotADirectoryError(
            f"'{folder}' is a file; a checkpoint is a folder written by af.checkpoint.save"
        )
    path = folder / STATE_FILE
    if not path.exists():
        hint = ""
        if (folder / "model.safetensors").exists() or (folder / HF_INDEX).exists():
            hint = " It holds Hugging Face weights only: read them with af.checkpoint.load_pretrained(path, like=params)."
        raise FileNotFoundError(f"'{folder}' is not an accelfn checkpoint: it has no {STATE_FILE}.{hint}")
    try:
        meta = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError) as e:
        raise CorruptCheckpointError(f"'{path}' is not valid JSON ({e}): the file is corrupted") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise CheckpointError(
            f'\'{path}\' is not an accelfn checkpoint description (no "format": "{FORMAT}")'
        )
    if meta.get("version") != VERSION:
        raise CheckpointError(
            f"'{path}' has format version {meta.get('version')!r}; this accelfn reads version {VERSION}"
        )
    return meta


def step_of_name(name: str) -> int | None:
    """The number in a folder name like `step-1200` (or `ckpt_1200`), else None."""
    m = re.search(r"(\d+)$", name)
    return int(m.group(1)) if m else None

"""Safetensors checkpoints as memory maps: one file, an HF sharded folder, or an accelfn checkpoint folder.

A tensor is a zero-copy view of the file's pages; `release` hands those pages back (`MADV_DONTNEED`), so
reading a checkpoint piece by piece keeps only the pieces in use resident.
"""

from __future__ import annotations

import json
import mmap
import os
import struct
from pathlib import Path
from typing import Any

import torch

__all__ = ["SafetensorsFile", "Checkpoint", "INDEX", "SINGLE"]

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"

DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "U16": torch.uint16, "U32": torch.uint32, "U64": torch.uint64, "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}  # fmt: skip
_PAGE = mmap.PAGESIZE


class SafetensorsFile:
    """One `.safetensors` file, memory-mapped; `get(key)` is a view of its bytes (no copy).

    Example:
        >>> import tempfile, torch, safetensors.torch
        >>> path = tempfile.mkdtemp() + "/w.safetensors"
        >>> safetensors.torch.save_file({"w": torch.arange(6.0).reshape(2, 3)}, path)
        >>> f = SafetensorsFile(path)
        >>> f.get("w").sum().item(), f.dtype("w")
        (15.0, torch.float32)
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        with open(self.path, "rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            header: dict[str, Any] = json.loads(fh.read(n))
        header.pop("__metadata__", None)
        self._base = 8 + n
        self._entries = header
        self._map: mmap.mmap | None = None

    def keys(self) -> list[str]:
        return list(self._entries)

    def dtype(self, key: str) -> torch.dtype:
        return DTYPES[self._entries[key]["dtype"]]

    def get(self, key: str) -> torch.Tensor:
        """Tensor `key` as a view of the mapped file (read-only in effect: writes never reach the file)."""
        entry = self._entries[key]
        start, stop = entry["data_offsets"]
        dtype = DTYPES[entry["dtype"]]
        if stop == start:
            return torch.empty(entry["shape"], dtype=dtype)
        if self._map is None:
            with open(self.path, "rb") as fh:
                self._map = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_COPY)
        flat = torch.frombuffer(self._map, dtype=torch.uint8, count=stop - start, offset=self._base + start)
        return flat.view(dtype).view(entry["shape"])

    def release(self, key: str) -> None:
        """Drop the pages of tensor `key` from this process's memory (they stay in the OS page cache)."""
        if self._map is None or not hasattr(self._map, "madvise"):
            return
        start, stop = self._entries[key]["data_offsets"]
        lo = (self._base + start) // _PAGE * _PAGE
        hi = min(-(-(self._base + stop) // _PAGE) * _PAGE, len(self._map))
        if hi > lo:
            self._map.madvise(mmap.MADV_DONTNEED, lo, hi - lo)


class Checkpoint:
    """The tensors of a checkpoint and the file each lives in.

    `path`: a `.safetensors` file, or a folder with `model.safetensors.index.json` (shards) or
    `model.safetensors` (the Hugging Face layout, also that of `af.checkpoint` folders).
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        path = Path(path)
        self.path = path
        self.files: dict[str, SafetensorsFile] = {}
        self.file_of: dict[str, str] = {}
        if path.is_file():
            self._add(path)
        elif (path / INDEX).is_file():
            weight_map: dict[str, str] = json.loads((path / INDEX).read_text())["weight_map"]
            for name in dict.fromkeys(weight_map.values()):
                self._add(path / name)
            for key, name in weight_map.items():
                if key not in self.files[str(path / name)]._entries:
                    raise ValueError(
                        f"{path / INDEX} says {key!r} is in {name}, but that file does not have it"
                    )
        elif (path / SINGLE).is_file():
            self._add(path / SINGLE)
        elif path.exists():
            raise FileNotFoundError(f"checkpoint folder '{path}' has neither {SINGLE} nor {INDEX}")
        else:
            raise FileNotFoundError(f"checkpoint '{path}' does not exist")

    def _add(self, file: Path) -> None:
        f = SafetensorsFile(file)
        self.files[str(file)] = f
        for key in f._entries:
            self.file_of[key] = str(file)

    def __contains__(self, key: object) -> bool:
        return key in self.file_of

    def file(self, key: str) -> SafetensorsFile:
        return self.files[self.file_of[key]]

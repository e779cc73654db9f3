"""Sizes on disk and how they are printed (the fit summary, export)."""

from __future__ import annotations

import os
from pathlib import Path


def format_bytes(count: float) -> str:
    """``1536 -> '1.5 KiB'``, ``512 -> '512 B'``."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if count >= scale:
            return f"{count / scale:.1f} {unit}"
    return f"{int(count)} B"


def disk_bytes(path: str | os.PathLike) -> int:
    """Bytes of a file, or of every file under a folder (a model directory, a sharded checkpoint)."""
    path = Path(path)
    if path.is_dir():
        return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
    return path.stat().st_size

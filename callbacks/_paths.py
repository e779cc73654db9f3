"""How the callbacks print a path."""

from __future__ import annotations

import os
from pathlib import Path


def shown_path(path: str | os.PathLike) -> str:
    """``path`` relative to the working directory when it lies below it (shorter to read and to copy)."""
    path = Path(path).resolve()
    try:
        return str(path.relative_to(Path.cwd()))
    except ValueError:
        return str(path)

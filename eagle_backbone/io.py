"""Atomic file writes: a reader (or a resumed job) sees the old file or the new one, never half of one.

Every writer in the project goes through here: write a temporary sibling, fsync it, rename it over
the destination (``os.replace`` is atomic on POSIX and Windows within one file system).
"""

from __future__ import annotations

import json
import os
from pathlib import Path


def atomic_replace(tmp: str | Path, final: str | Path) -> None:
    """Flush ``tmp`` to disk, then rename it to ``final`` (files or folders)."""
    tmp = Path(tmp)
    if tmp.is_file():
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
    os.replace(tmp, final)


def atomic_write_bytes(path: str | Path, data: bytes) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    atomic_replace(tmp, path)
    return path


def atomic_write_text(path: str | Path, text: str) -> Path:
    return atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_json(path: str | Path, obj, **kwargs) -> Path:
    kwargs.setdefault("indent", 2)
    return atomic_write_text(path, json.dumps(obj, **kwargs) + "\n")

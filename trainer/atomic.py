"""Crash-safe file updates: a reader sees the old state or the new one, never half of one.

The recipe is the POSIX one: write to a temporary name in the same directory, fsync
the file, rename over the final name (atomic within one file system), then fsync the
directory so the rename itself survives a power loss.
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path
from typing import Any


def fsync_dir(path: Path) -> None:
    """Persist the directory entry changes (creations, renames) made in ``path``."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_json(path: Path, data: Any) -> None:
    """Write ``data`` as JSON to ``path`` atomically and durably."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(data, f, indent=2, sort_keys=True)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
        raise
    fsync_dir(path.parent)


def rename_dir(src: Path, dst: Path) -> None:
    """Rename directory ``src`` to ``dst`` (which must not exist) and persist the rename."""
    os.rename(src, dst)
    fsync_dir(dst.parent)

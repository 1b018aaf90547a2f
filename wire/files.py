"""The names of the files both sides read and write, and the one reader they share.

A checkpoint directory ``step_NNNNNNNN`` may hold ``manifest.json``: every file of the save
with its size and hash, written last (trainer/checkpoint_layout.py writes and verifies
it). The supervisor reads it, as the run's user, to tell a complete save from one whose
files are missing or cut short. ``.tsup-attempt`` in the checkpoint directory is the
fence: the supervisor writes ``{"attempt": N}`` there before it starts attempt N, and a
rank 0 of an earlier attempt (frozen, then woken) checks it before it clears, commits or
prunes. ``result.json`` in the trainer's output directory is the reference trainer's
proof of success: written atomically once the run is done, read by the supervisor.
"""

from __future__ import annotations

import json
import os
import re
import stat
from pathlib import Path
from typing import Any

from wire.errors import CheckpointMismatch

MANIFEST_FILE = "manifest.json"
MANIFEST_FORMATS = (1, 2)  # format 1 (SHA-256 only) is read too
FENCE_FILE = ".tsup-attempt"
RESULT_FILE = "result.json"

MANIFEST_MAX_BYTES = 64 << 20  # a manifest lists files: megabytes for the largest saves

# A checkpoint's directory: the reference trainer's ``step_NNNNNNNN`` (zero-padded, so
# names sort by step) and NxD Training's tag ``step_N`` (not padded).
_CHECKPOINT_DIR = re.compile(r"step_(\d{8})")
_NXD_TAG = re.compile(r"step_(\d+)")


def checkpoint_name(step: int) -> str:
    """The reference trainer's directory name of the checkpoint after ``step``."""
    return f"step_{step:08d}"


def step_of(name: str) -> int | None:
    """The step a reference trainer's checkpoint directory name stands for (None: not one)."""
    match = _CHECKPOINT_DIR.fullmatch(name)
    return int(match.group(1)) if match else None


def nxd_tag(step: int) -> str:
    """NxD Training's tag, and directory name, of the checkpoint after ``step``."""
    return f"step_{step}"


def nxd_step_of(name: str) -> int | None:
    """The step an NxD Training checkpoint tag stands for (None: not one)."""
    match = _NXD_TAG.fullmatch(name)
    return int(match.group(1)) if match else None


def read_small(path: Path, limit: int) -> bytes:
    """A regular file of at most ``limit`` bytes, never through a link at its name and
    never blocking (a supervisor running as root reads the manifests users' trainers wrote)."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise OSError(f"not a regular file (mode {stat.filemode(st.st_mode)})")
        data = f.read(limit + 1)
    if len(data) > limit:
        raise OSError(f"more than {limit} bytes")
    return data


def read_manifest(directory: Path) -> dict[str, dict[str, Any]] | None:
    """The manifest's files (None: a checkpoint written without one). Raises
    CheckpointMismatch for a manifest that is there but unreadable."""
    path = directory / MANIFEST_FILE
    try:
        data = json.loads(read_small(path, MANIFEST_MAX_BYTES))
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        raise CheckpointMismatch(f"{path}: unreadable: {e}") from e
    files = data.get("files") if isinstance(data, dict) else None
    if not isinstance(files, dict) or data.get("format") not in MANIFEST_FORMATS:
        known = " or ".join(map(str, MANIFEST_FORMATS))
        raise CheckpointMismatch(f"{path}: not a manifest of format {known}")
    return files

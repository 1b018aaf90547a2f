"""The state directory's lock: one daemon per database (``<state dir>/supervisor.lock``,
held with ``flock`` for the daemon's life, holding its pid for the one refused)."""

from __future__ import annotations

import fcntl
import os
from pathlib import Path
from typing import TextIO

from supervisor.errors import StateDirLocked


class StateDirLock:
    """An exclusive lock on the state directory: one daemon per database."""

    def __init__(self, state_dir: Path) -> None:
        self.path = state_dir / "supervisor.lock"
        self._file: TextIO | None = None

    def acquire(self) -> None:
        f = open(self.path, "a+")  # noqa: SIM115 - held open for the daemon's life
        try:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError as e:
            f.seek(0)
            holder = f.read().strip() or "unknown"
            f.close()
            raise StateDirLocked(
                f"another training-supervisor (pid {holder}) is using {self.path.parent}; "
                "stop it first or choose another --state-dir"
            ) from e
        f.seek(0)
        f.truncate()
        f.write(str(os.getpid()))
        f.flush()
        self._file = f

    def release(self) -> None:
        if self._file is not None:
            fcntl.flock(self._file.fileno(), fcntl.LOCK_UN)
            self._file.close()
            self._file = None

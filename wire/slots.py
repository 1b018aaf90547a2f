"""A node's slot file: how the ranks of one node share their state for node aggregation.

With ``TSUP_TELEMETRY_AGGREGATE=node`` (trainer/telemetry.py) every rank of a node owns
one fixed-size slot, at offset ``local_rank * SLOT_BYTES``, in one small file on that
node::

    <TSUP_SLOTS_DIR>/tsup-<run>-<attempt>-<node>[-<MASTER_PORT>].slots

(the port of the job's rendezvous keeps apart two jobs of the same run id and attempt on
one host: two daemons' runs, or simulated nodes of the local launcher).

``TSUP_SLOTS_DIR`` defaults to /dev/shm (memory, node-local) where it exists, else the
temporary directory. A rank writes its whole slot with one ``os.pwrite`` of SLOT_BYTES
(64, aligned, so never across a page): at each step and phase change (from the training
thread: a memory copy, no network) and every heartbeat interval (from its telemetry
thread, so that a rank busy in a long step still shows as alive). The node's local rank
0 reads all slots with one ``os.pread`` each heartbeat interval and publishes them as one
``NodeReport`` (wire/messages.py). A reader skips slots never written (zeros) and any
it cannot make sense of; a slot torn by a concurrent write is not possible in practice
on Linux (a page-cache copy of 64 bytes within one page), and would only be skipped.

Slot layout (little-endian, 64 bytes)::

    magic "tsl1" | phase code u32 | global rank i64 | step i64 | written_at f64 (unix s)
    | step_time_s f64 | busy_s f64 | 16 bytes zero

Local rank 0 creates (and truncates: the leftovers of an earlier process of the same
attempt) the file when it starts and removes it when it closes; the other ranks open it,
creating it if they come first. This module is stdlib only.
"""

from __future__ import annotations

import contextlib
import math
import os
import struct
import tempfile
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from wire import MAX_NODE_RANKS, Phase
from wire.errors import UsageError
from wire.private_dir import private_dir

SLOT = struct.Struct("<4sIqqddd16x")
SLOT_BYTES = SLOT.size  # 64
_MAGIC = b"tsl1"
_PHASES = tuple(Phase)  # phase code = index; new phases go at the end of the enum

AGGREGATE_MODES = ("rank", "node")


def default_slots_dir(environ: Mapping[str, str]) -> Path:
    """``TSUP_SLOTS_DIR``, else this user's own directory in /dev/shm where it exists, else
    in the temporary directory (made private when the slot file is opened: nobody else can
    plant a slot file there)."""
    chosen = environ.get("TSUP_SLOTS_DIR")
    if chosen:
        return Path(chosen)
    shm = Path("/dev/shm")  # noqa: S108 (a directory of this user's own below it)
    return (shm if shm.is_dir() else Path(tempfile.gettempdir())) / f"tsup-slots-{os.geteuid()}"


def slot_path(directory: Path, run: str, attempt: int, node: str, job: str = "") -> Path:
    """The node's slot file; the node name and ``job`` are reduced to file-name-safe characters."""
    name = "-".join(x for x in (f"tsup-{run}-{attempt}", node, job) if x)
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in name)
    return directory / f"{safe}.slots"


@dataclass(frozen=True, slots=True)
class Slot:
    """One rank's state as read from its slot."""

    rank: int
    step: int
    phase: Phase
    written_at: float  # the writer's time.time()
    step_time_s: float
    busy_s: float


def pack(slot: Slot) -> bytes:
    return SLOT.pack(_MAGIC, _PHASES.index(slot.phase), slot.rank, slot.step, slot.written_at,
                     slot.step_time_s, slot.busy_s)


def unpack(data: bytes) -> Slot | None:
    """A slot's bytes to a Slot; None for a slot never written or not understood."""
    if len(data) != SLOT_BYTES:
        return None
    magic, code, rank, step, written_at, step_time_s, busy_s = SLOT.unpack(data)
    if magic != _MAGIC or code >= len(_PHASES) or rank < 0 or step < 0 or not math.isfinite(written_at):
        return None
    return Slot(rank=rank, step=step, phase=_PHASES[code], written_at=written_at,
                step_time_s=step_time_s, busy_s=busy_s)


def _slots_in(data: bytes) -> list[Slot]:
    found = (unpack(data[i:i + SLOT_BYTES]) for i in range(0, len(data) - SLOT_BYTES + 1, SLOT_BYTES))
    return [s for s in found if s is not None]


def read_file(path: Path) -> list[Slot]:
    """Every written slot of a node's slot file, read by a process that writes none (the
    node agent, node/agent.py): [] while there is no file, or one of another user's."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return []
    try:
        if os.fstat(fd).st_uid != os.geteuid():
            return []
        data = os.pread(fd, MAX_NODE_RANKS * SLOT_BYTES, 0)
    except OSError:
        return []
    finally:
        os.close(fd)
    return _slots_in(data)


def report_fields(slots: list[Slot], now: float) -> dict[str, Any]:
    """The slots as a node report's parallel lists (wire/messages.py NodeReport and
    AgentReport), a rank written twice (a stale slot) by its newest slot."""
    newest: dict[int, Slot] = {}
    for slot in slots:
        if slot.rank not in newest or slot.written_at > newest[slot.rank].written_at:
            newest[slot.rank] = slot
    kept = list(newest.values())
    return {"ranks": tuple(s.rank for s in kept), "steps": tuple(s.step for s in kept),
            "phases": tuple(s.phase for s in kept), "ages": tuple(max(0.0, now - s.written_at) for s in kept),
            "step_times": tuple(s.step_time_s for s in kept), "busy": tuple(s.busy_s for s in kept)}


class NodeSlots:
    """This rank's slot in its node's slot file (and, on local rank 0, the reader of all).

    Holds the rank's current state; every write stores all of it with a fresh time. A
    lock orders the training thread's writes and the telemetry thread's rewrites (each
    holds it for one pwrite, microseconds), so a slot never goes back to an older state.
    Write errors are counted, never raised: telemetry must not stop training.
    """

    def __init__(self, path: Path, *, rank: int, local_rank: int, local_world_size: int) -> None:
        self.path = path
        self.rank, self.local_rank, self.local_world_size = rank, local_rank, local_world_size
        # A directory of this user's alone (another user could make a predictable name first
        # and write phases into it); O_NOFOLLOW: nor may a link redirect the writes.
        try:
            private_dir(path.parent)
        except UsageError as e:
            raise PermissionError(str(e)) from None
        flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | (os.O_TRUNC if local_rank == 0 else 0)
        self._fd: int | None = os.open(path, flags, 0o600)
        if os.fstat(self._fd).st_uid != os.geteuid():
            os.close(self._fd)
            raise PermissionError(f"{path}: a slot file of another user's")
        self._lock = threading.Lock()
        self._step = 0
        self._phase = Phase.INIT
        self._step_time_s = math.nan
        self._busy_s = math.nan
        self.write_errors = 0

    def update(self, *, step: int | None = None, phase: Phase | None = None,
               step_time_s: float | None = None, busy_s: float | None = None) -> None:
        """Change the given fields and write the slot (with the time of now)."""
        with self._lock:
            if step is not None:
                self._step = step
            if phase is not None:
                self._phase = phase
            if step_time_s is not None:
                self._step_time_s = step_time_s
            if busy_s is not None:
                self._busy_s = busy_s
            self._write()

    def touch(self) -> None:
        """Rewrite the slot unchanged but for its time: this rank is alive."""
        with self._lock:
            self._write()

    def _write(self) -> None:
        if self._fd is None:
            return
        data = pack(Slot(rank=self.rank, step=self._step, phase=self._phase, written_at=time.time(),
                         step_time_s=self._step_time_s, busy_s=self._busy_s))
        try:
            os.pwrite(self._fd, data, self.local_rank * SLOT_BYTES)
        except OSError:
            self.write_errors += 1

    def read_all(self) -> list[Slot]:
        """Every written slot of the node, in local-rank order (a missing one is left out)."""
        with self._lock:
            if self._fd is None:
                return []
            try:
                data = os.pread(self._fd, self.local_world_size * SLOT_BYTES, 0)
            except OSError:
                return []
        return _slots_in(data)

    def close(self) -> None:
        """Close the file; local rank 0 also removes it (best effort: a killed one cannot)."""
        with self._lock:
            if self._fd is None:
                return
            os.close(self._fd)
            self._fd = None
        if self.local_rank == 0:
            with contextlib.suppress(OSError):
                self.path.unlink()

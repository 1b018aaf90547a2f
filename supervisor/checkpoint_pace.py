"""A run's checkpoint I/O pace: how long its recent saves took and how fast its state was
written and read back, as its trainer timed them (``CheckpointCommitted``,
``CheckpointRestored``: wire/messages.py). The checkpoint and restore allowances of
the policy follow the slowest of them (``IoPace``), so that a run whose state is tens of
GB per rank is judged at its own storage's pace, not the tiny model's."""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

IO_KEPT = 20  # a run's recent saves and restores, each: the window their slowest is taken from


@dataclass(frozen=True, slots=True)
class IoPace:
    """The slowest of a run's recent checkpoint I/O (None: not measured)."""

    save_s: float | None = None  # a whole save, or a checkpoint phase as long
    save_gb_s: float | None = None  # GB/s of a rank's state
    restore_gb_s: float | None = None


@dataclass(slots=True)
class CheckpointIo:
    """A run's recent saves and restores as its trainer timed them: what the checkpoint
    and restore allowances follow. For a trainer that times none of its saves (its
    commits come without a duration: trainer.client's default), the checkpoint phases as
    this side saw them stand in; never for one that times its own, whose checkpoint phase
    may be only the copy of a save that goes on beside training."""

    saves_s: deque[float] = field(default_factory=lambda: deque(maxlen=IO_KEPT))
    phases_s: deque[float] = field(default_factory=lambda: deque(maxlen=IO_KEPT))
    untimed: bool = False  # a commit came without a duration
    save_paces: deque[float] = field(default_factory=lambda: deque(maxlen=IO_KEPT))  # bytes/s
    restore_paces: deque[float] = field(default_factory=lambda: deque(maxlen=IO_KEPT))

    def saved(self, seconds: float, size: int) -> None:
        """A commit: the whole save took ``seconds`` (NaN: not timed) for ``size`` bytes."""
        if not (math.isfinite(seconds) and seconds >= 0):
            self.untimed = True
            return
        self.saves_s.append(seconds)
        if size > 0 and seconds > 0:
            self.save_paces.append(size / seconds)

    def phase_ended(self, seconds: float) -> None:
        self.phases_s.append(seconds)

    def restored(self, seconds: float, size: int) -> None:
        if math.isfinite(seconds) and seconds > 0 and size > 0:
            self.restore_paces.append(size / seconds)

    def pace(self) -> IoPace:
        timed = self.saves_s or (self.phases_s if self.untimed else ())
        return IoPace(save_s=max(timed, default=None),
                      save_gb_s=min(self.save_paces) / 1e9 if self.save_paces else None,
                      restore_gb_s=min(self.restore_paces) / 1e9 if self.restore_paces else None)

"""What this process remembers of each run and live attempt between ticks: its validated
spec, when a rank was first seen dead, a [command] trainer's output read so far, the short
spikes already reported, ... It has one owner, the reconciler, which hands it to the
observer (which reads and notes) and to the effects (which note, and forget an attempt
once it ended). None of it is durable: a restarted daemon rebuilds it from the store and
what it observes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from supervisor.errors import SpecError
from supervisor.gathering.output_progress import AttemptOutput
from supervisor.spec import RunSpec, spec_from_json
from supervisor.store import SqlStore


@dataclass(slots=True)
class AttemptMemory:
    """What this process remembers of one live attempt."""

    dead_since: dict[int, float] = field(default_factory=dict)  # rank -> when first seen dead
    # A [command] trainer's: (newest checkpoint step, when first seen, when last scanned).
    quiet: tuple[int, float | None, float] | None = None
    output: AttemptOutput = field(default_factory=AttemptOutput)  # its output read so far
    output_resumed: bool = False  # read on from the offsets the store kept (a restarted daemon)
    offsets_kept: tuple[float, dict[str, int]] = (0.0, {})  # when the store was last given them, and them
    # A resumed reference trainer's first step and the loss an earlier attempt reported for
    # it (``expected_known``: looked up once; None: the check does not hold).
    expected: tuple[int, float] | None = None
    expected_known: bool = False
    heard: float | None = None  # when any of its ranks was last heard
    back_at: float | None = None  # when heard again after all of them fell silent together
    spikes_said: set[int] = field(default_factory=set)  # first steps of the short spikes reported


class RunMemory:
    """Each run's and live attempt's memory between ticks (see the module docstring)."""

    def __init__(self, store: SqlStore) -> None:
        self.store = store
        self._specs: dict[int, tuple[RunSpec | str, Path]] = {}  # run -> its spec (or why it is invalid)
        self._attempts: dict[tuple[int, int], AttemptMemory] = {}
        self._allocated: dict[int, list[str]] = {}  # run -> nodes an allocation gave it since the last look
        self._out_of_range: set[tuple[int, str]] = set()  # (run, path) of checkpoints said to be out of range

    def spec(self, number: int) -> tuple[RunSpec | str, Path]:
        """The run's stored spec, validated once; or why it no longer validates."""
        if number not in self._specs:
            with self.store.tx() as tx:
                text, run_dir = tx.run_spec_and_dir(number)
            try:
                self._specs[number] = (spec_from_json(text), run_dir)
            except SpecError as e:
                self._specs[number] = (str(e), run_dir)
        return self._specs[number]

    def keep_specs(self, numbers: set[int]) -> None:
        """Forget the specs of runs no longer reconciled."""
        for number in [n for n in self._specs if n not in numbers]:
            del self._specs[number]

    def attempt(self, run_number: int, attempt: int) -> AttemptMemory:
        key = (run_number, attempt)
        memory = self._attempts.get(key)
        if memory is None:
            memory = self._attempts[key] = AttemptMemory()
        return memory

    def forget_attempt(self, run_number: int, attempt: int) -> None:
        """The attempt ended: nothing of it is needed any more."""
        self._attempts.pop((run_number, attempt), None)

    def note_allocated(self, run_number: int, nodes: tuple[str, ...]) -> None:
        """Nodes an allocation just gave the run: newly allocated in its next view."""
        self._allocated.setdefault(run_number, []).extend(nodes)

    def take_allocated(self, run_number: int) -> tuple[str, ...]:
        """The nodes noted since the last look, once."""
        return tuple(self._allocated.pop(run_number, ()))

    def note_out_of_range(self, run_number: int, path: Path) -> bool:
        """True the first time ``path`` is seen out of range (to say so once)."""
        key = (run_number, str(path))
        if key in self._out_of_range:
            return False
        self._out_of_range.add(key)
        return True

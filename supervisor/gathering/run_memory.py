"""What this process remembers of each run and live attempt between ticks: its validated
spec, when a rank was first seen dead, a [command] trainer's output read so far, the short
spikes already reported, the allocation last seen, ... The reconciler owns it; only the
gathering side writes it (the feed and the observer), and forgets what no run or live
attempt needs any more. The effects read a run's spec from it and never write it: what
they did, the observer reads back from the store (a spike said is an event; nodes
granted are the run's allocation). None of it is durable: a restarted daemon rebuilds
it from the store and what it observes.
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
    spikes_read_to: int = 0  # the newest event read for them


class RunMemory:
    """Each run's and live attempt's memory between ticks (see the module docstring)."""

    def __init__(self, store: SqlStore) -> None:
        self.store = store
        self._specs: dict[int, tuple[RunSpec | str, Path]] = {}  # run -> its spec (or why it is invalid)
        self._attempts: dict[tuple[int, int], AttemptMemory] = {}
        self._allocation: dict[int, frozenset[str]] = {}  # run -> the nodes it was last seen holding
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

    def keep_runs(self, numbers: set[int]) -> None:
        """Forget what is remembered of runs no longer reconciled."""
        for number in [n for n in self._specs if n not in numbers]:
            del self._specs[number]
        for number in [n for n in self._allocation if n not in numbers]:
            del self._allocation[number]
        self._attempts = {k: v for k, v in self._attempts.items() if k[0] in numbers}

    def keep_live(self, run_number: int, live: int | None) -> None:
        """Forget the run's attempts but its live one: an ended attempt needs nothing more."""
        for key in [k for k in self._attempts if k[0] == run_number and k[1] != live]:
            del self._attempts[key]

    def attempt(self, run_number: int, attempt: int) -> AttemptMemory:
        key = (run_number, attempt)
        memory = self._attempts.get(key)
        if memory is None:
            memory = self._attempts[key] = AttemptMemory()
        return memory

    def newly_allocated(self, run_number: int, holding: tuple[str, ...]) -> tuple[str, ...]:
        """The nodes of ``holding`` (the run's allocation now) it did not hold at the last
        look; none at the first look of this process (what a daemon before it allocated,
        it preflighted)."""
        before = self._allocation.get(run_number)
        self._allocation[run_number] = frozenset(holding)
        return () if before is None else tuple(n for n in holding if n not in before)

    def note_out_of_range(self, run_number: int, path: Path) -> bool:
        """True the first time ``path`` is seen out of range (to say so once)."""
        key = (run_number, str(path))
        if key in self._out_of_range:
            return False
        self._out_of_range.add(key)
        return True

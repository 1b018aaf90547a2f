"""A run's settled history, decoded once: its ended attempts, their stats, its recovered faults.

A run that lasts weeks has hundreds of attempts (Llama 3's rate: 419 interruptions in 54
days), and a read of its detail (the API) or a /metrics scrape that decoded them all
from SQLite every time grew with the run's age (bench/soak.py: 51 ms at 451 attempts).
Most of those rows never change again. An attempt is settled once it has ENDED and
``SETTLE_BEHIND`` newer attempts exist (or its run is over): nothing writes to it or to
its stats by then (the executor writes to the live attempt; a late step of a stopped
attempt is recorded within a tick or two, long before two more attempts have started).
A fault is settled once it is recovered and its attempt is settled; so is the time into
its attempt at which each checkpoint a settled attempt resumed from was committed (what
goodput needs of the checkpoints). ``SettledHistory`` keeps, per run, the settled prefix
of each, with what it adds to the goodput account summed once (``goodput.Ledger``), and
each read asks SQLite only for what came after it, and sums only that.

At most ``MAX_RUNS`` runs are held, the least recently read dropped first (read again,
a run is decoded again): the memory stays bounded in a daemon that runs for years.

Reads go through the caller's transaction, so they see one snapshot. Only what a
read-only transaction saw is kept (the API's and the metrics' reads write nothing), so
no row a rollback takes back is ever cached. Nothing here deletes a run's history, nor
does the store: a cached prefix stays true.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass, field

from supervisor import goodput
from supervisor.domain import (
    LIVE_ATTEMPT_STATES,
    TERMINAL_RUN_STATES,
    Attempt,
    AttemptState,
    AttemptStats,
    FaultRecord,
    Run,
)
from supervisor.store import Tx

SETTLE_BEHIND = 2  # an ended attempt settles once this many newer ones exist
OVER_FOR_S = 60.0  # a run over for this long has its last attempts settled too
MAX_RUNS = 1024  # runs held (the least recently read go first): memory stays bounded over years


def is_over(run: Run, now: float) -> bool:
    """The run ended ``OVER_FOR_S`` ago or more: the telemetry of its last attempt is in
    (a late step is recorded within a tick or two), and nothing starts another unless an
    operator resumes it, which leaves the ended attempts as they are."""
    return run.state in TERMINAL_RUN_STATES and run.ended_at is not None and now - run.ended_at >= OVER_FOR_S


@dataclass(frozen=True, slots=True)
class History:
    """A run's attempts (in order), their stats, its faults (oldest first), and the
    checkpoints its attempts resumed from as goodput reads them (goodput.checkpoint_times)."""

    attempts: list[Attempt]
    stats: dict[int, AttemptStats]
    faults: list[FaultRecord]
    checkpoint_times: dict[tuple[int, int], float]
    ledger: goodput.Ledger | None  # what the settled part adds to the goodput account, summed once

    @property
    def live(self) -> Attempt | None:
        """The attempt that may have processes now: the newest, unless it ended."""
        newest = self.attempts[-1] if self.attempts else None
        return newest if newest is not None and newest.state in LIVE_ATTEMPT_STATES else None

    def account(self, run: Run, now: float) -> goodput.Goodput:
        """The run's goodput account (goodput.account, the settled part from the ledger)."""
        return goodput.account(run, self.attempts, self.stats, self.faults, self.checkpoint_times, now,
                               ledger=self.ledger)


@dataclass(slots=True)
class _Settled:
    attempts: list[Attempt] = field(default_factory=list)  # numbers 1..len, every one ENDED
    stats: dict[int, AttemptStats] = field(default_factory=dict)
    faults: list[FaultRecord] = field(default_factory=list)  # recovered, of settled attempts
    checkpoint_times: dict[tuple[int, int], float] = field(default_factory=dict)  # their resume points
    ledger: goodput.Ledger | None = None

    @property
    def last_fault_id(self) -> int:
        return self.faults[-1].id if self.faults else 0


class SettledHistory:
    """Per run, the settled prefix of its history; any thread may read through it."""

    def __init__(self, max_runs: int = MAX_RUNS) -> None:
        self._runs: OrderedDict[int, _Settled] = OrderedDict()
        self._max_runs = max_runs
        self._lock = threading.Lock()

    def read(self, tx: Tx, run_number: int, *, over: bool = False) -> History:
        """The run's whole history: the settled part from memory, the rest from ``tx``.
        ``over``: the run is over (``is_over``), so its last attempts settle too."""
        with self._lock:
            known = self._runs.get(run_number) or _Settled()
            if run_number in self._runs:
                self._runs.move_to_end(run_number)
        settled = len(known.attempts)
        attempts = known.attempts + tx.list_attempts(run_number, after=settled)
        stats = {**known.stats, **tx.attempt_stats(run_number, after=settled)}
        faults = known.faults + tx.list_faults(run_number, after_id=known.last_fault_id)
        fresh = goodput.checkpoint_times(tx.list_checkpoints(
            run_number, steps={a.resume_step for a in attempts[settled:]}))
        times = {**known.checkpoint_times, **fresh}
        grown = _settle(known, attempts, stats, faults, over=over)
        if grown is not known:
            steps = {a.resume_step for a in grown.attempts}
            grown.checkpoint_times = {key: v for key, v in times.items() if key[1] in steps}
            grown.ledger = goodput.Ledger.of(grown.attempts, grown.stats, grown.faults)
            with self._lock:
                current = self._runs.get(run_number)
                if current is None or len(current.attempts) <= len(grown.attempts):
                    self._runs[run_number] = grown
                    self._runs.move_to_end(run_number)
                    while len(self._runs) > self._max_runs:
                        self._runs.popitem(last=False)
            known = grown
        return History(attempts=attempts, stats=stats, faults=faults, checkpoint_times=times,
                       ledger=known.ledger)


def _settle(known: _Settled, attempts: list[Attempt], stats: dict[int, AttemptStats],
            faults: list[FaultRecord], *, over: bool) -> _Settled:
    """The settled prefix of a run's history as ``attempts`` (all of them, in order), their
    ``stats`` and ``faults`` (oldest first) show it, looked for after the ``known`` one (a
    settled row stays settled: the scan costs what is new, not the run's age)."""
    newest = attempts[-1].number if attempts else 0
    limit = newest if over else newest - SETTLE_BEHIND
    count = len(known.attempts)
    for a in attempts[count:]:
        if a.number != count + 1 or a.number > limit or a.state is not AttemptState.ENDED:
            break
        count += 1
    kept = len(known.faults)
    for f in faults[kept:]:
        if f.recovered_at is None or f.attempt > count:
            break
        kept += 1
    if count == len(known.attempts) and kept == len(known.faults):
        return known
    added = attempts[len(known.attempts):count]
    return _Settled(attempts=attempts[:count],
                    stats={**known.stats, **{a.number: stats[a.number] for a in added if a.number in stats}},
                    faults=faults[:kept])

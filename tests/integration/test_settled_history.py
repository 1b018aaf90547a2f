"""A run's settled history (supervisor/gathering/settled.py) on a real SQLite store: every read is
what reading the store whole would give, and a settled row is decoded once."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from sqlalchemy import update

from supervisor import goodput
from supervisor.domain import (
    Attempt,
    AttemptOutcome,
    AttemptState,
    AttemptStats,
    FaultKind,
    FaultRecord,
    Policy,
    RunState,
)
from supervisor.gathering.settled import OVER_FOR_S, SETTLE_BEHIND, History, SettledHistory, is_over
from supervisor.store import SqlStore
from supervisor.store import schema as t


def new_store(tmp_path: Path) -> SqlStore:
    store = SqlStore(tmp_path / "supervisor.db")
    store.open()
    with store.tx() as tx:
        tx.create_run(name="r", spec_json="{}", run_dir_root=tmp_path, nodes=2, ranks_per_node=2, spares=1,
                      total_steps=10**6, policy=Policy(), now=0.0)
    return store


def whole(store: SqlStore) -> tuple[list[Attempt], dict[int, AttemptStats], list[FaultRecord],
                                    dict[tuple[int, int], float]]:
    with store.tx() as tx:
        attempts = tx.list_attempts(1)
        times = goodput.checkpoint_times(tx.list_checkpoints(1, steps={a.resume_step for a in attempts}))
        return attempts, tx.attempt_stats(1), tx.list_faults(1), times


def same_account(store: SqlStore, got: History, now: float) -> None:
    """The account from the ledger of the settled part is the account summed whole."""
    attempts, stats, faults, times = whole(store)
    with store.tx() as tx:
        run = tx.get_run(1)
    want, have = goodput.account(run, attempts, stats, faults, times, now), got.account(run, now)
    for name in goodput.Goodput.__dataclass_fields__:
        a, b = getattr(want, name), getattr(have, name)
        assert (a is None and b is None) or a == pytest.approx(b, rel=1e-9, abs=1e-9), (name, want, have)


def test_every_read_is_the_whole_history_as_the_store_has_it(tmp_path: Path) -> None:
    """Attempts start, train, fail and end; faults are recorded and recovered; after each
    change a read through the cache equals a read of everything."""
    store = new_store(tmp_path)
    history = SettledHistory()
    rng = random.Random(5)
    now = 10.0
    for n in range(1, 40):
        with store.tx() as tx:
            tx.add_attempt(Attempt(run_number=1, number=n, state=AttemptState.RUNNING, nodes=("a", "b"),
                                   resume_from=None, resume_step=(n - 1) * 10, created_at=now, started_at=now))
        for step in range(rng.randint(0, 3)):
            with store.tx() as tx:
                tx.put_attempt_stats(1, AttemptStats(attempt=n, steps=step + 1, last_step=(n - 1) * 10 + step + 1,
                                                     step_time_s=float(step + 1)))
                if step == 1:  # the checkpoint the next attempt resumes from
                    tx.record_checkpoint(1, step=n * 10, path=f"/ck/{n}", complete=True, duration_s=0.1,
                                         attempt=n, now=now, attempt_time_s=float(step + 1))
            with store.tx() as tx:
                got = history.read(tx, 1)
            assert (got.attempts, got.stats, got.faults, got.checkpoint_times) == whole(store)
            same_account(store, got, now + 1)
        with store.tx() as tx:
            tx.add_fault(1, attempt=n, kind=FaultKind.RANK_EXIT, ranks=[1], nodes=["a"], step=n * 10,
                         summary="killed", now=now + 5)
            tx.update_attempt(1, n, state=AttemptState.ENDED, ended_at=now + 6, outcome=AttemptOutcome.FAILED)
            if rng.random() < 0.7:  # the next attempt trained: every open fault is recovered
                tx.mark_faults_recovered(1, now + 8)
        with store.tx() as tx:
            got = history.read(tx, 1)
        assert (got.attempts, got.stats, got.faults, got.checkpoint_times) == whole(store)
        same_account(store, got, now + 7)
        assert got.ledger is not None or n <= SETTLE_BEHIND
        now += 10
    with store.tx() as tx:
        got = history.read(tx, 1, over=True)
    assert (got.attempts, got.stats, got.faults, got.checkpoint_times) == whole(store)
    assert got.checkpoint_times, "some attempts resumed from a recorded checkpoint"
    store.close()


def test_a_settled_row_is_decoded_once_and_the_live_ones_every_time(tmp_path: Path) -> None:
    store = new_store(tmp_path)
    history = SettledHistory()
    with store.tx() as tx:
        for n in range(1, 6):
            state = AttemptState.ENDED if n < 5 else AttemptState.RUNNING
            tx.add_attempt(Attempt(run_number=1, number=n, state=state, nodes=("a",), resume_from=None,
                                   resume_step=0, created_at=float(n)))
            tx.add_fault(1, attempt=n, kind=FaultKind.RANK_EXIT, ranks=[0], nodes=["a"], step=n, summary=f"f{n}",
                         now=float(n))
        tx.mark_faults_recovered(1, 9.0)
    with store.tx() as tx:
        history.read(tx, 1)  # settles attempts 1 to 5 - SETTLE_BEHIND and their faults
    settled = 5 - SETTLE_BEHIND
    with store.tx() as tx:  # rows nothing writes once settled, changed behind the cache's back
        tx.c.execute(update(t.attempts).values(reason="changed"))
        tx.c.execute(update(t.faults).values(summary="changed"))
    with store.tx() as tx:
        got = history.read(tx, 1)
    assert [a.reason for a in got.attempts] == [""] * settled + ["changed"] * (5 - settled)
    assert [f.summary for f in got.faults] == [f"f{n}" for n in range(1, settled + 1)] + ["changed"] * (5 - settled)
    with store.tx() as tx:
        fresh = SettledHistory().read(tx, 1)
    assert [a.reason for a in fresh.attempts] == ["changed"] * 5, "a new cache reads everything"
    store.close()


def test_the_runs_held_are_bounded_the_least_recently_read_going_first(tmp_path: Path) -> None:
    store = new_store(tmp_path)
    with store.tx() as tx:
        for _ in range(2):
            tx.create_run(name="r", spec_json="{}", run_dir_root=tmp_path, nodes=1, ranks_per_node=1, spares=0,
                          total_steps=10, policy=Policy(), now=0.0)
        for run in (1, 2, 3):
            for n in range(1, 4):
                tx.add_attempt(Attempt(run_number=run, number=n, state=AttemptState.ENDED, nodes=("a",),
                                       resume_from=None, resume_step=0, created_at=float(n)))
    history = SettledHistory(max_runs=2)
    with store.tx() as tx:
        for run in (1, 2, 1, 3):  # 2 is then the least recently read
            assert [a.number for a in history.read(tx, run).attempts] == [1, 2, 3]
    assert list(history._runs) == [1, 3]
    store.close()


def test_a_run_is_over_for_the_cache_a_minute_after_it_ended(tmp_path: Path) -> None:
    store = new_store(tmp_path)
    with store.tx() as tx:
        running = tx.get_run(1)
        tx.update_run(1, state=RunState.SUCCEEDED, ended_at=100.0)
        ended = tx.get_run(1)
    assert not is_over(running, 1000.0), "not while it runs"
    assert not is_over(ended, 100.0 + OVER_FOR_S - 1), "its last steps may still be on their way"
    assert is_over(ended, 100.0 + OVER_FOR_S)
    store.close()

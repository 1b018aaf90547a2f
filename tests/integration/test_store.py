"""The SQLite store on a real database file."""

from __future__ import annotations

import itertools
import sqlite3
from dataclasses import replace
from pathlib import Path

import pytest
from sqlalchemy import update

from supervisor.domain import (
    Attempt,
    AttemptState,
    CommandKind,
    CurvePoint,
    EventKind,
    FaultKind,
    Node,
    NodeCommandKind,
    NodeState,
    Policy,
    ProbeRecord,
    RunState,
)
from supervisor.errors import NotFound, StoreError
from supervisor.policy.transitions import IllegalTransition
from supervisor.store import SqlStore
from supervisor.store import migrations as store_migrations
from supervisor.store import schema as store_schema


@pytest.fixture
def store(tmp_path: Path) -> SqlStore:
    s = SqlStore(tmp_path / "db" / "supervisor.db")
    s.open()
    yield s
    s.close()


def new_run(store: SqlStore, tmp_path: Path, name: str = "t") -> int:
    with store.tx() as tx:
        run = tx.create_run(name=name, spec_json="{}", run_dir_root=tmp_path / "runs", nodes=2,
                            ranks_per_node=2,
                            spares=1, total_steps=10, policy=Policy(failures_without_progress=2), now=1.0)
    return run.number


def test_runs_get_sequential_ids_and_their_own_directories(store: SqlStore, tmp_path: Path) -> None:
    assert [new_run(store, tmp_path), new_run(store, tmp_path)] == [1, 2]
    with store.tx() as tx:
        run = tx.get_run(2)
        assert run.run_id == "run-2" and run.state is RunState.PENDING and run.policy.failures_without_progress == 2
        assert tx.run_spec_and_dir(2)[1] == tmp_path / "runs" / "run-2"
        with pytest.raises(NotFound, match="run-9"):
            tx.get_run(9)


def test_database_is_wal_with_full_sync(store: SqlStore) -> None:
    conn = sqlite3.connect(store.path)
    assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    assert conn.execute("SELECT version FROM schema_version").fetchone()[0] == store_migrations.SCHEMA_VERSION
    conn.close()


def test_a_newer_schema_is_refused_with_a_clear_message(store: SqlStore) -> None:
    with store.tx() as tx:
        tx.c.execute(update(store_schema.schema_version).values(version=store_migrations.SCHEMA_VERSION + 1))
    store.close()
    again = SqlStore(store.path)
    with pytest.raises(StoreError, match="newer than this supervisor"):
        again.open()


def test_reopening_keeps_everything(store: SqlStore, tmp_path: Path) -> None:
    number = new_run(store, tmp_path)
    with store.tx() as tx:
        tx.add_attempt(Attempt(run_number=number, number=1, state=AttemptState.LAUNCHING, nodes=("a", "b"),
                               resume_from=None, resume_step=0, created_at=2.0))
        tx.add_event(number, "x.y", "hello", {"k": 1}, 3.0)
    store.close()
    again = SqlStore(store.path)
    again.open()
    with again.tx() as tx:
        [a] = tx.list_attempts(number)
        assert a.nodes == ("a", "b") and a.state is AttemptState.LAUNCHING
        [e] = tx.list_events(number)
        assert (e.kind, e.message, e.data) == ("x.y", "hello", {"k": 1})
    again.close()


def test_events_enter_the_outbox_in_the_same_transaction(store: SqlStore, tmp_path: Path) -> None:
    number = new_run(store, tmp_path)
    with store.tx() as tx:
        ids = [tx.add_event(number, "k", f"m{i}", {}, float(i)) for i in range(3)]
    with store.tx() as tx:
        assert [e.id for e in tx.unpublished_events()] == ids
        tx.mark_published(ids[:2])
    with store.tx() as tx:
        assert [e.id for e in tx.unpublished_events()] == ids[2:]
        assert [e.id for e in tx.list_events(number, after_id=ids[0])] == ids[1:]


def test_a_failed_transaction_leaves_nothing_behind(store: SqlStore, tmp_path: Path) -> None:
    number = new_run(store, tmp_path)
    with pytest.raises(RuntimeError), store.tx() as tx:
        tx.add_event(number, "k", "lost", {}, 1.0)
        raise RuntimeError("crash mid-tick")
    with store.tx() as tx:
        assert tx.list_events(number) == []


def test_a_database_error_is_the_stores_own_error_and_rolls_back(store: SqlStore, tmp_path: Path) -> None:
    """Callers outside store/ catch StoreError alone: a database that refuses a write (here
    another connection holds its write lock) reaches them as one, and nothing is kept."""
    number = new_run(store, tmp_path)
    other = sqlite3.connect(store.path, isolation_level=None)
    other.execute("BEGIN IMMEDIATE")
    try:
        with pytest.raises(StoreError, match="locked"), store.tx() as tx:
            tx.c.exec_driver_sql("PRAGMA busy_timeout=0")  # refused now, not in 10 s
            tx.add_event(number, "k", "lost", {}, 1.0)
    finally:
        other.execute("ROLLBACK")
        other.close()
    with store.tx() as tx:
        assert tx.list_events(number) == []


def test_commands_queue_and_finish(store: SqlStore, tmp_path: Path) -> None:
    number = new_run(store, tmp_path)
    with store.tx() as tx:
        cid = tx.add_command(number, CommandKind.CANCEL, 1.0)
        with pytest.raises(NotFound):
            tx.add_command(99, CommandKind.CANCEL, 1.0)
    with store.tx() as tx:
        [c] = tx.pending_commands()
        assert (c.id, c.kind) == (cid, CommandKind.CANCEL)
        assert tx.get_command_result(cid) is None
        tx.finish_command(cid, "accepted", 2.0)
    with store.tx() as tx:
        assert tx.pending_commands() == [] and tx.get_command_result(cid) == "accepted"


def test_checkpoint_rows_report_new_and_changed(store: SqlStore, tmp_path: Path) -> None:
    number = new_run(store, tmp_path)
    with store.tx() as tx:
        kw = {"path": "/c", "duration_s": None, "attempt": None, "now": 1.0}
        assert tx.record_checkpoint(number, step=20, complete=True, **kw) is True
        assert tx.record_checkpoint(number, step=20, complete=True, **kw) is False
        assert tx.record_checkpoint(number, step=20, complete=False, **kw) is True  # corrupted since
        assert [c.complete for c in tx.list_checkpoints(number)] == [False]


def test_metrics_ignore_duplicates_and_store_nan_as_null(store: SqlStore, tmp_path: Path) -> None:
    number = new_run(store, tmp_path)
    with store.tx() as tx:
        for loss in (float("nan"), 5.0):
            tx.add_metric(number, attempt=1, step=1, loss=loss, grad_norm=1.0, lr=0.1, step_time_s=0.2,
                          tokens_per_s=10.0, now=1.0)
        [m] = tx.list_metrics(number)
        assert m.loss is None and m.step_time_s == 0.2
        assert (m.param_norm, m.mfu, m.val_loss) == (None, None, None)  # not sent
        tx.add_metric(number, attempt=1, step=2, loss=4.0, grad_norm=1.0, lr=0.1, step_time_s=0.2,
                      tokens_per_s=10.0, now=2.0, param_norm=19.5, mfu=0.125, val_loss=float("nan"))
        m = tx.list_metrics(number)[1]
        assert (m.param_norm, m.mfu, m.val_loss) == (19.5, 0.125, None)


def test_faults_and_nodes(store: SqlStore, tmp_path: Path) -> None:
    number, other = new_run(store, tmp_path), new_run(store, tmp_path)
    with store.tx() as tx:
        tx.add_fault(number, attempt=1, kind=FaultKind.NODE_LOST, ranks=(2, 3), nodes=("b",), step=9,
                     summary="gone", now=5.0)
        assert tx.count_open_faults(number) == 1
        assert tx.mark_faults_recovered(number, 8.0) == 1
        [f] = tx.list_faults(number)
        assert (f.kind, f.ranks, f.nodes, f.recovered_at) == (FaultKind.NODE_LOST, (2, 3), ("b",), 8.0)
        tx.add_fault(other, attempt=1, kind=FaultKind.HANG, ranks=(0,), nodes=("b",), step=3, summary="",
                     now=9.0)
        assert [(g.run_number, g.kind) for g in tx.faults_since(5.0)] == [(number, FaultKind.NODE_LOST),
                                                                          (other, FaultKind.HANG)]
        assert [g.run_number for g in tx.faults_since(6.0)] == [other]
        tx.put_node(Node(name="b", state=NodeState.ALLOCATED, run_number=number), 1.0)
        tx.put_node(Node(name="b", state=NodeState.DRAINED, reason="why", run_number=number), 2.0)
        assert tx.get_node("b").reason == "why"
        tx.update_run(number, state=RunState.FAILED)
        assert tx.finished_runs_holding_resources() == set()  # the drained node is not held
        tx.put_node(Node(name="c", state=NodeState.ALLOCATED, run_number=number), 2.0)
        assert tx.finished_runs_holding_resources() == {number}


def reopened_as(store: SqlStore, sql: str) -> SqlStore:
    """``store`` closed, made an older database by ``sql`` (run by sqlite3 itself), and
    opened again: the migrations since have run."""
    store.close()
    conn = sqlite3.connect(store.path)
    conn.executescript(sql)
    conn.close()
    again = SqlStore(store.path)
    again.open()
    return again


def test_a_version_3_database_gains_the_event_kind_and_fault_time_indexes(store: SqlStore) -> None:
    reopened_as(store, "DROP INDEX events_by_run_kind; DROP INDEX faults_by_time; "
                       "UPDATE schema_version SET version = 3;").close()
    conn = sqlite3.connect(store.path)
    names = {name for (name,) in conn.execute("SELECT name FROM sqlite_master WHERE type = 'index'")}
    assert {"events_by_run_kind", "faults_by_time"} <= names
    assert conn.execute("SELECT version FROM schema_version").fetchone()[0] == store_migrations.SCHEMA_VERSION
    conn.close()


def as_version_4(store: SqlStore, run_number: int) -> None:
    """Make the (closed) database a version 4 one: commands of runs only, one queued."""
    conn = sqlite3.connect(store.path)
    conn.executescript(f"""
        DROP TABLE commands;
        CREATE TABLE commands (id INTEGER PRIMARY KEY AUTOINCREMENT,
            run_number INTEGER NOT NULL REFERENCES runs (number), kind VARCHAR(16) NOT NULL,
            created_at FLOAT NOT NULL, handled_at FLOAT, result TEXT);
        INSERT INTO commands (run_number, kind, created_at) VALUES ({run_number}, 'pause', 5.0);
        UPDATE schema_version SET version = 4;""")
    conn.close()


def test_a_version_4_database_keeps_its_commands_and_gains_node_commands(store: SqlStore,
                                                                         tmp_path: Path) -> None:
    number = new_run(store, tmp_path)
    store.close()
    as_version_4(store, number)
    again = SqlStore(store.path)
    again.open()
    with again.tx() as tx:
        [old] = tx.pending_commands()
        assert (old.id, old.run_number, old.kind) == (1, number, CommandKind.PAUSE)
        tx.put_node(Node(name="n1", state=NodeState.IDLE), 1.0)
        cid = tx.add_node_command("n1", NodeCommandKind.DRAIN, "fan", 6.0)
        [new] = tx.pending_node_commands()
        assert (new.id, new.node, new.reason) == (cid, "n1", "fan") and cid == 2
        assert tx.pending_commands() == [old], "a node's command is not a run's"
        with pytest.raises(NotFound):
            tx.add_node_command("n9", NodeCommandKind.DRAIN, "x", 6.0)
    again.close()


def test_a_version_15_database_lets_go_of_its_ended_attempts_once(store: SqlStore, tmp_path: Path) -> None:
    number = new_run(store, tmp_path)
    with store.tx() as tx:
        for n, state in ((1, AttemptState.ENDED), (2, AttemptState.RUNNING)):
            tx.add_attempt(Attempt(run_number=number, number=n, state=state, nodes=("a",), resume_from=None,
                                   resume_step=0, created_at=1.0, launch_info="{}"))
    again = reopened_as(store, "DROP INDEX attempts_unreleased; ALTER TABLE attempts DROP COLUMN released_at; "
                               "UPDATE schema_version SET version = 15;")
    with again.tx() as tx:
        assert [(a.number, a.state) for _, a in tx.unreleased_attempts()] == [(1, AttemptState.ENDED)]
        tx.released(number, 1, 5.0)
        assert tx.unreleased_attempts() == []
    again.close()


def test_a_version_16_database_keeps_its_probes_and_gains_their_link_figures(store: SqlStore,
                                                                             tmp_path: Path) -> None:
    number = new_run(store, tmp_path)
    with store.tx() as tx:
        tx.add_probe(ProbeRecord(node="n1", at=1.0, kind="preflight", status="healthy", action="none", reason="",
                                 findings=[], run_number=number))
    again = reopened_as(store, "ALTER TABLE probes DROP COLUMN link_gbps; UPDATE schema_version SET version = 16;")
    with again.tx() as tx:
        [old] = tx.recent_probes("n1")
        assert (old.status, old.link_gbps) == ("healthy", None)
        tx.add_probe(replace(old, at=2.0, link_gbps=0.4))
        assert tx.link_figures("n1") == [0.4]
    again.close()


def test_a_migration_that_fails_midway_leaves_the_database_as_it_was(store: SqlStore, tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Every migration of an upgrade runs in one transaction (an explicit BEGIN): DDL rolls
    back with the rest. Here _v5 renames the commands table, then fails before rebuilding it;
    the database must still open at version 4 with its commands, and upgrade once fixed."""
    number = new_run(store, tmp_path)
    store.close()
    as_version_4(store, number)

    def broken_v5(c: object) -> None:
        c.exec_driver_sql("ALTER TABLE commands RENAME TO commands_v4")  # type: ignore[attr-defined]
        raise RuntimeError("power cut in the middle of _v5")

    broken = [*store_migrations.MIGRATIONS[:4], broken_v5, *store_migrations.MIGRATIONS[5:]]
    with monkeypatch.context() as m:
        m.setattr(store_migrations, "MIGRATIONS", broken)
        with pytest.raises(RuntimeError, match="power cut"):
            SqlStore(store.path).open()
    conn = sqlite3.connect(store.path)
    tables = {name for (name,) in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    assert "commands" in tables and "commands_v4" not in tables, "the rename rolled back"
    assert conn.execute("SELECT version FROM schema_version").fetchone()[0] == 4
    conn.close()
    again = SqlStore(store.path)
    again.open()  # the real _v5 (and the rest) now upgrade it
    with again.tx() as tx:
        [old] = tx.pending_commands()
        assert (old.run_number, old.kind) == (number, CommandKind.PAUSE)
    again.close()


def test_the_loss_curve_stays_bounded_and_spans_the_whole_run(store: SqlStore, tmp_path: Path) -> None:
    number = new_run(store, tmp_path)
    with store.tx() as tx:
        for chunk in range(10):  # 5,000 steps in ten ticks
            tx.extend_curve(number, [CurvePoint(attempt=1, step=s, loss=1.0, grad_norm=1.0, step_time_s=0.1,
                                                at=s)
                                     for s in range(chunk * 500 + 1, chunk * 500 + 501)])
        points = tx.curve(number)
    assert store_schema.CURVE_POINTS // 2 <= len(points) <= store_schema.CURVE_POINTS
    steps = [p.step for p in points]
    assert steps == sorted(steps) and steps[0] <= 10 and steps[-1] >= 4990, "evenly over the whole run"
    assert len({b - a for a, b in itertools.pairwise(steps)}) == 1


def test_retention_prunes_old_raw_steps_and_published_events_and_keeps_the_rest(store: SqlStore,
                                                                               tmp_path: Path) -> None:
    number = new_run(store, tmp_path)
    with store.tx() as tx:
        for step in range(1, 101):
            assert tx.add_metric(number, attempt=1, step=step, loss=1.0, grad_norm=1.0, lr=0.1,
                                 step_time_s=0.1,
                                 tokens_per_s=1.0, now=float(step))
        assert not tx.add_metric(number, attempt=1, step=7, loss=1.0, grad_norm=1.0, lr=0.1, step_time_s=0.1,
                                 tokens_per_s=1.0, now=7.0), "a duplicate delivery is kept once"
        old = [tx.add_event(number, "x", "old", {}, float(t)) for t in range(10)]
        tx.mark_published(old[:5])  # the other five are still waiting to be published
        tx.add_event(number, "x", "new", {}, 500.0)
        assert tx.prune_metrics(before=51.0, limit=30) == 30
        assert tx.prune_metrics(before=51.0, limit=30) == 20
        assert [m.step for m in tx.list_metrics(number)] == list(range(51, 101))
        assert tx.prune_events(before=100.0, limit=100) == 5
        assert [e.message for e in tx.list_events(number, kind="x")] == ["old"] * 5 + ["new"]


def test_a_version_6_database_gains_stats_and_a_curve_from_the_steps_it_kept(store: SqlStore,
                                                                           tmp_path: Path) -> None:
    number = new_run(store, tmp_path)
    with store.tx() as tx:
        for step in range(1, 2501):
            tx.add_metric(number, attempt=1 + step // 2000, step=step, loss=3.0, grad_norm=1.0, lr=0.1,
                          step_time_s=0.5, tokens_per_s=1.0, now=float(step))
        tx.add_fault(number, attempt=1, kind=FaultKind.RANK_EXIT, ranks=[0], nodes=["n"], step=1999,
                     summary="x",
                     now=1999.5)
    again = reopened_as(store, "DROP TABLE attempt_stats; DROP TABLE loss_curve; UPDATE runs SET curve_seq = 0, "
                               "curve_stride = 1; UPDATE faults SET last_step_at = NULL; "
                               "UPDATE schema_version SET version = 6;")
    with again.tx() as tx:
        stats = tx.attempt_stats(number)
        assert (stats[1].steps, stats[1].first_step, stats[1].last_step, stats[1].step_time_s) == (1999, 1,
                                                                                                   1999,
                                                                                                   999.5)
        assert (stats[2].steps, stats[2].last_at, stats[2].first_step_time_s) == (501, 2500.0, 0.5)
        curve = tx.curve(number)
        assert 500 <= len(curve) <= store_schema.CURVE_POINTS and curve[-1].step > 2400
        [fault] = tx.list_faults(number)
        assert fault.last_step_at == 1999.0
    again.close()


def test_checkpoints_are_listed_whole_newest_first_few_or_at_given_steps(store: SqlStore, tmp_path: Path) -> None:
    number = new_run(store, tmp_path)
    with store.tx() as tx:
        for step in range(10, 101, 10):
            tx.record_checkpoint(number, step=step, path=f"/c/{step}", complete=True, duration_s=1.0, attempt=1,
                                 now=float(step), attempt_time_s=step * 0.5)
        assert [c.step for c in tx.list_checkpoints(number)] == list(range(10, 101, 10))
        assert [c.step for c in tx.list_checkpoints(number, newest=3)] == [80, 90, 100]
        assert [(c.step, c.attempt_time_s) for c in tx.list_checkpoints(number, steps={20, 70, 75})] == [
            (20, 10.0), (70, 35.0)]


def test_a_checkpoint_saved_again_names_the_attempt_that_committed_it_last(store: SqlStore, tmp_path: Path) -> None:
    number = new_run(store, tmp_path)
    with store.tx() as tx:
        for attempt, step in ((1, 20), (1, 40), (4, 40)):
            tx.record_checkpoint(number, step=step, path=f"/c/{step}", complete=True, duration_s=1.0,
                                 attempt=attempt, now=float(attempt))
        assert tx.committed_by(number, {40, 60}) == {40: 4}
        assert tx.committed_by(number, set()) == {}


def test_memory_checkpoints_are_recorded_once_and_only_the_newest_are_kept(store: SqlStore, tmp_path: Path) -> None:
    from supervisor.store.history import MEMORY_CHECKPOINTS_KEPT

    number, other = new_run(store, tmp_path), new_run(store, tmp_path)
    with store.tx() as tx:
        assert tx.record_memory_checkpoint(number, attempt=1, step=5, duration_s=0.01, now=1.0) is True
        assert tx.record_memory_checkpoint(number, attempt=1, step=5, duration_s=0.01, now=2.0) is False
        tx.record_memory_checkpoint(other, attempt=1, step=5, duration_s=None, now=1.0)
        for i, step in enumerate(range(10, 10 + 5 * MEMORY_CHECKPOINTS_KEPT, 5)):
            tx.record_memory_checkpoint(number, attempt=2, step=step, duration_s=0.02, now=3.0 + i)
        kept = tx.list_memory_checkpoints(number)
        assert [(m.attempt, m.step) for m in kept] == [(2, s) for s in range(10, 10 + 5 * MEMORY_CHECKPOINTS_KEPT, 5)]
        assert [(m.step, m.duration_s) for m in tx.list_memory_checkpoints(other)] == [(5, None)]


def test_a_node_record_changes_only_as_the_node_table_allows(store: SqlStore, tmp_path: Path) -> None:
    """A drained node written straight into a run's allocation raises, and nothing of that
    transaction is kept."""
    run = new_run(store, tmp_path)
    with store.tx() as tx:
        tx.put_node(Node(name="n1", state=NodeState.DRAINED, reason="probe: bad"), 1.0)
    with pytest.raises(IllegalTransition), store.tx() as tx:
        tx.add_event(None, EventKind.DAEMON_STARTED, "in the same transaction", {}, 2.0)
        tx.put_node(Node(name="n1", state=NodeState.ALLOCATED, run_number=run), 2.0)
    with store.tx() as tx:
        assert [(n.name, n.state) for n in tx.list_nodes()] == [("n1", NodeState.DRAINED)]
        assert tx.list_events(None, 0, 10) == []
        tx.put_node(Node(name="n1", state=NodeState.IDLE), 3.0)  # returned to service, then a run's
        tx.put_node(Node(name="n1", state=NodeState.ALLOCATED, run_number=run), 4.0)


def test_a_runs_spares_are_listed_with_their_newest_probe_and_link_figures_newest_first(
        store: SqlStore, tmp_path: Path) -> None:
    number = new_run(store, tmp_path)
    with store.tx() as tx:
        for name in ("n1", "n2", "n3", "n4"):
            tx.put_node(Node(name=name, state=NodeState.ALLOCATED, run_number=number), 1.0)
        tx.put_node(Node(name="n5", state=NodeState.DRAINED, reason="x", run_number=number), 1.0)
        for at, node, gbps in ((5.0, "n3", 0.5), (9.0, "n3", None), (7.0, "n1", 0.4), (8.0, "n3", 0.3)):
            tx.add_probe(ProbeRecord(node=node, at=at, kind="preflight", status="healthy", action="none",
                                     reason="", findings=[], run_number=number, link_gbps=gbps))
        assert tx.spares_probed_at(number, ("n1", "n2")) == (("n3", 8.0), ("n4", None)), "newest by order"
        assert tx.link_figures("n3") == [0.3, 0.5] and tx.link_figures("n2") == []
        assert tx.recent_probes("n1", 1)[0].link_gbps == 0.4

"""The SQLite schema's migrations (its tables: supervisor/store/schema.py).

A database's version is stored in the ``schema_version`` table; ``MIGRATIONS[i]`` takes a
database from version i to i + 1, up to ``SCHEMA_VERSION`` (one per migration); a newer
database is refused, never guessed at. Add a migration, never edit an old one (``_v1``
creates the tables from the current ``metadata``, so each later one checks before it
adds). ``migrate`` runs every migration of an upgrade in one transaction, on a
connection that begins with an explicit BEGIN (supervisor/store/engine.py), so one that
fails midway leaves the database as it was.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from sqlalchemy import Connection

from supervisor.store.schema import (
    CURVE_POINTS,
    attempt_stats,
    attempts,
    commands,
    data_skips,
    events,
    faults,
    loss_curve,
    memory_checkpoints,
    metadata,
    metrics,
    node_intents,
    notify_cursors,
    people,
    probe_rounds,
    probes,
    stragglers,
)


def _v1(conn: Connection) -> None:
    metadata.create_all(conn)


def _v2(conn: Connection) -> None:
    """runs.allocation_info (the Slurm launcher). ``_v1`` creates tables from the
    current metadata, so a database made today already has the column."""
    have = {row[1] for row in conn.exec_driver_sql("PRAGMA table_info(runs)")}
    if "allocation_info" not in have:
        conn.exec_driver_sql("ALTER TABLE runs ADD COLUMN allocation_info TEXT")


def _v3(conn: Connection) -> None:
    """The probes table (node health). ``_v1`` already made it in a database made today."""
    probes.create(conn, checkfirst=True)


def _v4(conn: Connection) -> None:
    """Indexes for one kind of a run's events (the policy reads its straggler reports)
    and for the faults of a time window (lemon nodes)."""
    for index in (*events.indexes, *faults.indexes):
        if index.name in ("events_by_run_kind", "faults_by_time"):
            index.create(conn, checkfirst=True)


def _v5(conn: Connection) -> None:
    """Node commands: commands.run_number may be NULL, with commands.node and
    commands.reason. SQLite cannot relax NOT NULL in place, so the table is rebuilt."""
    have = {row[1] for row in conn.exec_driver_sql("PRAGMA table_info(commands)")}
    if "node" in have:
        return  # made by _v1 from today's metadata
    conn.exec_driver_sql("ALTER TABLE commands RENAME TO commands_v4")
    commands.create(conn)
    conn.exec_driver_sql(
        "INSERT INTO commands (id, run_number, node, kind, reason, created_at, handled_at, result) "
        "SELECT id, run_number, NULL, kind, '', created_at, handled_at, result FROM commands_v4")
    conn.exec_driver_sql("DROP TABLE commands_v4")


def _v6(conn: Connection) -> None:
    """Node intents (every drain and return, sent until the cluster shows it), and their own
    tables for stragglers and data skips, moved out of the event log: each event's data
    becomes a row. A drained node's drain becomes an intent still to be confirmed.
    attempts.launch_fatal: a launch that failed because the command cannot be executed."""
    for table in (node_intents, stragglers, data_skips):
        table.create(conn, checkfirst=True)
    have = {row[1] for row in conn.exec_driver_sql("PRAGMA table_info(attempts)")}
    if "launch_fatal" not in have:
        conn.exec_driver_sql("ALTER TABLE attempts ADD COLUMN launch_fatal BOOLEAN NOT NULL DEFAULT 0")
    conn.exec_driver_sql(
        "INSERT OR IGNORE INTO stragglers (run_number, attempt, rank, node, busy_s, typical_s, window, at) "
        "SELECT run_number, json_extract(data, '$.attempt'), json_extract(data, '$.rank'), "
        "json_extract(data, '$.node'), json_extract(data, '$.busy_s'), json_extract(data, '$.typical_s'), "
        "json_extract(data, '$.window'), ts FROM events WHERE kind = 'straggler' AND run_number IS NOT NULL")
    conn.exec_driver_sql(
        "INSERT INTO data_skips (run_number, start, \"end\", reason, at) "
        "SELECT run_number, json_extract(data, '$.start'), json_extract(data, '$.end'), message, ts "
        "FROM events WHERE kind = 'data.skip' AND run_number IS NOT NULL")
    conn.exec_driver_sql(
        "INSERT OR IGNORE INTO node_intents (node, action, reason, requested_at, sent) "
        "SELECT name, 'drain', reason, updated_at, 0 FROM nodes WHERE state = 'DRAINED'")


def _add_columns(conn: Connection, table: str, columns: dict[str, str]) -> None:
    have = {row[1] for row in conn.exec_driver_sql(f"PRAGMA table_info({table})")}
    for name, sql in columns.items():
        if name not in have:
            conn.exec_driver_sql(f"ALTER TABLE {table} ADD COLUMN {name} {sql}")


def _v7(conn: Connection) -> None:
    """Reads that do not grow with the run: per-attempt stats and a downsampled loss curve,
    computed here from the metrics kept so far; a fault's last step and injection time;
    a checkpoint's share of its attempt's work; time indexes for retention."""
    _add_columns(conn, "runs", {"curve_seq": "INTEGER NOT NULL DEFAULT 0",
                                "curve_stride": "INTEGER NOT NULL DEFAULT 1"})
    _add_columns(conn, "faults", {"last_step_at": "FLOAT", "injected_at": "FLOAT"})
    _add_columns(conn, "checkpoints", {"attempt_time_s": "FLOAT"})
    for table in (attempt_stats, loss_curve):
        table.create(conn, checkfirst=True)
    for index in (*metrics.indexes, *events.indexes):
        if index.name in ("metrics_by_time", "events_by_time"):
            index.create(conn, checkfirst=True)
    conn.exec_driver_sql(
        "INSERT OR IGNORE INTO attempt_stats (run_number, attempt, steps, first_step, last_step, first_at, "
        "last_at, step_time_s, checkpoints, checkpoint_s) "
        "SELECT run_number, attempt, count(*), min(step), max(step), min(received_at), max(received_at), "
        "sum(step_time_s), 0, 0.0 FROM metrics GROUP BY run_number, attempt")
    conn.exec_driver_sql(
        "UPDATE attempt_stats SET "
        "first_step_time_s = (SELECT m.step_time_s FROM metrics m "
        "WHERE m.run_number = attempt_stats.run_number AND m.attempt = attempt_stats.attempt "
        "ORDER BY m.received_at, m.step LIMIT 1), "
        "last_loss = (SELECT m.loss FROM metrics m WHERE m.run_number = attempt_stats.run_number "
        "AND m.attempt = attempt_stats.attempt ORDER BY m.step DESC LIMIT 1), "
        "last_grad_norm = (SELECT m.grad_norm FROM metrics m WHERE m.run_number = attempt_stats.run_number "
        "AND m.attempt = attempt_stats.attempt ORDER BY m.step DESC LIMIT 1), "
        "checkpoints = (SELECT count(*) FROM checkpoints c WHERE c.run_number = attempt_stats.run_number "
        "AND c.attempt = attempt_stats.attempt AND c.duration_s IS NOT NULL), "
        "checkpoint_s = coalesce((SELECT sum(c.duration_s) FROM checkpoints c "
        "WHERE c.run_number = attempt_stats.run_number AND c.attempt = attempt_stats.attempt), 0.0)")
    for run_number, count in conn.exec_driver_sql(
            "SELECT run_number, count(*) FROM metrics GROUP BY run_number").fetchall():
        stride = 1
        while count // stride > CURVE_POINTS:
            stride *= 2
        conn.exec_driver_sql(
            "INSERT OR IGNORE INTO loss_curve "
            "(run_number, seq, attempt, step, loss, grad_norm, step_time_s, at) "
            "SELECT run_number, seq, attempt, step, loss, grad_norm, step_time_s, received_at FROM "
            "(SELECT *, row_number() OVER (ORDER BY attempt, step) AS seq FROM metrics WHERE run_number = ?) "
            "WHERE seq % ? = 0", (run_number, stride))
        conn.exec_driver_sql("UPDATE runs SET curve_seq = ?, curve_stride = ? WHERE number = ?",
                             (count, stride, run_number))
    conn.exec_driver_sql(
        "UPDATE faults SET last_step_at = (SELECT max(m.received_at) FROM metrics m "
        "WHERE m.run_number = faults.run_number AND m.attempt = faults.attempt "
        "AND m.received_at <= faults.detected_at)")
    conn.exec_driver_sql(
        "UPDATE faults SET injected_at = (SELECT max(e.ts) FROM events e "
        "WHERE e.run_number = faults.run_number "
        "AND e.kind = 'chaos.injected' AND json_extract(e.data, '$.attempt') = faults.attempt "
        "AND e.ts <= faults.detected_at)")


def _v8(conn: Connection) -> None:
    """The in-memory checkpoint tier's saves."""
    memory_checkpoints.create(conn, checkfirst=True)


def _v9(conn: Connection) -> None:
    """A step's parameter norm, MFU and validation loss."""
    _add_columns(conn, "metrics", {"param_norm": "FLOAT", "mfu": "FLOAT", "val_loss": "FLOAT"})


def _v10(conn: Connection) -> None:
    """Rounds of probes as rows."""
    probe_rounds.create(conn, checkfirst=True)


def _v11(conn: Connection) -> None:
    """An operator's resume from a chosen checkpoint step."""
    _add_columns(conn, "commands", {"step": "INTEGER"})


def _v12(conn: Connection) -> None:
    """The job's precompile pass as an attempt."""
    _add_columns(conn, "attempts", {"precompile": "TEXT"})


def _v13(conn: Connection) -> None:
    """A paused or failed run's Slurm job, kept in the queue for the run to go on in; a
    [command] attempt's inputs when it was launched."""
    _add_columns(conn, "runs", {"parked_allocation": "TEXT"})
    _add_columns(conn, "attempts", {"inputs": "TEXT"})


def _v14(conn: Connection) -> None:
    """A precompile attempt's set-aside moves, in the store (they were a manifest file in
    the run's directory, which its user could replace): an unfinished manifest of a run
    still going is taken over, read as no link and no more than 1 MiB."""
    _add_columns(conn, "attempts", {"set_aside": "TEXT"})
    from supervisor import user_files  # here: the schema needs it only for this migration

    rows = conn.exec_driver_sql(
        "SELECT a.run_number, a.number, r.run_dir FROM attempts a JOIN runs r ON r.number = a.run_number "
        "WHERE a.precompile IS NOT NULL AND r.state NOT IN ('SUCCEEDED', 'FAILED', 'CANCELLED')").fetchall()
    for run_number, number, run_dir in rows:
        manifest = Path(run_dir) / "precompile" / f"set-aside-{number}.json"
        try:
            moves = json.loads(user_files.read_text(manifest, 1 << 20))
            text = json.dumps([[str(src), str(dst)] for src, dst in moves])
        except (OSError, ValueError, TypeError):
            continue
        conn.exec_driver_sql("UPDATE attempts SET set_aside = ? WHERE run_number = ? AND number = ?",
                             (text, run_number, number))


def _v15(conn: Connection) -> None:
    """How far the daemon read each log of a [command] attempt, kept across its restarts."""
    _add_columns(conn, "attempts", {"output_offsets": "TEXT"})


def _v16(conn: Connection) -> None:
    """When the launcher let go of an ended attempt. The attempts that ended before the
    upgrade have none: the upgraded daemon lets go of each once (the launcher's ``forget``
    ends only processes that are still the attempt's own)."""
    _add_columns(conn, "attempts", {"released_at": "FLOAT"})
    next(i for i in attempts.indexes if i.name == "attempts_unreleased").create(conn, checkfirst=True)


def _v17(conn: Connection) -> None:
    """Each probe's figure in its round's link test (a node's drift over weeks)."""
    _add_columns(conn, "probes", {"link_gbps": "FLOAT"})


def _v18(conn: Connection) -> None:
    """How far each webhook has delivered the event log; people's API tokens."""
    notify_cursors.create(conn, checkfirst=True)
    people.create(conn, checkfirst=True)


MIGRATIONS: list[Callable[[Connection], None]] = [_v1, _v2, _v3, _v4, _v5, _v6, _v7, _v8, _v9, _v10, _v11,
                                                  _v12, _v13, _v14, _v15, _v16, _v17, _v18]
SCHEMA_VERSION = len(MIGRATIONS)

"""The SQLite schema and its migrations.

The database records the supervisor's whole memory: a restarted daemon re-derives
everything from these tables plus the launcher. A database's version is stored in the
``schema_version`` table; ``MIGRATIONS[i]`` takes a database from version i to i + 1, up
to ``SCHEMA_VERSION`` (one per migration); a newer database is refused, never guessed at.
Add a migration, never edit an old one (``_v1`` creates the tables from the current
``metadata``, so each later one checks before it adds). ``migrate`` runs every
migration of an upgrade in one transaction, on a connection that begins with an
explicit BEGIN (supervisor/store/engine.py), so one that fails midway leaves the
database as it was.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from sqlalchemy import (
    Boolean,
    Column,
    Connection,
    Float,
    ForeignKey,
    Index,
    Integer,
    MetaData,
    String,
    Table,
    Text,
)

metadata = MetaData()

schema_version = Table("schema_version", metadata, Column("version", Integer, nullable=False))

runs = Table(
    "runs",
    metadata,
    Column("number", Integer, primary_key=True, autoincrement=True),
    Column("name", String(64), nullable=False),
    Column("state", String(16), nullable=False),
    Column("reason", Text, nullable=False, default=""),
    Column("spec", Text, nullable=False),  # the validated spec, JSON
    Column("run_dir", Text, nullable=False),  # checkpoints, attempt logs, result
    Column("nodes", Integer, nullable=False),
    Column("ranks_per_node", Integer, nullable=False),
    Column("spares", Integer, nullable=False),
    Column("total_steps", Integer, nullable=False),
    Column("policy", Text, nullable=False),  # JSON of domain.Policy
    Column("created_at", Float, nullable=False),
    Column("started_at", Float),
    Column("ended_at", Float),
    Column("final_step", Integer),
    Column("model_digest", String(128)),
    Column("budget_from_attempt", Integer, nullable=False, default=0),
    # The launcher's handle on the nodes the run holds (a Slurm allocation's job id),
    # opaque here; see supervisor/launchers/base.py.
    Column("allocation_info", Text),
    # A Slurm job the run keeps in the queue, held, with no node (a paused or failed run):
    # its allocation_info, for the next allocation to go on in (supervisor/slurm/allocation.py).
    Column("parked_allocation", Text),
    Column("curve_seq", Integer, nullable=False, default=0),  # rank 0's steps recorded so far
    Column("curve_stride", Integer, nullable=False, default=1),  # loss_curve keeps every stride-th
)

attempts = Table(
    "attempts",
    metadata,
    Column("run_number", Integer, ForeignKey("runs.number"), primary_key=True),
    Column("number", Integer, primary_key=True),
    Column("state", String(16), nullable=False),
    Column("nodes", Text, nullable=False),  # JSON list
    Column("resume_from", Text),
    Column("resume_step", Integer, nullable=False),
    Column("created_at", Float, nullable=False),
    Column("started_at", Float),
    Column("first_step_at", Float),
    Column("stop_requested_at", Float),
    Column("ended_at", Float),
    Column("outcome", String(16)),
    Column("reason", Text, nullable=False, default=""),
    Column("final_step", Integer),
    Column("launch_info", Text),
    Column("launch_error", Text),
    Column("launch_fatal", Boolean, nullable=False, default=False),
    Column("precompile", Text),  # a precompile attempt's inputs' fingerprint; NULL: a training attempt
    Column("inputs", Text),  # a [command] job's inputs' fingerprint at launch
    Column("set_aside", Text),  # a precompile attempt's moves of the run's checkpoints, while out
)

nodes = Table(
    "nodes",
    metadata,
    Column("name", String(128), primary_key=True),
    Column("state", String(16), nullable=False),
    Column("reason", Text, nullable=False, default=""),
    Column("run_number", Integer, ForeignKey("runs.number")),
    Column("updated_at", Float, nullable=False),
)

# One row per probe of a node (health/): preflight, diagnosis after a fault, on demand.
probes = Table(
    "probes",
    metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("node", String(128), nullable=False),
    Column("at", Float, nullable=False),
    Column("kind", String(16), nullable=False),  # preflight, diagnosis, manual
    Column("status", String(16), nullable=False),  # healthy, degraded, unhealthy, unknown
    Column("action", String(16), nullable=False),  # none, restart, reboot, replace
    Column("reason", Text, nullable=False),
    Column("findings", Text, nullable=False),  # JSON list of health.model.Finding
    Column("run_number", Integer, ForeignKey("runs.number")),
    Index("probes_by_node", "node", "id"),
)

# One row per round of probes, open until its answers are judged (supervisor/probes.py).
probe_rounds = Table(
    "probe_rounds",
    metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("run_number", Integer, ForeignKey("runs.number")),  # NULL: the sweep
    Column("kind", String(16), nullable=False),  # preflight, diagnosis, sweep, manual
    Column("nodes", Text, nullable=False),  # JSON list
    Column("argv", Text, nullable=False),  # JSON list: python -m health and its arguments
    Column("timeout_s", Float, nullable=False),
    Column("round", Integer, nullable=False),
    Column("started_at", Float, nullable=False),
    Column("ended_at", Float),  # NULL: open
    Index("probe_rounds_open", "ended_at"),
)

checkpoints = Table(
    "checkpoints",
    metadata,
    Column("run_number", Integer, ForeignKey("runs.number"), primary_key=True),
    Column("step", Integer, primary_key=True),
    Column("path", Text, nullable=False),
    Column("complete", Boolean, nullable=False),
    Column("duration_s", Float),
    Column("attempt", Integer),
    Column("created_at", Float, nullable=False),
    # The attempt's summed step time when it committed this checkpoint (goodput: the
    # work a later resume from here keeps of it).
    Column("attempt_time_s", Float),
)

# The in-memory tier (trainer/memory_tier.py): saves every rank's state reached in node
# memory, with a replica on the next node of the saving attempt (whose node order says
# which node holds which replica). Only the newest few of a run are kept.
memory_checkpoints = Table(
    "memory_checkpoints",
    metadata,
    Column("run_number", Integer, ForeignKey("runs.number"), primary_key=True),
    Column("attempt", Integer, primary_key=True),
    Column("step", Integer, primary_key=True),
    Column("duration_s", Float),  # how long training was blocked
    Column("created_at", Float, nullable=False),
)

faults = Table(
    "faults",
    metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("run_number", Integer, ForeignKey("runs.number"), nullable=False),
    Column("attempt", Integer, nullable=False),
    Column("kind", String(32), nullable=False),
    Column("ranks", Text, nullable=False),  # JSON list
    Column("nodes", Text, nullable=False),  # JSON list
    Column("step", Integer, nullable=False),
    Column("summary", Text, nullable=False),
    Column("detected_at", Float, nullable=False),
    Column("recovered_at", Float),
    Column("last_step_at", Float),  # when the attempt's last step before the fault was received
    Column("injected_at", Float),  # a drill's: when the fault was injected
    Index("faults_by_run", "run_number"),
    Index("faults_by_time", "detected_at"),
)

# Rank 0's step metrics, one row per (attempt, step): the loss curve and the goodput
# accounting (which steps survived into the final trajectory) come from here.
metrics = Table(
    "metrics",
    metadata,
    Column("run_number", Integer, ForeignKey("runs.number"), primary_key=True),
    Column("attempt", Integer, primary_key=True),
    Column("step", Integer, primary_key=True),
    Column("loss", Float),  # NULL when not finite
    Column("grad_norm", Float),
    Column("lr", Float),
    Column("step_time_s", Float, nullable=False),
    Column("tokens_per_s", Float),
    Column("received_at", Float, nullable=False),
    # The reference trainer's (NULL when not sent, or not finite): parameter norm, MFU,
    # and the held-out loss of a step that ran validation.
    Column("param_norm", Float),
    Column("mfu", Float),
    Column("val_loss", Float),
    Index("metrics_by_time", "received_at"),  # retention
)

events = Table(
    "events",
    metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("run_number", Integer, ForeignKey("runs.number")),
    Column("ts", Float, nullable=False),
    Column("kind", String(64), nullable=False),
    Column("message", Text, nullable=False),
    Column("data", Text, nullable=False, default="{}"),
    Index("events_by_run", "run_number", "id"),
    Index("events_by_run_kind", "run_number", "kind", "id"),
    Index("events_by_time", "ts"),  # retention
)

# Events waiting to be published on MQTT: written in the same transaction as the event,
# deleted once published.
outbox = Table(
    "outbox",
    metadata,
    Column("event_id", Integer, ForeignKey("events.id"), primary_key=True),
)

# Operators' commands, queued by the API and carried out by the reconciler: to a run
# (run_number set) or to a node (node set, with the operator's reason).
commands = Table(
    "commands",
    metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("run_number", Integer, ForeignKey("runs.number")),
    Column("node", String(128)),
    Column("kind", String(16), nullable=False),
    Column("reason", Text, nullable=False, default=""),
    Column("created_at", Float, nullable=False),
    Column("handled_at", Float),
    Column("result", Text),
    Column("step", Integer),  # resume --from-step: the checkpoint step the run goes back to
)


# The supervisor's wishes for a node that the cluster must carry out: a drain (with its
# Reason) or a return to service. Recorded with the decision, sent, and sent again each
# tick until the cluster shows it (confirmed_at); one row per node, the newest wish.
node_intents = Table(
    "node_intents",
    metadata,
    Column("node", String(128), primary_key=True),
    Column("action", String(16), nullable=False),  # drain, undrain
    Column("reason", Text, nullable=False, default=""),
    Column("requested_at", Float, nullable=False),
    Column("sent", Integer, nullable=False, default=0),  # how many times it was sent
    Column("sent_at", Float),  # when last sent
    Column("last_error", Text),
    Column("confirmed_at", Float),
)

# Ranks reported straggling, one row per (run, attempt, rank): the policy leaves their
# nodes out of the next attempt.
stragglers = Table(
    "stragglers",
    metadata,
    Column("run_number", Integer, ForeignKey("runs.number"), primary_key=True),
    Column("attempt", Integer, primary_key=True),
    Column("rank", Integer, primary_key=True),
    Column("node", String(128), nullable=False),
    Column("busy_s", Float, nullable=False),
    Column("typical_s", Float, nullable=False),
    Column("window", Integer, nullable=False),
    Column("at", Float, nullable=False),
)

# Ranges of the data stream that every later attempt of the run steps over (a persistent
# loss spike, a NaN that recurred at one step): samples for the reference trainer, data
# steps for a [command] told {skip_to_step} (supervisor/policy/recovery.py).
data_skips = Table(
    "data_skips",
    metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("run_number", Integer, ForeignKey("runs.number"), nullable=False),
    Column("start", Integer, nullable=False),
    Column("end", Integer, nullable=False),
    Column("reason", Text, nullable=False),
    Column("at", Float, nullable=False),
    Index("data_skips_by_run", "run_number"),
)


# Per attempt, the sums the reads need, kept up to date as rank 0's steps are recorded:
# every API read, /metrics scrape and policy input costs O(attempts), never O(steps).
attempt_stats = Table(
    "attempt_stats",
    metadata,
    Column("run_number", Integer, ForeignKey("runs.number"), primary_key=True),
    Column("attempt", Integer, primary_key=True),
    Column("steps", Integer, nullable=False, default=0),  # rank 0's steps recorded
    Column("first_step", Integer),
    Column("last_step", Integer),
    Column("first_at", Float),  # when its first step was received
    Column("first_step_time_s", Float),  # that step's own time (startup = first_at - it - started_at)
    Column("last_at", Float),
    Column("step_time_s", Float, nullable=False, default=0.0),  # the sum over its steps
    Column("last_loss", Float),
    Column("last_grad_norm", Float),
    Column("checkpoints", Integer, nullable=False, default=0),
    Column("checkpoint_s", Float, nullable=False, default=0.0),  # blocking saves, summed
)

# The loss curve, downsampled as it grows: rank 0's n-th step is kept when n is a multiple
# of the run's stride (runs.curve_stride), which doubles (thinning what is kept) whenever
# more than CURVE_POINTS would be. Never pruned by retention.
loss_curve = Table(
    "loss_curve",
    metadata,
    Column("run_number", Integer, ForeignKey("runs.number"), primary_key=True),
    Column("seq", Integer, primary_key=True),  # rank 0's n-th step recorded in the run
    Column("attempt", Integer, nullable=False),
    Column("step", Integer, nullable=False),
    Column("loss", Float),
    Column("grad_norm", Float),
    Column("step_time_s", Float, nullable=False),
    Column("at", Float, nullable=False),
)
CURVE_POINTS = 1000


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


MIGRATIONS: list[Callable[[Connection], None]] = [_v1, _v2, _v3, _v4, _v5, _v6, _v7, _v8, _v9, _v10, _v11,
                                                  _v12, _v13, _v14]
SCHEMA_VERSION = len(MIGRATIONS)

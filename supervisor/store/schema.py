"""The SQLite schema: its tables, as the current version has them (their migrations:
supervisor/store/migrations.py).

The database records the supervisor's whole memory: a restarted daemon re-derives
everything from these tables plus the launcher.
"""

from __future__ import annotations

from sqlalchemy import (
    Boolean,
    Column,
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
    Column("output_offsets", Text),  # how far its logs were read (JSON {file name: offset})
    # When the launcher let go of it once it ended (its nodes' own processes, its records);
    # NULL on an ended attempt: a daemon died between recording the end and acting on it.
    Column("released_at", Float),
    Index("attempts_unreleased", "released_at", "state"),
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
    Column("link_gbps", Float),  # the node's best pair in the round's link test, GB/s
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

# How far each webhook of the daemon's [[notify]] has delivered the event log
# (supervisor/webhooks.py): the newest event id it sent or passed over.
notify_cursors = Table(
    "notify_cursors",
    metadata,
    Column("name", String(64), primary_key=True),
    Column("event_id", Integer, nullable=False),
)

# People's API tokens (supervisor/people.py): a token per person, bound to a Unix account,
# kept as its SHA-256 only (the token itself is in the person's own file).
people = Table(
    "people",
    metadata,
    Column("user", String(32), primary_key=True),
    Column("token_sha256", String(64), nullable=False, unique=True),
    Column("operator", Integer, nullable=False, default=0),  # acts on every run and node
    Column("issued_at", Float, nullable=False),
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

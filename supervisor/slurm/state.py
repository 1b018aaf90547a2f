"""What Slurm said last: its jobs, steps and nodes, polled off the reconciler's path.

The reconciler never waits for slurmctld. Started (``start``), a worker thread polls
``squeue --json`` (falling back to its text form), ``squeue --steps`` and the node
table (``NODE_QUERIES``: JSON where this Slurm prints it) every ``poll_interval_s``, each
with the command's own timeout, and keeps the last good answer of each. Readers get
that answer at once; a failed poll keeps the previous one ("status unknown", never "job
gone"), and ``answered_since`` says how fresh it is, so that while slurmctld hangs the
supervisor knows it, and decides nothing that needs Slurm.

Not started (tests, the CLIs), a read polls inline when its answer is older than
``poll_interval_s``. After an action that changes Slurm's state (sbatch, scancel,
scontrol update) ``refresh`` asks for a new poll at once.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

from supervisor.slurm import parse
from supervisor.slurm.commands import SlurmCommands

log = logging.getLogger(__name__)

T = TypeVar("T")

_POLLED = ("jobs", "steps", "nodes")  # what the worker polls each round (partitions: at submit only)

# How the node table is read, best first. A node's Reason may carry a trainer's words
# (a drain names the line that blamed the node), and only JSON keeps it apart from the
# node's name, address and state. 22.05 prints it with sinfo (its openapi plugin) and
# has no scontrol --json; 23.02 and later print it with scontrol. The text form is read
# where neither answers (parse.parse_nodes never reads a Reason as fields either).
NODE_QUERIES: tuple[tuple[tuple[str, ...], Callable[[str], dict[str, parse.NodeInfo]]], ...] = (
    (("sinfo", "--json", "--all"), parse.parse_nodes_json),
    (("scontrol", "--json", "show", "node"), lambda text: parse.parse_nodes_json(text, "scontrol --json")),
    (("scontrol", "-o", "show", "node"), parse.parse_nodes),
)


class SlurmState:
    def __init__(self, commands: SlurmCommands, *, poll_interval_s: float = 0.5,
                 clock: Callable[[], float] = time.time) -> None:
        self.commands = commands
        self.poll_interval_s = poll_interval_s
        self.clock = clock
        self._cache: dict[str, tuple[float, Any]] = {}  # key -> (when asked, answer)
        self._answered: dict[str, float] = {}  # key -> when the newest good answer was asked
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self.node_query: int | None = None  # NODE_QUERIES' first that answered: the one asked from then on

    # --- the worker ---------------------------------------------------------------------

    def start(self) -> None:
        """Poll on a worker thread from now on; reads never run a command again."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._poll_forever, name="slurm-poll", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        self._stopping.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=2 * self.commands.timeout_s)

    def _poll_forever(self) -> None:
        fetchers: dict[str, Callable[[], object]] = {
            "jobs": self._fetch_jobs, "steps": self._fetch_steps, "nodes": self._fetch_nodes}
        while not self._stopping.is_set():
            for key in _POLLED:
                self._poll(key, fetchers[key])
            self._wake.wait(self.poll_interval_s)
            self._wake.clear()

    def refresh(self) -> None:
        """Slurm's state was just changed: poll again at once."""
        if self._thread is not None:
            self._wake.set()
        else:
            with self._lock:
                self._cache.clear()

    def answered_since(self, t: float) -> bool:
        """Every poll has a good answer asked at or after ``t`` (wall clock). Not started,
        the polls older than that are made now."""
        if self._thread is None:
            fetchers: dict[str, Callable[[], object]] = {
                "jobs": self._fetch_jobs, "steps": self._fetch_steps, "nodes": self._fetch_nodes}
            for key in _POLLED:
                if self._answered.get(key, -1.0) < t:
                    self._poll(key, fetchers[key])
        with self._lock:
            return all(self._answered.get(key, -1.0) >= t for key in _POLLED)

    # --- reads --------------------------------------------------------------------------

    def _poll(self, key: str, fetch: Callable[[], T]) -> T | None:
        asked = self.clock()
        try:
            value = fetch()
        except parse.SlurmParseError as e:
            log.warning("Slurm poll %s: %s", key, e)
            return None
        with self._lock:
            self._cache[key] = (asked, value)
            self._answered[key] = asked
        return value

    def _read(self, key: str, fetch: Callable[[], T]) -> T | None:
        with self._lock:
            hit = self._cache.get(key)
        if self._thread is not None and key in _POLLED:
            return hit[1] if hit is not None else None
        if hit is not None and self.clock() - hit[0] < self.poll_interval_s:
            return hit[1]  # type: ignore[no-any-return]
        value = self._poll(key, fetch)
        if value is None and hit is not None:
            return hit[1]  # type: ignore[no-any-return]  # a failed poll: the last good answer stands
        return value

    def jobs(self) -> dict[str, parse.JobInfo] | None:
        return self._read("jobs", self._fetch_jobs)

    def steps(self) -> list[parse.StepInfo] | None:
        return self._read("steps", self._fetch_steps)

    def nodes(self) -> dict[str, parse.NodeInfo] | None:
        return self._read("nodes", self._fetch_nodes)

    def partitions(self) -> dict[str, parse.PartitionInfo] | None:
        return self._read("partitions", self._fetch_partitions)

    # --- the commands -------------------------------------------------------------------

    def _fetch_jobs(self) -> dict[str, parse.JobInfo]:
        reply = self.commands.run(["squeue", "--json"])
        if reply.ok:
            return parse.parse_squeue_json(reply.stdout)
        # Slurm without the openapi plugin (or before 21.08): the text form.
        frame = secrets.token_hex(8)  # a word no name can hold: see supervisor/slurm/parse.py
        reply = self.commands.run(["squeue", "-h", "-o", parse.framed(parse.SQUEUE_OWNED_FORMAT, frame)])
        if not reply.ok:
            raise parse.SlurmParseError(reply.describe())
        return parse.parse_squeue_text(reply.stdout, owners=True, frame=frame)

    def _fetch_steps(self) -> list[parse.StepInfo]:
        frame = secrets.token_hex(8)
        fmt = parse.framed(parse.STEPS_OWNED_FORMAT, frame)
        reply = self.commands.run(["squeue", "--steps", "-h", "-o", fmt])
        if not reply.ok:
            raise parse.SlurmParseError(reply.describe())
        return parse.parse_steps_text(reply.stdout, owners=True, frame=frame)

    def _fetch_nodes(self) -> dict[str, parse.NodeInfo]:
        """The first of NODE_QUERIES that answers; once one has, only that one (a failure
        then is Slurm's, not the form's: it is not asked again in another form)."""
        first = self.node_query
        tried = [first] if first is not None else range(len(NODE_QUERIES))
        failures = []
        for k in tried:
            argv, read = NODE_QUERIES[k]
            reply = self.commands.run(argv)
            try:
                if not reply.ok:
                    raise parse.SlurmParseError(reply.describe())
                nodes = read(reply.stdout)
            except parse.SlurmParseError as e:
                failures.append(str(e))
                continue
            self.node_query = k
            return nodes
        raise parse.SlurmParseError("; ".join(failures))

    def _fetch_partitions(self) -> dict[str, parse.PartitionInfo]:
        reply = self.commands.run(["scontrol", "-o", "show", "partition"])
        if not reply.ok:
            raise parse.SlurmParseError(reply.describe())
        return parse.parse_partitions(reply.stdout)

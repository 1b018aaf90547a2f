"""What a local attempt is made of, as its ``launch_info`` records it, and how its
processes are known again (supervisor/launchers/local.py).

A rank is a process known by its pid and start time (a pid alone may be reused), in a
process group of its node's; a node's own process likewise. A daemon that restarts
reads them back from ``launch_info`` (``load_ranks``, ``load_nodes``), or, for an
attempt it had not yet recorded, finds them by the attempt's marker (``TSUP_MARKER``).
A rank started from a warm standby carries the standby's environment, without the
marker: it is recorded in the attempt's ``warm-ranks.jsonl`` before it starts
(``note_warm``) and found there (``warm_ranks``). Only the run's user's processes are
the run's: anybody can set a marker.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import psutil

from supervisor import user_files, users
from supervisor.errors import CannotExecute
from supervisor.launchers.base import LaunchSpec

# psutil's create_time is a float rounded differently across calls on some kernels;
# two readings of one process agree to well within this.
CREATE_TIME_TOLERANCE_S = 0.05


@dataclass(frozen=True, slots=True)
class RankProcess:
    rank: int
    local_rank: int
    node: str
    pid: int
    pgid: int
    create_time: float


@dataclass(frozen=True, slots=True)
class NodeProcess:
    """A simulated node's own process: it lives as long as the node does."""

    node: str
    pid: int
    create_time: float


NODE_PROCESS_ENV = "TSUP_NODE_PROCESS"  # set in a node's own process: ``find`` tells it from a rank


def shared(r: RankProcess, ranks: Sequence[RankProcess]) -> bool:
    """The rank's process is its node's own launcher (launch "node"): other ranks share it."""
    return sum(x.pid == r.pid for x in ranks) > 1


def escaped_processes(launch_info: str, ranks: Sequence[RankProcess]) -> list[tuple[str, int]]:
    """(node, pid) of the attempt's processes outside its process groups: what a node's
    torchrun started in sessions of their own, found by the attempt's TSUP_MARKER."""
    marker = json.loads(launch_info).get("marker")
    if not marker:
        return []
    groups = {r.pgid for r in ranks}
    out: list[tuple[str, int]] = []
    for p in psutil.process_iter(["pid"]):
        try:
            env = p.environ()
            if (env.get("TSUP_MARKER") == marker and not env.get(NODE_PROCESS_ENV)
                    and os.getpgid(p.pid) not in groups):
                out.append((env.get("TSUP_NODE", ""), p.pid))
        except (psutil.Error, ProcessLookupError):
            continue
    return out


WARM_RANKS = "warm-ranks.jsonl"
WARM_RANKS_MAX_BYTES = 1 << 22  # a line per rank started warm: 64 bytes or so each


def note_warm(spec: LaunchSpec, r: RankProcess) -> None:
    """Record a rank started from a standby before it starts: its environment in /proc is
    the standby's, without the attempt's marker, so ``find`` looks here for it."""
    with os.fdopen(user_files.open_append(spec.log_base, spec.log_dir / WARM_RANKS), "a",
                   encoding="utf-8") as f:
        f.write(json.dumps(asdict(r)) + "\n")


def warm_ranks(spec: LaunchSpec) -> list[RankProcess]:
    """The attempt's ranks started from standbys that still live (by pid and start time),
    and run as the run's user: the file is in the user's directory, and the daemon signals
    what it names."""
    try:
        lines = user_files.read_text(spec.log_dir / WARM_RANKS, WARM_RANKS_MAX_BYTES,
                                     base=spec.log_base).splitlines()
    except OSError:
        return []
    out = []
    for line in lines:
        with contextlib.suppress(ValueError, TypeError):
            r = RankProcess(**json.loads(line))
            if (abs(start_time_of(r.pid) - r.create_time) <= CREATE_TIME_TOLERANCE_S
                    and uid_of(r.pid) == run_uid(spec)):
                out.append(r)
    return out


def run_uid(spec: LaunchSpec) -> int:
    """The uid the attempt's ranks run as."""
    try:
        run_as = users.for_launch(spec.user)
    except CannotExecute:
        return -1  # the user is gone: no process is its
    return run_as.uid if run_as is not None else os.geteuid()


def uid_of(pid: int) -> int | None:
    try:
        return int(psutil.Process(pid).uids().real)
    except psutil.Error:
        return None


def dump(ranks: Sequence[RankProcess], port: int, spec: LaunchSpec, nodes: Sequence[NodeProcess] = ()) -> str:
    return json.dumps({"master_port": port, "marker": spec.marker, "ranks": [asdict(r) for r in ranks],
                       "nodes": [asdict(n) for n in nodes], "memory_dir": spec.env.get("TSUP_MEMORY_DIR")})


def load_ranks(launch_info: str) -> list[RankProcess]:
    return [RankProcess(**r) for r in json.loads(launch_info)["ranks"]]


def load_nodes(launch_info: str) -> list[NodeProcess]:
    """The nodes' own processes (none in an attempt launched before they existed)."""
    return [NodeProcess(**n) for n in json.loads(launch_info).get("nodes", [])]


def start_time_of(pid: int) -> float:
    try:
        return float(psutil.Process(pid).create_time())
    except psutil.Error:
        return 0.0



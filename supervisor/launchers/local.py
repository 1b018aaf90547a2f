"""The local launcher: a run's "nodes" are groups of processes on this machine.

Each simulated node is one process group (its first rank leads it, the others join),
so a node dies as a unit with ``killpg``, as every process of a real node would. Ranks
get the torchrun environment (RANK, LOCAL_RANK, WORLD_SIZE, ...) and write their
output to one log file each.

The ranks do not depend on the supervisor: they run in their own process groups with
their output in files, so a SIGKILL of the daemon leaves them training. A restarted
daemon re-adopts them from the pids and start times in ``launch_info``; it can no
longer collect their exit codes (they are not its children), so it reports such a
rank as VANISHED and the policy reads the rank's own exit report from telemetry.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import signal
import socket
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass

import psutil

from supervisor import users
from supervisor.domain import ProcState
from supervisor.errors import CannotExecute, LaunchError, SpecError
from supervisor.launchers.base import AllocationRequest, Grant, LaunchSpec, RankProc

# psutil's create_time is a float rounded differently across calls on some kernels;
# two readings of one process agree to well within this.
_CREATE_TIME_TOLERANCE_S = 0.05


@dataclass(frozen=True, slots=True)
class _Rank:
    rank: int
    local_rank: int
    node: str
    pid: int
    pgid: int
    create_time: float


class LocalLauncher:
    kind = "local"

    def __init__(self, *, max_nodes: int = 64, node_prefix: str = "local") -> None:
        self.max_nodes = max_nodes
        self.node_prefix = node_prefix
        self._children: dict[int, subprocess.Popen[bytes]] = {}
        self._drained: set[str] = set()  # simulated nodes' own drain state (the executor confirms by it)

    # --- nodes ----------------------------------------------------------------------

    def check_resources(self, nodes: int, spares: int, partition: str | None) -> None:
        if partition is not None:
            raise SpecError("resources.partition: the local launcher has no partitions")
        if nodes + spares > self.max_nodes:
            raise SpecError(f"resources: {nodes} nodes + {spares} spares exceed the {self.max_nodes} nodes "
                            "this launcher can provide")

    def allocate(self, req: AllocationRequest) -> Grant:
        """Idle nodes first, then new ones, up to ``max_nodes`` in all."""
        count = req.count - len(req.held)
        names = list(req.idle[:count])
        created, k = 0, 0
        while len(names) < count and len(req.known) + created < self.max_nodes:
            k += 1
            name = f"{self.node_prefix}-{k}"
            if name not in req.known:
                names.append(name)
                created += 1
        short = len(names) < count
        return Grant(nodes=req.held + tuple(names), info=None,
                     note=f"at most {self.max_nodes} local nodes" if short else "")

    def answered_since(self, t: float) -> bool:
        return True  # this machine is the whole cluster, and always answers

    def held(self, run_id: str, info: str | None) -> Grant | None:
        return None  # the store's record is the whole truth for simulated nodes

    def release(self, run_id: str, info: str | None) -> bool:
        """Nothing to give back: the store marks the nodes idle."""
        return True

    def drain(self, node: str, reason: str) -> None:
        """Local nodes are simulated: a drain is the store's record, and this one."""
        self._drained.add(node)

    def undrain(self, node: str) -> None:
        self._drained.discard(node)

    def drained(self, node: str) -> bool | None:
        return node in self._drained

    def probe_drained(self, nodes: Mapping[str, str], argv: Sequence[str], *,
                      timeout_s: float) -> dict[str, str]:
        return self.probe(list(nodes), argv, allocation_info=None, timeout_s=timeout_s)

    def probe(self, nodes: Sequence[str], argv: Sequence[str], *, allocation_info: str | None,
              timeout_s: float) -> dict[str, str]:
        """One probe process per simulated node, told its node's name (TSUP_NODE)."""
        out: dict[str, str] = {}
        for node in nodes:
            env = {**os.environ, "TSUP_NODE": node}
            try:
                done = subprocess.run(list(argv), env=env, capture_output=True, text=True, timeout=timeout_s,
                                      check=False, stdin=subprocess.DEVNULL)
            except (OSError, subprocess.TimeoutExpired):
                continue
            out[node] = done.stdout
        return out

    # --- processes ------------------------------------------------------------------

    def start(self, spec: LaunchSpec) -> str:
        run_as = users.for_launch(spec.user)
        uid, gid, groups = users.popen_ids(run_as)
        spec.log_dir.mkdir(parents=True, exist_ok=True)
        world = len(spec.nodes) * spec.ranks_per_node
        port = _free_port()
        ranks: list[_Rank] = []
        try:
            for node_index, node in enumerate(spec.nodes):
                leader = 0  # the first rank of a node starts a new process group
                for local_rank in range(spec.ranks_per_node):
                    rank = node_index * spec.ranks_per_node + local_rank
                    env = {
                        **os.environ,
                        **users.login_env(run_as),
                        **spec.env,
                        "RANK": str(rank),
                        "LOCAL_RANK": str(local_rank),
                        "WORLD_SIZE": str(world),
                        "LOCAL_WORLD_SIZE": str(spec.ranks_per_node),
                        "GROUP_RANK": str(node_index),
                        "MASTER_ADDR": "127.0.0.1",
                        "MASTER_PORT": str(port),
                        "TSUP_NODE": node,
                        "TSUP_MARKER": spec.marker,
                    }
                    env.setdefault("OMP_NUM_THREADS", "1")
                    env.setdefault("PYTHONUNBUFFERED", "1")
                    log_path = spec.log_dir / f"rank-{rank:04d}.{node}.log"
                    with open(log_path, "ab") as log:
                        p = subprocess.Popen(
                            list(spec.argv), env=env, stdout=log, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL, process_group=leader, close_fds=True,
                            user=uid, group=gid, extra_groups=groups, cwd=spec.cwd,
                        )
                    self._children[p.pid] = p
                    if leader == 0:
                        leader = p.pid
                    ranks.append(_Rank(rank, local_rank, node, p.pid, leader, _create_time(p.pid)))
        except (OSError, ValueError) as e:
            for r in ranks:  # no half-started world: kill and reap what did start
                _signal_group(r.pgid, signal.SIGKILL)
                self._children.pop(r.pid).wait()
            # ValueError: what Popen says of an argument or a variable it cannot pass (a NUL
            # byte, a name with "="). Neither that nor a missing or unexecutable program
            # gets better with a retry.
            cannot = isinstance(e, ValueError) or e.errno in (errno.ENOENT, errno.EACCES, errno.ENOEXEC,
                                                              errno.ENOTDIR)
            raise (CannotExecute if cannot else LaunchError)(f"cannot start {spec.argv[0]!r}: {e}") from e
        return _dump(ranks, port)

    def find(self, spec: LaunchSpec) -> str | None:
        found: list[_Rank] = []
        for p in psutil.process_iter(["pid", "cmdline", "create_time"]):
            try:
                cmdline = p.info["cmdline"] or []
                if spec.marker not in cmdline and not any(spec.marker in a for a in cmdline):
                    env = p.environ()  # a [command] trainer's argv does not name the marker
                    if env.get("TSUP_MARKER") != spec.marker:
                        continue
                else:
                    env = p.environ()
                found.append(
                    _Rank(int(env["RANK"]), int(env["LOCAL_RANK"]), env["TSUP_NODE"], p.pid,
                          os.getpgid(p.pid), float(p.info["create_time"]))
                )
            except (psutil.Error, KeyError, ValueError, ProcessLookupError):
                continue
        if not found:
            return None
        return _dump(sorted(found, key=lambda r: r.rank), port=0)

    def observe(self, launch_info: str) -> list[RankProc]:
        out = []
        for r in _load(launch_info):
            state, code = self._state(r)
            out.append(RankProc(rank=r.rank, node=r.node, proc=state, exit_code=code))
        return out

    def _state(self, r: _Rank) -> tuple[ProcState, int | None]:
        child = self._children.get(r.pid)
        if child is not None:
            code = child.poll()
            return (ProcState.RUNNING, None) if code is None else (ProcState.EXITED, code)
        try:
            p = psutil.Process(r.pid)
            if abs(p.create_time() - r.create_time) > _CREATE_TIME_TOLERANCE_S:
                return ProcState.VANISHED, None  # the pid was reused
            if p.status() == psutil.STATUS_ZOMBIE:
                return ProcState.VANISHED, None
            return ProcState.RUNNING, None
        except psutil.NoSuchProcess:
            return ProcState.VANISHED, None
        except psutil.Error:
            return ProcState.UNKNOWN, None

    def stop(self, launch_info: str, *, force: bool) -> None:
        sig = signal.SIGKILL if force else signal.SIGTERM
        for pgid in self._live_groups(_load(launch_info)):
            _signal_group(pgid, sig)

    def kill_rank(self, launch_info: str, rank: int, sig: int = signal.SIGKILL) -> str:
        for r in _load(launch_info):
            if r.rank == rank and self._alive(r):
                os.kill(r.pid, sig)
                return f"{signal.Signals(sig).name} to rank {rank} (pid {r.pid}, node {r.node})"
        raise LaunchError(f"rank {rank} is not running")

    def kill_node(self, launch_info: str, node: str) -> str:
        members = [r for r in _load(launch_info) if r.node == node]
        groups = self._live_groups(members)
        if not groups:
            raise LaunchError(f"node {node} has no running process")
        for pgid in groups:
            _signal_group(pgid, signal.SIGKILL)
        return f"SIGKILL to every process of node {node} (process group {', '.join(map(str, groups))})"

    def freeze_node(self, launch_info: str, node: str) -> str:
        groups = self._live_groups([r for r in _load(launch_info) if r.node == node])
        if not groups:
            raise LaunchError(f"node {node} has no running process")
        for pgid in groups:
            _signal_group(pgid, signal.SIGSTOP)
        return f"SIGSTOP to every process of node {node} (process group {', '.join(map(str, groups))})"

    def partition_node(self, node: str, cut: bool) -> str:
        raise LaunchError("partition-node: local nodes share this host's loopback, which cannot be cut; "
                          "use the Slurm box (scripts/slurm-box), whose nodes have links of their own")

    def _alive(self, r: _Rank) -> bool:
        return self._state(r)[0] is ProcState.RUNNING

    def _live_groups(self, ranks: Sequence[_Rank]) -> list[int]:
        """Process groups that may still hold one of our ranks (running, or not
        observable this time): never signal a group whose members are all known to be
        gone, since its id may since belong to someone else."""
        groups: list[int] = []
        for r in ranks:
            if r.pgid not in groups and self._state(r)[0] in (ProcState.RUNNING, ProcState.UNKNOWN):
                groups.append(r.pgid)
        return groups

    def forget(self, launch_info: str) -> None:
        """Drop the exit codes of an ended attempt's children."""
        for r in _load(launch_info):
            p = self._children.get(r.pid)
            if p is not None and p.poll() is not None:
                del self._children[r.pid]


def _dump(ranks: Sequence[_Rank], port: int) -> str:
    return json.dumps({"master_port": port, "ranks": [asdict(r) for r in ranks]})


def _load(launch_info: str) -> list[_Rank]:
    return [_Rank(**r) for r in json.loads(launch_info)["ranks"]]


def _create_time(pid: int) -> float:
    try:
        return float(psutil.Process(pid).create_time())
    except psutil.Error:
        return 0.0


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, sig)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])

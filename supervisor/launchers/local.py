"""The local launcher: a run's "nodes" are groups of processes on this machine.

Each simulated node is one process group, so a node dies as a unit with ``killpg``, as
every process of a real node would. The group's leader is the node's own process: its
node agent (``python -m node.agent``, node/agent.py) where the attempt has
telemetry, else a ``sleep`` standing for what a real node runs besides the trainer. A
node whose own process died with its ranks is a lost node, one whose own process lives
on lost only its ranks (supervisor/policy/attribution.py). The agent's output goes to
``agent.<node>.log``. Ranks get the
torchrun environment (RANK, LOCAL_RANK, WORLD_SIZE, ...) and write their output to one
log file each. With ``launch = "node"`` each node runs one process (the
user's torchrun), given the node's part of that environment (GROUP_RANK, MASTER_ADDR,
...), and its output goes to ``node-<index>.<node>.log``.

The ranks do not depend on the supervisor: they run in their own process groups with
their output in files, so a SIGKILL of the daemon leaves them training. A restarted
daemon re-adopts them from the pids and start times in ``launch_info``; it can no
longer collect their exit codes (they are not its children), so it reports such a
rank as VANISHED and the policy reads the rank's own exit report from telemetry. What
``launch_info`` records, and how the processes are found again, is local_record.py's.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import psutil

from health.host import SHARED_HOST_ENV
from health.links import PairResult
from supervisor import user_files, users
from supervisor.domain import ProcState
from supervisor.domain.step import Step, rdzv_id
from supervisor.errors import CannotExecute, LaunchError, SpecError
from supervisor.launchers.base import AllocationRequest, Grant, LaunchSpec, Parked, RankProc
from supervisor.launchers.local_record import (
    CREATE_TIME_TOLERANCE_S,
    NODE_PROCESS_ENV,
    NodeProcess,
    RankProcess,
    dump,
    escaped_processes,
    load_nodes,
    load_ranks,
    note_warm,
    run_uid,
    shared,
    start_time_of,
    warm_ranks,
)
from supervisor.launchers.standby import StandbyPool, assignment_for
from supervisor.link_steps import LinkTest
from supervisor.ports import free_port
from wire import NODE_AGENT_ENV

NODE_PROCESS_GRACE_S = 2.0  # a node's own process ends within this of SIGTERM, or is killed
AGENT_INDEX_ENV = "TSUP_NODE_INDEX"  # the node's index in the attempt, for its agent (node/agent.py)


class LocalLauncher:
    kind = "local"

    def __init__(self, *, max_nodes: int = 64, node_prefix: str = "local") -> None:
        self.max_nodes = max_nodes
        self.node_prefix = node_prefix
        self._children: dict[int, subprocess.Popen[bytes]] = {}  # ranks, and nodes' own processes
        self._drained: set[str] = set()  # simulated nodes' own drain state (the executor confirms by it)
        self.standbys = StandbyPool()

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

    def job_of(self, info: str | None) -> str | None:
        return None  # simulated nodes are in no job

    def answered_since(self, t: float) -> bool:
        return True  # this machine is the whole cluster, and always answers

    def held(self, run_id: str, info: str | None) -> Grant | None:
        return None  # the store's record is the whole truth for simulated nodes

    def release(self, run_id: str, info: str | None) -> bool:
        """Nothing to give back (the store marks the nodes idle) but the run's standbys."""
        self.standbys.release(run_id)
        return True

    def park(self, run_id: str, info: str | None, user: str | None) -> Parked:
        """Local nodes carry no allocation a trainer could know: given back."""
        return Parked(done=self.release(run_id, info))

    def drain(self, node: str, reason: str, *, reboot: bool = False) -> None:
        """Local nodes are simulated: a drain is the store's record, and this one."""
        self._drained.add(node)

    def repaired(self, node: str) -> bool:
        return False  # nothing repairs a simulated node but an operator

    def undrain(self, node: str) -> None:
        self._drained.discard(node)

    def drained(self, node: str) -> bool | None:
        return node in self._drained

    def probe_drained(self, nodes: Mapping[str, str], argv: Sequence[str], *,
                      timeout_s: float) -> dict[str, str]:
        return self.probe(list(nodes), argv, allocation_info=None, timeout_s=timeout_s)

    def probe_links(self, test: LinkTest, *, allocation_info: str | None,
                    timeout_s: float) -> list[PairResult]:
        return []  # its nodes share this host's loopback: no link between them to measure

    def probe(self, nodes: Sequence[str], argv: Sequence[str], *, allocation_info: str | None,
              timeout_s: float) -> dict[str, str]:
        """One probe process per simulated node, told its node's name (TSUP_NODE) and that
        it shares this host with the others (health/host.py: their load and trainers are
        not its own)."""
        out: dict[str, str] = {}
        for node in nodes:
            env = {**users.inherited_env(), "TSUP_NODE": node, SHARED_HOST_ENV: "1"}
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
        if spec.trusted_dir is None:
            spec.log_dir.mkdir(parents=True, exist_ok=True)
        with user_files.directory(spec.log_base, spec.log_dir, create=True):
            pass  # made, or found, without following a link below the daemon's own directory
        step = Step(nnodes=len(spec.nodes), nproc_per_node=spec.ranks_per_node, master_addr="127.0.0.1",
                    master_port=free_port(), rdzv_id=rdzv_id(spec.run_id, spec.attempt))
        argv = list(step.fill_all(spec.argv))
        base_env = {**users.inherited_env(), **users.login_env(run_as),
                    **{k: step.fill(v) for k, v in spec.env.items()}}
        if base_env.get("TSUP_MQTT_URL"):
            base_env[NODE_AGENT_ENV] = "1"  # each node's agent reports its slots (node/agent.py)
        ranks: list[RankProcess] = []
        nodes: list[NodeProcess] = []
        try:
            for node_index, node in enumerate(spec.nodes):
                node_env = {**base_env, "MASTER_PORT": str(step.master_port)}
                own = self._start_node_process(spec, node, node_index, node_env, uid, gid, groups)
                nodes.append(own)
                leader = own.pid  # the node's process leads its group: the ranks started cold join it
                for task in _tasks(spec, step, node_index):
                    env = {**base_env, **task.env, "TSUP_NODE": node, "TSUP_MARKER": spec.marker}
                    env.setdefault("OMP_NUM_THREADS", "1")
                    env.setdefault("PYTHONUNBUFFERED", "1")
                    log_path = spec.log_dir / f"{task.log_name}.{node}.log"
                    local_rank = task.ranks[0] - node_index * spec.ranks_per_node
                    warm = self._warm_start(spec, node, local_rank, env, argv, log_path, uid, gid)
                    if warm is not None:
                        ranks += [RankProcess(rank, rank % spec.ranks_per_node, node, warm.pid, warm.pid,
                                        start_time_of(warm.pid)) for rank in task.ranks]
                        note_warm(spec, ranks[-1])
                        continue
                    with os.fdopen(user_files.open_append(spec.log_base, log_path), "ab") as log:
                        p = subprocess.Popen(
                            argv, env=env, stdout=log, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL, process_group=leader, close_fds=True,
                            user=uid, group=gid, extra_groups=groups, cwd=spec.cwd,
                        )
                    self._children[p.pid] = p
                    created = start_time_of(p.pid)
                    ranks += [RankProcess(rank, rank % spec.ranks_per_node, node, p.pid, leader, created)
                              for rank in task.ranks]
        except (OSError, ValueError) as e:
            for pid, pgid in {(r.pid, r.pgid) for r in ranks}:  # no half-started world: kill and reap
                _signal_group(pgid, signal.SIGKILL)
                self._children.pop(pid).wait()
            self._end_node_processes(nodes)
            # ValueError: what Popen says of an argument or a variable it cannot pass (a NUL
            # byte, a name with "="). Neither that nor a missing or unexecutable program
            # gets better with a retry, nor does a link or special file the run's user planted
            # where a log goes.
            cannot = isinstance(e, (ValueError, user_files.UnsafePath)) or e.errno in (
                errno.ENOENT, errno.EACCES, errno.ENOEXEC, errno.ENOTDIR)
            raise (CannotExecute if cannot else LaunchError)(f"cannot start {spec.argv[0]!r}: {e}") from e
        self.standbys.plan(spec)
        return dump(ranks, int(step.master_port), spec, nodes)

    def _start_node_process(self, spec: LaunchSpec, node: str, index: int, env: dict[str, str],
                            uid: int | None, gid: int | None, groups: list[int] | None) -> NodeProcess:
        """The node's own process, leading a new process group (see the module docstring)."""
        own_env = {**env, "TSUP_NODE": node, "TSUP_MARKER": spec.marker, NODE_PROCESS_ENV: "1",
                   AGENT_INDEX_ENV: str(index)}
        if env.get(NODE_AGENT_ENV) == "1":
            argv = [sys.executable, "-m", "node.agent"]
            out = os.fdopen(user_files.open_append(spec.log_base, spec.log_dir / f"agent.{node}.log"), "ab")
        else:
            argv = [shutil.which("sleep") or "/bin/sleep", "infinity"]
            out = open(os.devnull, "wb")  # noqa: SIM115 (closed below, once the child has it)
        with out:
            p = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                 process_group=0, close_fds=True, user=uid, group=gid, extra_groups=groups,
                                 env=own_env, cwd="/")
        self._children[p.pid] = p
        return NodeProcess(node=node, pid=p.pid, create_time=start_time_of(p.pid))

    def _end_node_processes(self, nodes: Sequence[NodeProcess]) -> None:
        """End the nodes' own processes (those still ours: not a reused pid) and reap them:
        SIGTERM first, so that an agent says goodbye (no last will: its attempt ended, its
        node did not), then SIGKILL to any still there after NODE_PROCESS_GRACE_S."""
        alive = [n for n in nodes if self._running(n.pid, n.create_time)]
        for n in alive:
            with contextlib.suppress(ProcessLookupError):
                os.kill(n.pid, signal.SIGTERM)
        deadline = time.monotonic() + NODE_PROCESS_GRACE_S
        for n in nodes:
            child = self._children.pop(n.pid, None)
            if child is not None:
                try:
                    child.wait(max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    child.kill()
                    child.wait()
            elif n in alive:  # adopted (a restarted daemon's): not ours to wait for, so watched
                while self._running(n.pid, n.create_time) and time.monotonic() < deadline:
                    time.sleep(0.05)
                if self._running(n.pid, n.create_time):
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(n.pid, signal.SIGKILL)

    def _warm_start(self, spec: LaunchSpec, node: str, local_rank: int, env: dict[str, str], argv: list[str],
                    log_path: Path, uid: int | None, gid: int | None) -> subprocess.Popen[bytes] | None:
        """A standby of the run waiting on ``node``, assigned this rank (None: start cold)."""
        if not spec.standby_nodes or spec.launch != "rank":
            return None
        while (proc := self.standbys.take(spec.run_id, node, local_rank)) is not None:
            try:
                fd = user_files.open_append(spec.log_base, log_path)  # never a link the user planted
                try:
                    if uid is not None:
                        os.fchown(fd, uid, -1 if gid is None else gid)
                finally:
                    os.close(fd)
                inherited = users.inherited_env()  # what it was started with (standby.py): it has those
                sent = {k: v for k, v in env.items() if inherited.get(k) != v}
                StandbyPool.assign(proc, assignment_for(spec, sent, log_path, argv))
            except OSError:
                continue  # it died while waiting: the next one, or cold
            self._children[proc.pid] = proc
            return proc
        return None

    def find(self, spec: LaunchSpec) -> str | None:
        """The attempt's processes, by TSUP_MARKER: the topmost of each tree only (a rank's
        own children, such as data loader workers or a node's torchrun workers, inherit
        the marker)."""
        marked: dict[int, tuple[dict[str, str], float, int]] = {}  # pid -> (env, create time, parent)
        uid = run_uid(spec)  # anybody can set a marker; only the run's user's processes are its
        for p in psutil.process_iter(["pid", "ppid", "create_time", "uids"]):
            try:
                if p.info["uids"] is None or p.info["uids"].real != uid:
                    continue
                env = p.environ()
                if env.get("TSUP_MARKER") == spec.marker:
                    marked[p.pid] = (env, float(p.info["create_time"]), int(p.info["ppid"]))
            except (psutil.Error, ValueError):
                continue
        found: list[RankProcess] = []
        nodes: list[NodeProcess] = []
        for pid, (env, created, parent) in marked.items():
            if parent in marked:
                continue
            if env.get(NODE_PROCESS_ENV):
                nodes.append(NodeProcess(node=env.get("TSUP_NODE", ""), pid=pid, create_time=created))
                continue
            try:
                node, pgid = env["TSUP_NODE"], os.getpgid(pid)
                if spec.launch == "node":
                    first = int(env["GROUP_RANK"]) * spec.ranks_per_node
                    found += [RankProcess(r, r - first, node, pid, pgid, created)
                              for r in range(first, first + spec.ranks_per_node)]
                else:
                    rank, local_rank = int(env["RANK"]), int(env["LOCAL_RANK"])
                    found.append(RankProcess(rank, local_rank, node, pid, pgid, created))
            except (KeyError, ValueError, ProcessLookupError):
                continue
        found += [r for r in warm_ranks(spec) if r.rank not in {f.rank for f in found}]
        if not found:
            self._end_node_processes(nodes)  # a start that got no further than its nodes' own processes
            return None
        return dump(sorted(found, key=lambda r: r.rank), port=0, spec=spec, nodes=nodes)

    def observe(self, launch_info: str) -> list[RankProc]:
        self.standbys.refill()
        ranks = load_ranks(launch_info)
        states = {r.rank: self._state(r) for r in ranks}
        # A node's own torchrun starts its workers in sessions of their own: once it is gone
        # (killed), its workers may live on. The node's ranks run until they are gone too.
        ended = {r.node for r in ranks if states[r.rank][0] is not ProcState.RUNNING and shared(r, ranks)}
        if ended:
            living = {node for node, _ in escaped_processes(launch_info, ranks)}
            for r in ranks:
                if r.node in ended & living:
                    states[r.rank] = (ProcState.RUNNING, None)
        node_up = {n.node: self._running(n.pid, n.create_time) for n in load_nodes(launch_info)}
        return [RankProc(rank=r.rank, node=r.node, proc=states[r.rank][0], exit_code=states[r.rank][1],
                         process=r.pid, node_up=node_up.get(r.node)) for r in ranks]

    def _state(self, r: RankProcess) -> tuple[ProcState, int | None]:
        return self._process_state(r.pid, r.create_time)

    def _process_state(self, pid: int, create_time: float) -> tuple[ProcState, int | None]:
        child = self._children.get(pid)
        if child is not None:
            code = child.poll()
            return (ProcState.RUNNING, None) if code is None else (ProcState.EXITED, code)
        try:
            p = psutil.Process(pid)
            if abs(p.create_time() - create_time) > CREATE_TIME_TOLERANCE_S:
                return ProcState.VANISHED, None  # the pid was reused
            if p.status() == psutil.STATUS_ZOMBIE:
                return ProcState.VANISHED, None
            return ProcState.RUNNING, None
        except psutil.NoSuchProcess:
            return ProcState.VANISHED, None
        except psutil.Error:
            return ProcState.UNKNOWN, None

    def _running(self, pid: int, create_time: float) -> bool | None:
        """Whether the process lives (None: it cannot be told)."""
        state, _ = self._process_state(pid, create_time)
        return None if state is ProcState.UNKNOWN else state is ProcState.RUNNING

    def stop(self, launch_info: str, *, force: bool) -> None:
        """SIGTERM the attempt's ranks; with ``force`` SIGKILL everything of it, the nodes'
        own processes too."""
        sig = signal.SIGKILL if force else signal.SIGTERM
        ranks = load_ranks(launch_info)
        spread = force or any(shared(r, ranks) for r in ranks)  # a node's torchrun may have escaped its group
        escaped = escaped_processes(launch_info, ranks) if spread else []
        for pgid in self._live_groups(ranks):
            _signal_group(pgid, sig)
        for _, pid in escaped:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        if force:
            self._end_node_processes(load_nodes(launch_info))

    def kill_rank(self, launch_info: str, rank: int, sig: int = signal.SIGKILL) -> str:
        ranks = load_ranks(launch_info)
        for r in ranks:
            if r.rank == rank and self._alive(r):
                # One process per node (launch "node"): the rank is one of its workers.
                pid = _worker_of(r.pid, rank) if shared(r, ranks) else r.pid
                os.kill(pid, sig)
                return f"{signal.Signals(sig).name} to rank {rank} (pid {pid}, node {r.node})"
        raise LaunchError(f"rank {rank} is not running")

    def kill_node(self, launch_info: str, node: str) -> str:
        """SIGKILL to every process of the node; and, as a real node's loss would, the
        node's memory is gone: its part of the reference trainer's memory tier
        (trainer/memory_tier.py) is deleted."""
        done = self._signal_node(launch_info, node, signal.SIGKILL)
        memory = json.loads(launch_info).get("memory_dir")
        if memory and (Path(memory) / node).exists():
            shutil.rmtree(Path(memory) / node, ignore_errors=True)
            done += f"; its memory ({Path(memory) / node}) is gone"
        return done

    def freeze_node(self, launch_info: str, node: str) -> str:
        return self._signal_node(launch_info, node, signal.SIGSTOP)

    def _signal_node(self, launch_info: str, node: str, sig: signal.Signals) -> str:
        """``sig`` to every process of the node: its group, and what left it (workers)."""
        ranks = load_ranks(launch_info)
        groups = self._live_groups([r for r in ranks if r.node == node])
        for own in load_nodes(launch_info):  # its own process's group, when no rank joined it (warm ranks)
            if own.node == node and own.pid not in groups and self._running(own.pid, own.create_time):
                groups.append(own.pid)
        if not groups:
            raise LaunchError(f"node {node} has no running process")
        escaped = [pid for n, pid in escaped_processes(launch_info, ranks) if n == node]
        named = ", ".join(map(str, groups))
        for pgid in groups:
            _signal_group(pgid, sig)
        for pid in escaped:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        standbys = self.standbys.signal_node(node, sig)  # the node's standbys go with it
        also = f" and {len(escaped)} process(es) of their own sessions" if escaped else ""
        also += f", and its {standbys} standby process(es)" if standbys else ""
        return f"{sig.name} to every process of node {node} (process group {named}{also})"

    def partition_node(self, node: str, cut: bool) -> str:
        raise LaunchError("partition-node: local nodes share this host's loopback, which cannot be cut; "
                          "use the Slurm box (scripts/slurm-box), whose nodes have links of their own")

    def throttle_node(self, node: str, slow: bool) -> str:
        raise LaunchError("slow-link: local nodes share this host's loopback, which has no link to slow; "
                          "use the Slurm box (scripts/slurm-box), whose nodes have links of their own")

    def _alive(self, r: RankProcess) -> bool:
        return self._state(r)[0] is ProcState.RUNNING

    def _live_groups(self, ranks: Sequence[RankProcess]) -> list[int]:
        """Process groups that may still hold one of our ranks (running, or not
        observable this time): never signal a group whose members are all known to be
        gone, since its id may since belong to someone else."""
        groups: list[int] = []
        for r in ranks:
            if r.pgid not in groups and self._state(r)[0] in (ProcState.RUNNING, ProcState.UNKNOWN):
                groups.append(r.pgid)
        return groups

    def forget(self, launch_info: str) -> None:
        """The attempt has ended: its nodes' own processes go, and the exit codes of its
        children are dropped."""
        self._end_node_processes(load_nodes(launch_info))
        for r in load_ranks(launch_info):
            p = self._children.get(r.pid)
            if p is not None and p.poll() is not None:
                del self._children[r.pid]


@dataclass(frozen=True, slots=True)
class _Task:
    """One process of a node: a rank, or with launch "node" the node's own launcher."""

    ranks: range  # the ranks it is, or spawns
    env: dict[str, str]
    log_name: str


def _tasks(spec: LaunchSpec, step: Step, node_index: int) -> list[_Task]:
    """The processes to start on one node, with the variables torchrun would give them
    (per rank) or a node's torchrun reads (per node)."""
    first = node_index * spec.ranks_per_node
    node_env = {"GROUP_RANK": str(node_index), "NODE_RANK": str(node_index),
                "WORLD_SIZE": str(step.world_size), "LOCAL_WORLD_SIZE": str(spec.ranks_per_node),
                "MASTER_ADDR": step.master_addr, "MASTER_PORT": str(step.master_port)}
    if spec.launch == "node":
        return [_Task(range(first, first + spec.ranks_per_node), node_env, f"node-{node_index:04d}")]
    return [_Task(range(rank, rank + 1), {**node_env, "RANK": str(rank), "LOCAL_RANK": str(rank - first)},
                  f"rank-{rank:04d}")
            for rank in range(first, first + spec.ranks_per_node)]


def _worker_of(parent: int, rank: int) -> int:
    """The process of ``rank`` under a node's launcher (torchrun sets RANK in its workers)."""
    try:
        for child in psutil.Process(parent).children(recursive=True):
            with contextlib.suppress(psutil.Error):
                if child.environ().get("RANK") == str(rank):
                    return int(child.pid)
    except psutil.Error:
        pass
    raise LaunchError(f"rank {rank}: no process under its node's launcher (pid {parent}) has RANK={rank}")


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, sig)

"""A scripted cluster for the reconciler's tests: processes that exist only as far as the
test says, with nothing behind them.

It implements the launching, node administration and chaos ports, and runs through the
same contract suite as the real adapters (tests/contract/test_launcher_contract.py), so
that what the reconciler's tests learn with it holds of the local launcher and Slurm.
Its state lives in a ``FakeCluster``, shared by every launcher made on it (``fresh``: a
restarted daemon's launcher sees what the first one started).
"""

from __future__ import annotations

import json
import signal
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from health.links import PairResult
from supervisor.domain import ProcState
from supervisor.errors import LaunchError
from supervisor.launchers.base import AllocationRequest, Grant, LaunchSpec, Parked, RankProc
from supervisor.launchers.local import LocalLauncher
from supervisor.link_steps import LinkTest


@dataclass
class FakeCluster:
    procs: dict[str, dict[int, tuple[ProcState, int | None]]] = field(default_factory=dict)  # info -> rank -> state
    markers: dict[str, str] = field(default_factory=dict)  # marker -> launch_info
    drained: set[str] = field(default_factory=set)  # what the cluster shows drained
    dead: set[str] = field(default_factory=set)  # nodes killed (kill_node): their own processes are gone


class ScriptedLauncher:
    """The cluster a test scripts: ``procs`` says what each rank is doing; a rank given
    ``EXIT_<rank>`` in its environment exits with that code at once (as the contract
    suite's program does); ``refuse`` lists nodes it will not drain."""

    kind = "local"

    def __init__(self, cluster: FakeCluster | None = None) -> None:
        self.cluster = cluster or FakeCluster()
        self.procs = self.cluster.procs
        self.started: list[LaunchSpec] = []
        self.stops: list[tuple[str, bool]] = []
        self.drains: list[tuple[str, str]] = []
        self.undrains: list[str] = []
        self.refuse: set[str] = set()
        self.forgotten: list[str] = []

    def fresh(self) -> ScriptedLauncher:
        """Another launcher on the same cluster: a restarted daemon's."""
        return ScriptedLauncher(self.cluster)

    @property
    def drained_now(self) -> set[str]:
        return self.cluster.drained

    def vanish(self, launch_info: str) -> None:
        """The processes of a launch never existed (a daemon that died before starting them)."""
        self.procs.pop(launch_info, None)
        self.cluster.markers = {m: i for m, i in self.cluster.markers.items() if i != launch_info}

    # --- launching ------------------------------------------------------------------

    def check_resources(self, nodes: int, spares: int, partition: str | None) -> None:
        LocalLauncher(max_nodes=8).check_resources(nodes, spares, partition)

    def job_of(self, info: str | None) -> str | None:
        return None

    def answered_since(self, t: float) -> bool:
        return True

    def allocate(self, req: AllocationRequest) -> Grant:
        names = list(req.idle[: req.count - len(req.held)])
        k = len(req.known)
        while len(req.held) + len(names) < req.count:
            k += 1
            names.append(f"node-{k}")
        return Grant(nodes=req.held + tuple(names), info=None)

    def held(self, run_id: str, info: str | None) -> Grant | None:
        return None

    def release(self, run_id: str, info: str | None) -> bool:
        return True

    def park(self, run_id: str, info: str | None, user: str | None) -> Parked:
        return Parked(done=True)

    def start(self, spec: LaunchSpec) -> str:
        self.started.append(spec)
        info = json.dumps({"attempt": spec.attempt, "nodes": list(spec.nodes), "rpn": spec.ranks_per_node})
        world = len(spec.nodes) * spec.ranks_per_node
        self.procs[info] = {r: (ProcState.EXITED, int(spec.env[f"EXIT_{r}"])) if f"EXIT_{r}" in spec.env
                            else (ProcState.RUNNING, None) for r in range(world)}
        self.cluster.markers[spec.marker] = info
        return info

    def find(self, spec: LaunchSpec) -> str | None:
        info = self.cluster.markers.get(spec.marker)
        alive = info is not None and any(s is ProcState.RUNNING for s, _ in self.procs.get(info, {}).values())
        return info if alive else None

    def observe(self, launch_info: str) -> list[RankProc]:
        d = json.loads(launch_info)
        node_of = {r: d["nodes"][r // d["rpn"]] for r in self.procs.get(launch_info, {})}
        return [RankProc(rank=r, node=node_of[r], proc=s, exit_code=c, node_up=node_of[r] not in self.cluster.dead)
                for r, (s, c) in sorted(self.procs.get(launch_info, {}).items())]

    def stop(self, launch_info: str, *, force: bool) -> None:
        self.stops.append((launch_info, force))
        code = -signal.SIGKILL if force else -signal.SIGTERM
        self.procs[launch_info] = {r: (ProcState.EXITED, c if s is ProcState.EXITED else code)
                                   for r, (s, c) in self.procs.get(launch_info, {}).items()}

    def forget(self, launch_info: str) -> None:
        self.forgotten.append(launch_info)

    # --- node administration ----------------------------------------------------------

    def drain(self, node: str, reason: str, *, reboot: bool = False) -> None:
        if node in self.refuse:
            raise LaunchError(f"cannot drain {node}: scontrol: Invalid node name specified")
        self.drains.append((node, reason))
        self.cluster.drained.add(node)

    def undrain(self, node: str) -> None:
        self.undrains.append(node)
        self.cluster.drained.discard(node)

    def drained(self, node: str) -> bool | None:
        return node in self.cluster.drained

    def repaired(self, node: str) -> bool:
        return False

    def probe(self, nodes: Sequence[str], argv: Sequence[str], *, allocation_info: str | None,
              timeout_s: float) -> dict[str, str]:
        raise NotImplementedError

    def probe_drained(self, nodes: Mapping[str, str], argv: Sequence[str], *, timeout_s: float) -> dict[str, str]:
        raise NotImplementedError

    def probe_links(self, test: LinkTest, *, allocation_info: str | None,
                    timeout_s: float) -> list[PairResult]:
        raise NotImplementedError

    # --- chaos ----------------------------------------------------------------------

    def kill_rank(self, launch_info: str, rank: int, sig: int = signal.SIGKILL) -> str:
        self.procs[launch_info][rank] = (ProcState.EXITED, -sig)
        return f"rank {rank}"

    def kill_node(self, launch_info: str, node: str) -> str:
        victims = [r.rank for r in self.observe(launch_info) if r.node == node and r.proc is ProcState.RUNNING]
        if not victims:
            raise LaunchError(f"node {node} has no running process")
        for r in victims:
            self.procs[launch_info][r] = (ProcState.EXITED, -signal.SIGKILL)
        self.cluster.dead.add(node)
        return f"SIGKILL to node {node}"

    def freeze_node(self, launch_info: str, node: str) -> str:
        raise LaunchError("a scripted node cannot be frozen: its ranks send no telemetry anyway")

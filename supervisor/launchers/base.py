"""The ports to a cluster: launching, node administration, and chaos hooks.

- ``Launcher``: holds a run's nodes and starts, watches and stops an attempt's processes;
- ``NodeAdmin``: drains and returns nodes, and runs probes on them;
- ``ChaosHooks``: real signals to real processes, for drills and tests (``--chaos``).

An adapter owns one kind of cluster (local process groups: launchers/local.py; Slurm:
supervisor/slurm/) and may implement several ports. Every method is called from the
reconciler's tick (off the event loop) and must return quickly: reads come from what
the adapter last learnt, never from a command that may hang. None may treat a failed
observation as a dead process (it reports ProcState.UNKNOWN instead).

``launch_info`` is the launcher's own handle for a started attempt, serialized as a
string so that the store can keep it and a restarted daemon can re-adopt the attempt.
``allocation_info`` is the same for the nodes a run holds (a Slurm allocation's job id;
nothing for local nodes, whose only record is the store's). A paused or failed run's may
be kept with no node (``park``), so that the run goes on in the same allocation.

Node allocation is level-triggered: ``allocate`` is called on every tick on which the
run holds too few healthy nodes and must not ask the cluster twice for the same
nodes; ``held`` tells each tick what the run holds now (an allocation can shrink
or end under us: a node failure, a time limit, preemption). So are drains: the
shell sends a drain until ``drained`` shows it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from health.links import PairResult
from supervisor.domain import ProcState
from supervisor.domain.step import LaunchMode
from supervisor.link_steps import LinkTest


@dataclass(frozen=True, slots=True, kw_only=True)
class LaunchSpec:
    run_id: str
    attempt: int
    nodes: tuple[str, ...]
    ranks_per_node: int
    # The trainer command, identical on every rank (every node with launch "node"); it and
    # ``env`` may hold step placeholders the launcher fills in (supervisor/domain/step.py).
    argv: tuple[str, ...]
    env: Mapping[str, str]  # added to every rank's environment
    log_dir: Path
    # A string unique to this attempt (the attempt's config path), given to every rank
    # as TSUP_MARKER: how a restarted daemon finds processes it launched but had not
    # yet recorded.
    marker: str
    allocation_info: str | None = None  # the run's, when the launcher keeps one (Slurm)
    user: str | None = None  # the ranks execute as (supervisor/users.py); None: as the daemon
    cwd: Path | None = None  # the ranks' working directory (None: the launcher's own)
    srun_args: tuple[str, ...] = ()  # Slurm: the spec's own srun options (the local launcher has no srun)
    launch: LaunchMode = "rank"  # "node": one process per node, which spawns the node's ranks
    # Warm standby ([resources] standby): the run's healthy nodes, where the launcher keeps
    # a standby process per rank slot ready for the next attempt (trainer/standby.py).
    # Empty: no standbys.
    standby_nodes: tuple[str, ...] = ()
    # A directory of the daemon's above ``log_dir`` (the runs' directory): the paths below
    # it belong to the run's user, so the launcher reaches them from here without
    # following a link (supervisor/user_files.py). None: from ``log_dir`` itself.
    trusted_dir: Path | None = None

    @property
    def log_base(self) -> Path:
        return self.trusted_dir if self.trusted_dir is not None else self.log_dir


@dataclass(frozen=True, slots=True, kw_only=True)
class RankProc:
    rank: int
    node: str
    proc: ProcState
    exit_code: int | None = None  # negative: killed by that signal
    # The OS process the rank runs in, as the launcher numbers them within the attempt (a
    # pid, a Slurm task): ranks of one node's torchrun share one. None: not known.
    process: int | None = None
    # Whether the node itself lives, as far as the launcher watches it apart from the ranks
    # (the local launcher: the node's own process). None: it does not.
    node_up: bool | None = None
    # The cluster's word that the node is down (node_up False then), in its words: a node
    # that lost its power says nothing itself, and is missed by its silence or by this.
    node_down: str = ""


@dataclass(frozen=True, slots=True, kw_only=True)
class AllocationRequest:
    run_id: str
    count: int  # nodes wanted in all: one attempt's plus the spares
    minimum: int  # one attempt's nodes: a new allocation starts with no fewer
    # An allocation that still holds this many healthy nodes is kept (None: ``minimum``):
    # a run that may go on with fewer nodes keeps what it has (supervisor/policy/recovery.py).
    keep: int | None = None
    held: tuple[str, ...]  # healthy nodes the run holds now
    drained: frozenset[str]  # never hand these out
    idle: tuple[str, ...]  # nodes the store knows as free (the local launcher's pool)
    known: frozenset[str]  # every node the store knows
    info: str | None  # the run's allocation_info from last time
    partition: str | None = None  # from the spec (Slurm)
    time_limit_min: int | None = None  # from the spec (Slurm): the allocation's time limit
    handles_usr1: bool = False  # the trainer saves on SIGUSR1 (Slurm: signalled before the limit)
    user: str | None = None  # the allocation's owner (Slurm: its sbatch runs as this user)


@dataclass(frozen=True, slots=True, kw_only=True)
class Grant:
    nodes: tuple[str, ...]  # every node the run holds after the call (drained ones included)
    info: str | None  # the new allocation_info
    note: str = ""  # why fewer nodes than asked, for the event log ("job 12 pending: Resources")


@dataclass(frozen=True, slots=True)
class Parked:
    """What ``Launcher.park`` did: ``done`` False when the cluster could not be told (the
    caller tries again later); ``info`` the allocation kept with no node, for the next
    ``allocate`` to go on in (None: nothing kept, the nodes given back for good)."""

    done: bool
    info: str | None = None


class Launcher(Protocol):
    kind: str  # "local", "slurm": what a spec's resources.launcher names

    def check_resources(self, nodes: int, spares: int, partition: str | None) -> None:
        """At submit time: raise SpecError when the cluster can never give this."""
        ...

    def job_of(self, info: str | None) -> str | None:
        """The cluster's job id of an allocation (``Grant.info``), as the trainers see it
        ($SLURM_JOB_ID); None where there is none."""
        ...

    def answered_since(self, t: float) -> bool:
        """Whether what the adapter knows of the cluster was learnt at or after ``t`` (wall
        clock): False while its controller does not answer, and the supervisor then decides
        nothing that needs it."""
        ...

    def allocate(self, req: AllocationRequest) -> Grant:
        """Get the run up to ``req.count`` healthy nodes; may hold fewer for now."""
        ...

    def held(self, run_id: str, info: str | None) -> Grant | None:
        """What the run holds now; None when the launcher cannot tell or keeps no record
        of its own (the store's record stands)."""
        ...

    def release(self, run_id: str, info: str | None) -> bool:
        """The run is over: give its nodes back to the cluster. Idempotent. False when the
        cluster could not be told (its controller down): the caller tries again later."""
        ...

    def park(self, run_id: str, info: str | None, user: str | None) -> Parked:
        """A paused or failed run: give its nodes back, but keep what identifies its
        allocation to the trainer, for the run to go on in when it is resumed (Slurm: its
        job, requeued and held, its id kept). A launcher that keeps no such identity
        gives the nodes back as ``release`` does. ``user``: the allocation's owner."""
        ...

    def start(self, spec: LaunchSpec) -> str:
        """Start every rank; returns launch_info. Raises LaunchError."""
        ...

    def find(self, spec: LaunchSpec) -> str | None:
        """launch_info for processes of ``spec`` that exist but were never recorded."""
        ...

    def observe(self, launch_info: str) -> list[RankProc]: ...

    def stop(self, launch_info: str, *, force: bool) -> None:
        """SIGTERM every rank (SIGKILL when force); idempotent."""
        ...

    def forget(self, launch_info: str) -> None:
        """The attempt has ended: release whatever was kept to observe it."""
        ...


class NodeAdmin(Protocol):
    def drain(self, node: str, reason: str, *, reboot: bool = False) -> None:
        """Ask the cluster to take ``node`` out of service (``reboot``: a reboot is the fix,
        for a cluster that repairs nodes itself). Raises LaunchError."""
        ...

    def undrain(self, node: str) -> None:
        """Ask the cluster to return a drained node to service. Raises LaunchError."""
        ...

    def drained(self, node: str) -> bool | None:
        """Whether the cluster shows ``node`` drained now (None: it cannot tell)."""
        ...

    def repaired(self, node: str) -> bool:
        """A cluster that repairs the nodes it is given (SageMaker HyperPod) brought this one
        back into service. False for clusters that leave repairs to people."""
        ...

    def probe(self, nodes: Sequence[str], argv: Sequence[str], *, allocation_info: str | None,
              timeout_s: float) -> dict[str, str]:
        """Run ``argv`` (``python -m health``) once on each node; its output per node.
        A node missing from the answer gave none (the caller records "probe failed").
        Called on a worker thread: it may take as long as ``timeout_s``."""
        ...

    def probe_drained(self, nodes: Mapping[str, str], argv: Sequence[str], *,
                      timeout_s: float) -> dict[str, str]:
        """``probe`` for drained nodes (name -> drain Reason), which stay drained with the
        same Reason afterwards."""
        ...

    def probe_links(self, test: LinkTest, *, allocation_info: str | None,
                    timeout_s: float) -> list[PairResult]:
        """The link test over ``test.over`` (health/links.py): each pair's all-reduce. Empty
        where the launcher has no links to measure (the local launcher's nodes share one
        host). Called on a worker thread."""
        ...


class ChaosHooks(Protocol):
    """Fault injection for ``--chaos``: real signals to real processes."""

    def kill_rank(self, launch_info: str, rank: int, sig: int = 9) -> str:
        """Send ``sig`` (SIGKILL; SIGSTOP for a hung rank) to one rank's process."""
        ...

    def kill_node(self, launch_info: str, node: str) -> str: ...

    def freeze_node(self, launch_info: str, node: str) -> str:
        """SIGSTOP every process of the node: alive, but silent."""
        ...

    def partition_node(self, node: str, cut: bool) -> str:
        """Take the node's network link down (``cut``) or bring it back: its processes
        live on, cut off. Only where nodes are hosts of their own (a Slurm box)."""
        ...

    def throttle_node(self, node: str, slow: bool) -> str:
        """Slow the node's link (``slow``) or give it its speed back: every collective
        through it slow. Only where nodes are hosts of their own (a Slurm box)."""
        ...


def waiting_standbys(launcher: Launcher) -> Callable[[], Mapping[str, Mapping[str, int]]]:
    """The launcher's warm standbys waiting for a next attempt: run id -> node -> how many
    (only the local launcher keeps any: supervisor/launchers/standby.py)."""
    pool = getattr(launcher, "standbys", None)
    return pool.waiting if pool is not None else dict

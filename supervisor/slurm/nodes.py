"""Node administration on Slurm: drains, returns to service, and probes on the nodes.

- ``drain``: ``scontrol update NodeName=... State=DRAIN Reason=...``; ``drained`` reads
  the node's state flags from the last poll of the node table (supervisor/slurm/
  state.py), so effects/nodes.py sends a drain until Slurm shows it. A Reason may quote a
  trainer's output or an operator's words: it goes to Slurm as one line of printable
  text, at most REASON_MAX characters (``slurm_reason``);
- ``probe``: ``srun`` one probe task per node, in the run's allocation when it holds
  the nodes, else as a job of its own that must start at once;
- ``probe_drained``: a drained node runs no job, so it is reserved, resumed, probed and
  drained again with the same Reason;
- ``probe_links``: the link test (health/links.py): an all-reduce of each pair of nodes
  in a ring, one ``srun`` of two tasks a pair, the disjoint pairs of a round at once
  (up to ``LINK_PAIRS_AT_ONCE``).

On SageMaker HyperPod (``hyperpod``) the cluster repairs nodes itself, on the Reason it
reads: a node to take out is set ``State=FAIL`` with ``Reason=Action:Replace`` (or
``Action:Reboot`` when a reboot is the fix), HyperPod's own words; the supervisor's
readable reason stays in its own records. HyperPod resumes the node once it is replaced
or rebooted (``repaired``), and the supervisor takes it back. Nodes HyperPod repairs are
not probed meanwhile.
"""

from __future__ import annotations

import getpass
import logging
import math
import sys
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor

from health import links, wire
from supervisor.errors import LaunchError
from supervisor.link_steps import LinkTest, pair_step
from supervisor.slurm.allocation import Alloc, job_owner, recorded
from supervisor.slurm.commands import Reply, SlurmCommands
from supervisor.slurm.parse import NodeInfo
from supervisor.slurm.state import SlurmState
from supervisor.users import RunAs

log = logging.getLogger(__name__)

LINK_PAIRS_AT_ONCE = 32  # sruns of a round in flight together: slurmctld serves them all
HYPERPOD_REPLACE = "Action:Replace"  # the Reasons HyperPod's agent acts on
HYPERPOD_REBOOT = "Action:Reboot"
REASON_MAX = 256


def slurm_reason(text: str) -> str:
    """``text`` as a drain Reason: newlines, tabs and every other unprintable character
    (controls, bidirectional overrides) become spaces, runs of spaces one, "=" a colon,
    and the whole is cut to REASON_MAX characters. Slurm prints a Reason's lines apart; one line of text
    is what every reader of a Reason expects."""
    # "=" becomes ":": nothing in a Reason can read as a field after it (the sudo rule in
    # systemd/sudoers.training-supervisor admits a Reason without one).
    flat = " ".join("".join(ch if ch.isprintable() else " " for ch in text).replace("=", ":").split())
    if len(flat) > REASON_MAX:
        flat = flat[:REASON_MAX - 3].rstrip() + "..."
    return flat or "(no reason given)"


def _short_why(reply: Reply) -> str:
    """Why a pair's step failed, in a line a drain Reason can quote: srun's own error
    (which names the node it could not reach) over the tasks' warnings, else the last
    line it printed, else the reply's reason (a timeout)."""
    lines = [ln.strip() for ln in reply.stderr.splitlines() if ln.strip()]
    said = next((ln for ln in lines if ln.startswith("srun: error:")), lines[-1] if lines else reply.why)
    return said[:160]


class SlurmNodes:
    def __init__(self, commands: SlurmCommands, state: SlurmState, *, prefix: str,
                 hyperpod: bool = False, node_python: str = sys.executable) -> None:
        self.commands = commands
        self.node_python = node_python  # the link test's interpreter on the nodes
        self.state = state
        self.prefix = prefix  # job and reservation names: the daemon's own (launcher.prefix_for)
        self.hyperpod = hyperpod

    def drain(self, node: str, reason: str, *, reboot: bool = False) -> None:
        if self.hyperpod:
            state, reason = "State=FAIL", HYPERPOD_REBOOT if reboot else HYPERPOD_REPLACE
        else:
            state = "State=DRAIN"
        reply = self.commands.admin(["scontrol", "update", f"NodeName={node}", state,
                                     f"Reason={slurm_reason(reason)}"])
        if not reply.ok:
            raise LaunchError(f"cannot drain {node}: {reply.why}")
        self.state.refresh()

    def undrain(self, node: str) -> None:
        reply = self.commands.admin(["scontrol", "update", f"NodeName={node}", "State=RESUME"])
        if not reply.ok:
            raise LaunchError(f"cannot return {node} to service: {reply.why}")
        self.state.refresh()

    def drained(self, node: str) -> bool | None:
        nodes = self.state.nodes()
        if nodes is None:
            return None
        info = nodes.get(node)
        if info is None:
            return None  # a node Slurm does not list: it cannot say
        return bool(info.flags & {"DRAIN", "FAIL"})

    def repaired(self, node: str) -> bool:
        """HyperPod brought a node it was asked to repair back into service (it resumes a
        replaced or rebooted node): up, responding, neither drained nor failed."""
        info = (self.state.nodes() or {}).get(node)
        return self.hyperpod and info is not None and info.usable

    def probe(self, nodes: Sequence[str], argv: Sequence[str], *, allocation_info: str | None,
              timeout_s: float, reservation: str | None = None) -> dict[str, str]:
        """``srun`` one probe task per node: a step of the run's allocation when it holds
        the nodes, else a job of its own that must start at once (``--immediate``). Each
        task prints its verdict in short tagged lines (health/wire.py)."""
        out: dict[str, str] = {}
        for job, some in self._by_job(nodes, allocation_info):
            where = [f"--jobid={job}", "--overlap"] if job else ["--immediate=10", "--time=5"]
            if reservation is not None:
                where.append(f"--reservation={reservation}")
            reply = self.commands.run(
                ["srun", *where, f"--job-name={self.prefix}.probe", f"--nodes={len(some)}",
                 f"--nodelist={','.join(some)}", "--ntasks-per-node=1", "--kill-on-bad-exit=0", *argv],
                timeout_s=timeout_s, user=job_owner(allocation_info) if job else None)
            # srun exits non-zero when a probe says "unhealthy" (exit 2): read the output anyway.
            said = {node: text for node, text in wire.answers(reply.stdout).items() if node in some}
            if not reply.ok and not said:
                log.warning("probe of %s: %s", ",".join(some), reply.why)
            out |= said
        return out

    def probe_links(self, test: LinkTest, *, allocation_info: str | None,
                    timeout_s: float) -> list[links.PairResult]:
        """The link test over ``test.over``: each pair of the ring an all-reduce of its own
        (``link_steps.pair_step``: the tool and its form), in a step of the job that holds
        both (a pair split across two jobs is not run), the pairs of a round at once. The
        rendezvous is on the pair's node Slurm lists first (a step's task 0 runs there)."""
        job_of = {n: job for job, some in self._by_job(test.over, allocation_info) for n in some}
        table = self.state.nodes() or {}
        place = {name: i for i, name in enumerate(table)}  # Slurm's node order
        results: list[links.PairResult] = []
        for pairs in links.ring_rounds(test.over):
            with ThreadPoolExecutor(max_workers=min(len(pairs), LINK_PAIRS_AT_ONCE),
                                    thread_name_prefix="link") as pool:
                results += pool.map(lambda p: self._pair(test, p, job_of, table, place, timeout_s,
                                                         job_owner(allocation_info)), pairs)
        return results

    def _pair(self, test: LinkTest, pair: tuple[str, str], job_of: Mapping[str, str | None],
              table: Mapping[str, NodeInfo], place: Mapping[str, int], timeout_s: float,
              owner: RunAs | None) -> links.PairResult:
        job = job_of.get(pair[0])
        if job != job_of.get(pair[1]):
            return links.PairResult(pair, None, "its nodes are in two Slurm jobs")
        ordered = tuple(sorted(pair, key=lambda n: place.get(n, len(place))))
        addrs = tuple(info.addr if (info := table.get(n)) else n for n in ordered)
        step = pair_step(test, (ordered[0], ordered[1]), (addrs[0], addrs[1]), timeout_s,
                         interpreter=self.node_python)
        where = [f"--jobid={job}", "--overlap"] if job else ["--immediate=10", "--time=5"]
        per_node = step.tasks_per_node
        reply = self.commands.run(
            ["srun", *where, f"--job-name={self.prefix}.links", f"--nodes={len(step.nodes)}",
             f"--nodelist={','.join(step.nodes)}", f"--ntasks={len(step.nodes) * per_node}",
             f"--ntasks-per-node={per_node}",
             *([f"--mpi={step.mpi}"] if step.mpi else []), "--kill-on-bad-exit=1",
             "--export=" + ",".join(["ALL", *(f"{k}={v}" for k, v in step.env)]), *step.argv],
            timeout_s=timeout_s, user=owner if job else None)
        return links.pair_result(pair, reply.stdout, "" if reply.ok else _short_why(reply), tool=test.tool)

    def _by_job(self, nodes: Sequence[str],
                allocation_info: str | None) -> list[tuple[str | None, list[str]]]:
        """The nodes grouped by the run's job that holds them (a run grown back holds two;
        a node in none is probed in the first), or all in no job when the run holds none."""
        alloc = Alloc.load(allocation_info)
        if alloc.job is None:
            return [(None, list(nodes))]
        where: dict[str, str] = {}
        jobs = self.state.jobs() or {}
        for job_id in alloc.grow:
            job = recorded(jobs, job_id, alloc.uid)
            where |= {n: job_id for n in (job.nodes if job is not None else ())}
        groups: dict[str | None, list[str]] = {}
        for n in nodes:
            groups.setdefault(where.get(n, alloc.job), []).append(n)
        return list(groups.items())

    def probe_drained(self, nodes: Mapping[str, str], argv: Sequence[str], *,
                      timeout_s: float) -> dict[str, str]:
        """Slurm starts no job on a drained node. So the nodes go into a maintenance
        reservation for this user alone (nothing else can land on them), are resumed,
        probed by a job in that reservation, and drained again with their Reasons; then
        the reservation goes. It lasts only a few minutes, so a daemon killed in between
        leaves nodes reserved briefly, and the next sweep drains them again."""
        if self.hyperpod:
            return {}  # HyperPod repairs them; it resumes them when they are fit again
        names = sorted(nodes)
        resv = f"{self.prefix}-probe"
        self.commands.admin(["scontrol", "delete", f"ReservationName={resv}"])  # one a killed daemon left
        minutes = math.ceil(timeout_s / 60) + 2
        made = self.commands.admin(
            ["scontrol", "create", "reservation", f"ReservationName={resv}", f"Nodes={','.join(names)}",
             f"Users={getpass.getuser()}", "StartTime=now", f"Duration={minutes}", "Flags=MAINT,IGNORE_JOBS"])
        if not made.ok:
            log.warning("probe of drained %s: cannot reserve them: %s", ",".join(names), made.why)
            return {}
        try:
            resumed = self.commands.admin(["scontrol", "update", f"NodeName={','.join(names)}",
                                           "State=RESUME"])
            if not resumed.ok:
                log.warning("probe of drained %s: cannot resume them: %s", ",".join(names), resumed.why)
                return {}
            return self.probe(names, argv, allocation_info=None, timeout_s=timeout_s, reservation=resv)
        finally:
            for node in names:
                again = self.commands.admin(["scontrol", "update", f"NodeName={node}", "State=DRAIN",
                                             f"Reason={slurm_reason(nodes[node])}"])
                if not again.ok:
                    log.error("probe of drained %s: cannot drain it again: %s", node, again.why)
            self.commands.admin(["scontrol", "delete", f"ReservationName={resv}"])
            self.state.refresh()


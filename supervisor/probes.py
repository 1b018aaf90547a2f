"""The probe scheduler: rounds of node probes on worker threads, and the periodic sweep.

A probe (``python -m health`` on a node) may take a minute; the reconciler's tick must
not wait for it. A round is submitted here, runs on a worker thread through the node
administration port, and its answers are handed back at a later tick (``finished``),
where the decision core judges them (supervisor/policy/nodes.py). While a run's nodes
are being probed the run launches nothing (``probing``). A run's round may carry the
link test (``link_steps.LinkTest``, health/links.py): after the per-node probe, an all-reduce of
each pair of the run's nodes, whose finding joins each judged node's verdict.

The sweep probes the idle nodes and the nodes this supervisor drained, every
``sweep_every_s``, one round at a time; drained nodes go through the cluster's
out-of-service path (on Slurm no job runs on a drained node).

Every round is a row of the store (``probe_rounds``), open from the moment it is asked
for until its answers are judged (``done``). A daemon that died in between asks again
for an open round of a run that still goes on (``reopen``): a preflight is not lost with
the process that ran it, so no attempt launches on nodes nobody probed. An operator's
probe of a node (a queued node command, ``ProbeNode``) is a round too, on the same
workers, judged like the others at a later tick; one a daemon left open is closed, and
its command, still queued, is carried out by the next daemon.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from dataclasses import dataclass, field

from health import links as health_links
from supervisor import node_health
from supervisor.domain import TERMINAL_RUN_STATES, ProbeRoundRecord
from supervisor.errors import NotFound
from supervisor.launchers.base import NodeAdmin
from supervisor.link_steps import LinkTest
from supervisor.store import SqlStore

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Answers:
    """What a round's workers found: each node's answer (its probe's wire lines), and
    each node's figure in the round's link test (its best pair, GB/s), measured by the
    daemon itself, never read from a node's own words."""

    by_node: dict[str, str]
    link_gbps: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Finished:
    """A round whose probes are done: every node's answer (None: none came) and figure."""

    round: ProbeRound
    answers: dict[str, str | None]
    link_gbps: dict[str, float]


@dataclass(slots=True, kw_only=True)
class ProbeRound:
    run_number: int | None  # None: the sweep
    kind: str  # preflight, diagnosis, sweep, manual
    nodes: list[str]
    argv: tuple[str, ...]
    timeout_s: float
    round: int
    future: Future[Answers] = field(repr=False)
    row: int = 0  # its row in the store's probe_rounds (0: none kept)
    command_id: int | None = None  # an operator's probe: its command


class ProbeScheduler:
    def __init__(self, nodes: NodeAdmin, clock: Callable[[], float], *, store: SqlStore | None = None,
                 sweep_every_s: float | None = None, sweep_args: tuple[str, ...] = (),
                 sweep_timeout_s: float = 60.0, pool: Executor | None = None) -> None:
        self.nodes = nodes
        self.store = store
        self.clock = clock
        self._lock = threading.Lock()  # the rounds in flight: the reconciler's and an operator's
        self.sweep_every_s = sweep_every_s
        self.sweep_args = sweep_args  # extra arguments to the sweep's python -m health
        self.sweep_timeout_s = sweep_timeout_s
        self._pool = pool or ThreadPoolExecutor(max_workers=4, thread_name_prefix="probe")
        self._rounds: list[ProbeRound] = []
        self._swept_at = clock()  # the first sweep comes one interval after start

    def close(self) -> None:
        """Stop taking results; probes in flight end by their own timeouts."""
        self._pool.shutdown(wait=False, cancel_futures=True)

    def probing(self, run_number: int) -> bool:
        """Whether the run's own rounds are in flight (an operator's probe of one of its
        nodes holds nothing of it, as a probe by hand on the node would not)."""
        with self._lock:
            return any(r.run_number == run_number and r.command_id is None for r in self._rounds)

    def submit(self, *, run_number: int | None, kind: str, nodes: list[str], argv: tuple[str, ...],
               timeout_s: float, round_: int = 1, allocation_info: str | None = None,
               drained: Mapping[str, str] | None = None, row: int = 0, command_id: int | None = None,
               links: LinkTest | None = None) -> None:
        """Probe ``nodes`` (a run's, in its allocation; the sweep's idle nodes, and the
        ``drained`` ones with their Reasons; or the one node of an operator's command),
        recorded as an open round (``row``: the open round this one asks again); ``links``:
        the link test after the probe (a round asked again by ``reopen`` runs without it)."""
        row = row or self._open_row(run_number, kind, nodes, argv, timeout_s, round_)
        if run_number is None and command_id is None:
            out_of_service = dict(drained or {})
            idle = [n for n in nodes if n not in out_of_service]
            future = self._pool.submit(self._sweep, idle, out_of_service, argv, timeout_s)
        else:
            future = self._pool.submit(self._probe, list(nodes), argv, allocation_info, timeout_s, links)
        with self._lock:
            self._rounds.append(ProbeRound(run_number=run_number, kind=kind, nodes=list(nodes), argv=argv,
                                           timeout_s=timeout_s, round=round_, future=future, row=row,
                                           command_id=command_id))

    def probing_node(self, node: str) -> bool:
        """Whether a round in flight probes ``node``."""
        with self._lock:
            return any(node in r.nodes for r in self._rounds)

    def done(self, r: ProbeRound) -> None:
        """``r``'s answers are judged and recorded: its round is closed."""
        self._close_row(r.row)

    def reopen(self) -> int:
        """At start: ask again for every round a daemon before this one left open, of a run
        that still goes on, in its allocation as it is now; close the others (the sweep
        comes again by itself). How many were asked again."""
        if self.store is None:
            return 0
        again = 0
        with self.store.tx() as tx:
            rounds = tx.open_probe_rounds()
        for r in rounds:
            info, live = None, False
            if r.run_number is not None and r.kind != node_health.MANUAL:
                with self.store.tx() as tx:
                    try:
                        run = tx.get_run(r.run_number)
                        info, live = run.allocation_info, run.state not in TERMINAL_RUN_STATES
                    except NotFound:
                        pass
            if not live:
                self._close_row(r.id)
                continue
            log.info("asking again for the %s probe of %s (round %d), which the last daemon left open",
                     r.kind, ", ".join(r.nodes), r.round)
            self.submit(run_number=r.run_number, kind=r.kind, nodes=list(r.nodes), argv=r.argv,
                        timeout_s=r.timeout_s, round_=r.round, allocation_info=info, row=r.id)
            again += 1
        return again

    def _open_row(self, run_number: int | None, kind: str, nodes: list[str], argv: tuple[str, ...],
                  timeout_s: float, round_: int) -> int:
        if self.store is None:
            return 0
        with self.store.tx() as tx:
            return tx.add_probe_round(ProbeRoundRecord(
                id=0, run_number=run_number, kind=kind, nodes=tuple(nodes), argv=argv, timeout_s=timeout_s,
                round=round_, started_at=self.clock()))

    def _close_row(self, row: int) -> None:
        if self.store is not None and row:
            with self.store.tx() as tx:
                tx.end_probe_round(row, self.clock())

    def finished(self) -> list[Finished]:
        """Rounds whose probes are done, each with every node's answer (None: no answer)."""
        out: list[Finished] = []
        with self._lock:
            ended = [r for r in self._rounds if r.future.done()]
            self._rounds = [r for r in self._rounds if r not in ended]
        for r in ended:
            try:
                answers = r.future.result()
            except Exception as e:  # an adapter that raised: every node of the round gave no answer
                log.error("%s probe of %s failed: %s", r.kind, ", ".join(r.nodes), e)
                answers = Answers({})
            out.append(Finished(r, {n: answers.by_node.get(n) for n in r.nodes},
                                {n: g for n, g in answers.link_gbps.items() if n in r.nodes}))
        return out

    def sweep_due(self, now: float) -> bool:
        """Time for the next sweep (and none in flight); marks it started."""
        every = self.sweep_every_s
        with self._lock:
            sweeping = any(r.run_number is None for r in self._rounds)
        if every is None or now - self._swept_at < every or sweeping:
            return False
        self._swept_at = now
        return True

    def _probe(self, nodes: list[str], argv: tuple[str, ...], allocation_info: str | None, timeout_s: float,
               link_test: LinkTest | None) -> Answers:
        answers = self.nodes.probe(nodes, argv, allocation_info=allocation_info, timeout_s=timeout_s)
        if link_test is None:
            return Answers(answers)
        results = self.nodes.probe_links(link_test, allocation_info=allocation_info, timeout_s=timeout_s)
        if results:
            log.info("link test of %s: %s", ", ".join(link_test.over), "; ".join(
                f"{r.nodes[0]}-{r.nodes[1]} " + (f"{r.busbw_gbps:.4g} GB/s" if r.busbw_gbps is not None
                                                 else f"no figure ({r.why})") for r in results))
        findings = health_links.judge(nodes, results, fraction=link_test.fraction)
        if results and (cannot := health_links.unjudged(nodes, results, findings)):
            log.warning("%s", cannot)
        figures = {n: gbps for n, (gbps, _) in health_links.figures(results).items()}
        return Answers(node_health.with_findings(answers, findings), figures)

    def _sweep(self, idle: list[str], drained: dict[str, str], argv: tuple[str, ...],
               timeout_s: float) -> Answers:
        out: dict[str, str] = {}
        if idle:
            out.update(self.nodes.probe(idle, argv, allocation_info=None, timeout_s=timeout_s))
        if drained:
            out.update(self.nodes.probe_drained(drained, argv, timeout_s=timeout_s))
        return Answers(out)

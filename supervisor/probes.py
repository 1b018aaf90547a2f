"""The probe scheduler: rounds of node probes on worker threads, and the periodic sweep.

A probe (``python -m health`` on a node) may take a minute; the reconciler's tick must
not wait for it. A round is submitted here, runs on a worker thread through the node
administration port, and its answers are handed back at a later tick (``finished``),
where the decision core judges them (supervisor/policy/nodes.py). While a run's nodes
are being probed the run launches nothing (``probing``).

The sweep probes the idle nodes and the nodes this supervisor drained, every
``sweep_every_s``, one round at a time; drained nodes go through the cluster's
out-of-service path (on Slurm no job runs on a drained node).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from dataclasses import dataclass, field

from supervisor.launchers.base import NodeAdmin

log = logging.getLogger(__name__)


@dataclass(slots=True, kw_only=True)
class ProbeRound:
    run_number: int | None  # None: the sweep
    kind: str  # preflight, diagnosis, sweep
    nodes: list[str]
    argv: tuple[str, ...]
    timeout_s: float
    round: int
    future: Future[dict[str, str]] = field(repr=False)


class ProbeScheduler:
    def __init__(self, nodes: NodeAdmin, clock: Callable[[], float], *, sweep_every_s: float | None = None,
                 sweep_args: tuple[str, ...] = (), sweep_timeout_s: float = 60.0,
                 pool: Executor | None = None) -> None:
        self.nodes = nodes
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
        return any(r.run_number == run_number for r in self._rounds)

    def submit(self, *, run_number: int | None, kind: str, nodes: list[str], argv: tuple[str, ...],
               timeout_s: float, round_: int = 1, allocation_info: str | None = None,
               drained: Mapping[str, str] | None = None) -> None:
        """Probe ``nodes`` (a run's, in its allocation; or the sweep's idle nodes, and the
        ``drained`` ones with their Reasons)."""
        if run_number is None:
            out_of_service = dict(drained or {})
            idle = [n for n in nodes if n not in out_of_service]
            future = self._pool.submit(self._sweep, idle, out_of_service, argv, timeout_s)
        else:
            future = self._pool.submit(self.nodes.probe, nodes, argv, allocation_info=allocation_info,
                                       timeout_s=timeout_s)
        self._rounds.append(ProbeRound(run_number=run_number, kind=kind, nodes=list(nodes), argv=argv,
                                       timeout_s=timeout_s, round=round_, future=future))

    def finished(self) -> list[tuple[ProbeRound, dict[str, str | None]]]:
        """Rounds whose probes are done, each with every node's answer (None: no answer)."""
        out: list[tuple[ProbeRound, dict[str, str | None]]] = []
        for r in [r for r in self._rounds if r.future.done()]:
            self._rounds.remove(r)
            try:
                answers = r.future.result()
            except Exception as e:  # an adapter that raised: every node of the round gave no answer
                log.error("%s probe of %s failed: %s", r.kind, ", ".join(r.nodes), e)
                answers = {}
            out.append((r, {n: answers.get(n) for n in r.nodes}))
        return out

    def sweep_due(self, now: float) -> bool:
        """Time for the next sweep (and none in flight); marks it started."""
        every = self.sweep_every_s
        if every is None or now - self._swept_at < every or any(r.run_number is None for r in self._rounds):
            return False
        self._swept_at = now
        return True

    def _sweep(self, idle: list[str], drained: dict[str, str], argv: tuple[str, ...],
               timeout_s: float) -> dict[str, str]:
        out: dict[str, str] = {}
        if idle:
            out.update(self.nodes.probe(idle, argv, allocation_info=None, timeout_s=timeout_s))
        if drained:
            out.update(self.nodes.probe_drained(drained, argv, timeout_s=timeout_s))
        return out

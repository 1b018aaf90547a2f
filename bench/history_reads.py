"""What a run's detail and a /metrics scrape cost as the run's history grows.

    python bench/history_reads.py [--attempts 10,100,1000] [--requests 200]

For each size N it writes a run of N attempts into a real store (SQLite, WAL, as the
daemon opens it): each attempt ended by a fault that the next one recovered, with its
step stats (1,000 steps) and a committed checkpoint, and 7 faults in 9 a node's (drained,
kept by the run that drained it), as bench/soak.py's run leaves them after N faults.
Then it times, ``--requests`` times each, what the API's ``GET /v1/runs/{id}`` does
(``SupervisorService.get_run``) and what a Prometheus scrape of ``/metrics`` does (the
daemon's registry, rendered), two ways:

- ``settled``: as the daemon reads now, through one ``SettledHistory`` shared by every
  read (supervisor/gathering/settled.py): ended attempts and recovered faults decoded once;
- ``cold``: with a new ``SettledHistory`` for each read, which decodes the whole history
  from SQLite every time, as every read did before.

It prints one JSON object: per size, the p50 and p99 milliseconds of each. No HTTP: the
socket's cost is the same at every size (bench/soak.py measures reads over HTTP).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from prometheus_client import generate_latest  # noqa: E402

from supervisor.domain import (  # noqa: E402
    Attempt,
    AttemptOutcome,
    AttemptState,
    AttemptStats,
    FaultKind,
    Node,
    NodeState,
)
from supervisor.gathering.settled import SettledHistory  # noqa: E402
from supervisor.launchers.local import LocalLauncher  # noqa: E402
from supervisor.metrics import SupervisorMetrics  # noqa: E402
from supervisor.service import SupervisorService  # noqa: E402
from supervisor.spec import parse_spec  # noqa: E402
from supervisor.store import SqlStore  # noqa: E402
from supervisor.telemetry.view import TelemetryView  # noqa: E402
from supervisor.views import HISTORY_SHOWN  # noqa: E402

STEPS = 1000  # a run's steps between two faults
ATTEMPT_S = 3100.0  # and its wall time


def build(directory: Path, attempts: int) -> tuple[SqlStore, SupervisorService, float]:
    """A store holding one run of ``attempts`` attempts; the service over it; the time after."""
    store = SqlStore(directory / "supervisor.db")
    store.open()
    local = LocalLauncher(max_nodes=4)
    service = SupervisorService(store, directory / "runs", allow_root_runs=True, mqtt_url="mqtt://127.0.0.1:1",
                                launcher=local, check_trainer=False)
    service.submit(parse_spec({"name": "history", "resources": {"nodes": 2, "ranks_per_node": 2, "spares": 1},
                               "trainer": {"steps": STEPS * (attempts + 1)}}))
    now = 1000.0
    with store.tx() as tx:
        for n in range(1, attempts + 1):
            state = AttemptState.ENDED if n < attempts else AttemptState.RUNNING
            tx.add_attempt(Attempt(run_number=1, number=n, state=state, nodes=("local-1", "local-2"),
                                   resume_from=None, resume_step=(n - 1) * STEPS, created_at=now,
                                   started_at=now, ended_at=now + ATTEMPT_S - 100 if n < attempts else None,
                                   outcome=AttemptOutcome.FAILED if n < attempts else None))
            tx.put_attempt_stats(1, AttemptStats(attempt=n, steps=STEPS, first_step=(n - 1) * STEPS + 1,
                                                 last_step=n * STEPS, first_at=now + 10, last_at=now + 2990,
                                                 step_time_s=2900.0, first_step_time_s=2.9))
            tx.record_checkpoint(1, step=n * STEPS - 100, path=f"/ckpt/step_{n * STEPS - 100}", complete=True,
                                 duration_s=1.0, attempt=n, now=now + 2900, attempt_time_s=2610.0)
            if n < attempts:
                tx.add_fault(1, attempt=n, kind=FaultKind.RANK_EXIT, ranks=[3], nodes=["local-2"],
                             step=n * STEPS, summary="rank 3 killed by SIGKILL", now=now + ATTEMPT_S - 100,
                             last_step_at=now + 2990)
                tx.mark_faults_recovered(1, now + ATTEMPT_S + 20)
                if n % 9 < 7:  # 78 % of the faults are a node's (Llama 3's share): drained, kept by the run
                    tx.put_node(Node(name=f"node-{n}", state=NodeState.DRAINED, run_number=1,
                                     reason=f"training-supervisor: node lost, all its ranks vanished ({n})"),
                                now + ATTEMPT_S - 100)
            now += ATTEMPT_S
    service.clock = lambda: now
    return store, service, now


def timed(fn: Callable[[], Any], requests: int) -> dict[str, float]:
    times = []
    for _ in range(requests):
        started = time.perf_counter()
        fn()
        times.append((time.perf_counter() - started) * 1000)
    times.sort()
    return {"p50_ms": round(statistics.median(times), 3),
            "p99_ms": round(times[min(len(times) - 1, int(len(times) * 0.99))], 3)}


def measure(attempts: int, requests: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="tsup-history-") as tmp:
        store, service, now = build(Path(tmp), attempts)
        try:
            out: dict[str, Any] = {"attempts": attempts}
            shared = SettledHistory()
            for mode in ("settled", "cold"):
                def history() -> SettledHistory:
                    return shared if mode == "settled" else SettledHistory()  # noqa: B023

                def detail() -> None:
                    service.history = history()
                    service.get_run("run-1")

                def scrape() -> None:
                    metrics = SupervisorMetrics(store, TelemetryView(), lambda: True, lambda: now,
                                                history=history())
                    generate_latest(metrics.registry)

                detail()  # the first read settles what can be
                got = service.get_run("run-1")
                assert len(got.attempt_history) == min(attempts, HISTORY_SHOWN)
                assert got.faults_total == attempts - 1
                out[mode] = {"run_detail": timed(detail, requests), "metrics": timed(scrape, requests)}
            return out
        finally:
            store.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--attempts", default="10,100,1000", help="comma-separated history sizes")
    ap.add_argument("--requests", type=int, default=200, help="reads of each kind at each size")
    args = ap.parse_args()
    sizes = [int(x) for x in args.attempts.split(",") if x]
    results = []
    for n in sizes:
        print(f"history_reads: {n} attempts ...", file=sys.stderr, flush=True)
        results.append(measure(n, args.requests))
    print(json.dumps({"requests": args.requests, "sizes": results}, indent=2))


if __name__ == "__main__":
    main()

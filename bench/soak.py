"""A 54-day run's worth of telemetry through the real daemon, in accelerated time.

    python bench/soak.py [--steps 5000000] [--marks 100000,1000000,5000000] [--quick]

The daemon is the one ``training-supervisor serve`` runs: its store (SQLite, WAL, full
sync), its embedded broker and telemetry link, its reconciler ticking on its own thread
(observe, the policy, execute, the recorder with its per-attempt stats, loss curve and
retention) and its HTTP API on a socket. Only two things are not real:

- the clock: simulated seconds, one per training step, advanced by the feeder; the
  daemon reads it for everything it dates (a 54-day run passes in minutes);
- the cluster: the scripted one of the reconciler's tests (tests/fakes.py, held to the
  same contract as the real ones) hands out nodes and reports the ranks of each attempt
  running until the feeder kills them; its telemetry is fed to the daemon's telemetry
  view as the MQTT link would (``TelemetryView.ingest`` on encoded messages, sealed with
  their attempt's key as a rank seals them: the view drops unsealed ones), without the
  broker's round trip, at up to a hundred thousand messages a second.

The reads are made by a second process (an operator's tool), at each mark once what was
fed is recorded. The run: 2 nodes x 2 ranks with a spare, one step a simulated second (rank 0 sends its
step metrics, the other ranks a heartbeat every 5 s), a checkpoint every 500 steps
(real ``step_N`` directories the supervisor resumes from), and faults at Llama 3's
rate for the job (419 in 54 days, 78 % hardware: every rank of a node SIGKILLed, drained
and replaced; the rest one rank exiting 1). The policy is the default one.

``--fault-scale 0`` runs without faults: one attempt, so that what a read costs is seen
against the steps alone (with faults, the attempts grow too: the reads are O(attempts)).

At each mark (default 0.1 M, 1 M and 5 M steps recorded) it measures the process's RSS,
the database's size on disk (with its WAL), the rows of raw steps kept, and the latency
of ``GET /v1/runs/run-1`` and ``GET /metrics`` over HTTP (p50, p99, max of
``--requests`` each, while the run goes on). It prints one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import shutil
import sqlite3
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import psutil

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import wire as p  # noqa: E402
from api.app import daemon_app  # noqa: E402
from supervisor import planning  # noqa: E402
from supervisor.daemon import Cluster, Daemon, DaemonSettings  # noqa: E402
from supervisor.domain import AttemptState, ProcState  # noqa: E402
from supervisor.recorder import Retention  # noqa: E402
from supervisor.spec import parse_spec  # noqa: E402
from tests.fakes import ScriptedLauncher  # noqa: E402

RUN = "run-1"
NODES, RANKS_PER_NODE, SPARES = 2, 2, 1
CHECKPOINT_EVERY = 500
HEARTBEAT_EVERY = 5  # simulated seconds between the other ranks' heartbeats
BACKLOG_MAX = 20_000  # durable items waiting for the recorder before the feeder waits


def say(text: str) -> None:
    print(f"[soak {time.strftime('%H:%M:%S')}] {text}", file=sys.stderr, flush=True)


class SimClock:
    """Simulated wall-clock seconds, advanced by the feeder, read by the daemon."""

    def __init__(self, start: float) -> None:
        self.t = start
        self._lock = threading.Lock()

    def __call__(self) -> float:
        with self._lock:
            return self.t

    def advance(self, seconds: float) -> float:
        with self._lock:
            self.t += seconds
            return self.t


_CLIENT = """
import json, sys, time
import httpx
api, token, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
latency = {"run": [], "metrics": []}
with httpx.Client(base_url=api, headers={"Authorization": f"Bearer {token}"}, timeout=30) as c:
    for _ in range(n):
        for key, path in (("run", "/v1/runs/run-1"), ("metrics", "/metrics")):
            t0 = time.perf_counter()
            r = c.get(path)
            latency[key].append(time.perf_counter() - t0)
            r.raise_for_status()
            if key == "run":
                detail = r.json()
print(json.dumps({"latency": latency, "detail": detail}))
"""


def percentiles(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)

    def q(f: float) -> float:
        return ordered[min(len(ordered) - 1, math.ceil(f * len(ordered)) - 1)]
    return {"p50_ms": round(q(0.50) * 1000, 2), "p99_ms": round(q(0.99) * 1000, 2),
            "max_ms": round(ordered[-1] * 1000, 2)}


class Feeder:
    """The trainer's side: steps, heartbeats, checkpoints and faults, in simulated time."""

    def __init__(self, daemon: Daemon, cluster: ScriptedLauncher, clock: SimClock, state: Path,
                 args: argparse.Namespace,
                 token: str) -> None:
        self.daemon, self.cluster, self.clock, self.state, self.args = daemon, cluster, clock, state, args
        self.token = token
        self.rng = random.Random(args.seed)
        # The job's rate, per second of training (Llama 3's, times --fault-scale). The next
        # fault is drawn from the moment the run trains again: one whose time came during a
        # recovery is drawn afresh (the process is memoryless). Queued up instead, at 11
        # times the rate they struck new attempts at their first step three times in a row
        # at 1,071 attempts, and the run ended in a crash-loop verdict.
        self.rate_s = args.fault_scale * planning.LLAMA3_INTERRUPTIONS / (planning.LLAMA3_DAYS * 86_400.0)
        self.next_fault = clock() + self.rng.expovariate(self.rate_s) if self.rate_s > 0 else math.inf
        self.fed = 0
        self.faults_injected = {"hardware": 0, "software": 0}
        self.marks: list[dict[str, Any]] = []
        self.error: BaseException | None = None
        self.checkpoints = state / "runs" / RUN / "checkpoints"
        self.t0 = clock()  # the run's start, in simulated seconds
        self.keys: dict[int, bytes] = {}  # attempt -> its key
        self.seqs: dict[tuple[int, int], int] = {}  # (attempt, rank) -> the last sequence number used

    def ingest(self, msg: p.RankMessage) -> None:
        """Sealed as a rank seals it (one connection per rank and attempt): the daemon's view
        drops unsealed messages."""
        view = self.daemon.telemetry
        assert view.secret is not None
        key = self.keys.get(msg.attempt)
        if key is None:
            key = self.keys[msg.attempt] = p.attempt_key(view.secret, view.cluster, msg.run, msg.attempt)
        seq = self.seqs[msg.attempt, msg.rank] = self.seqs.get((msg.attempt, msg.rank), p.WILL_SEQ) + 1
        seal = p.Seal(key=key, conn=f"{msg.attempt:08x}{msg.rank:08x}", seq=seq)
        topic, payload = p.encode(msg, cluster=view.cluster, seal=seal)
        view.ingest(topic, payload, self.clock())

    def live_attempt(self, after: int, timeout_s: float = 120.0) -> tuple[int, str, int]:
        """The newest attempt launched after ``after``: (number, launch_info, resume step).
        Meanwhile simulated time passes (recovery takes time), 2 s per 20 ms."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            started = [x for x in list(self.cluster.started) if x.attempt > after]
            if started:
                number, info = started[-1].attempt, self.cluster.cluster.markers[started[-1].marker]
                with self.daemon.store.tx() as tx:
                    a = next(a for a in tx.list_attempts(1) if a.number == number)
                if a.state is AttemptState.RUNNING:
                    return number, info, a.resume_step
            self.clock.advance(2.0)
            time.sleep(0.02)
        with self.daemon.store.tx() as tx:
            run = tx.get_run(1)
        raise RuntimeError(f"no new attempt after {after} within {timeout_s} s: "
                           f"run is {run.state} ({run.reason})")

    def checkpoint(self, attempt: int, step: int) -> None:
        d = self.checkpoints / f"step_{step:08d}"
        d.mkdir(parents=True, exist_ok=True)
        (d / ".metadata").write_bytes(b"soak")
        (d / "trainer_meta.json").write_text(json.dumps({"step": step}))
        for old in sorted(self.checkpoints.glob("step_*"))[:-2]:
            shutil.rmtree(old, ignore_errors=True)
        self.ingest(p.CheckpointCommitted(run=RUN, attempt=attempt, rank=0, ts=self.clock(), step=step,
                                          path=str(d), duration_s=2.0))

    def run(self) -> None:
        try:
            self._run()
        except BaseException as e:  # reported by the main thread
            self.error = e

    def _run(self) -> None:
        marks = sorted(self.args.marks)
        attempt = 0
        began = time.monotonic()
        while self.fed < self.args.steps:
            attempt, info, step = self.live_attempt(attempt)
            if self.next_fault <= self.clock():
                self.next_fault = self.clock() + self.rng.expovariate(self.rate_s)
            world = NODES * RANKS_PER_NODE
            while self.fed < self.args.steps:
                now = self.clock.advance(1.0)
                step += 1
                self.fed += 1
                self.ingest(p.StepMetrics(run=RUN, attempt=attempt, rank=0, ts=now, step=step,
                                          loss=3.0 / math.log(step + 2), grad_norm=1.0, lr=3e-4,
                                          step_time_s=0.95, tokens_per_s=4096.0, busy_s=0.9))
                if step % HEARTBEAT_EVERY == 0:
                    for r in range(1, world):
                        self.ingest(p.Heartbeat(run=RUN, attempt=attempt, rank=r, ts=now, step=step,
                                                phase=p.Phase.TRAIN))
                if step % CHECKPOINT_EVERY == 0:
                    self.checkpoint(attempt, step)
                if marks and self.fed >= marks[0]:
                    self.measure(marks.pop(0), began)
                if self.fed % 1000 == 0:
                    self.throttle()
                if now >= self.next_fault:
                    self.next_fault = now + self.rng.expovariate(self.rate_s)
                    self.inject(info)
                    break

    def throttle(self) -> None:
        """Never more than BACKLOG_MAX items waiting for the recorder (the view would drop)."""
        while self.daemon.telemetry.durable_backlog() > BACKLOG_MAX:
            time.sleep(0.01)
        if self.fed % 100_000 == 0:
            say(f"{self.fed:,} steps fed, sim day {(self.clock() - self.t0) / 86_400:.1f}, "
                f"faults {self.faults_injected}")

    def inject(self, info: str) -> None:
        d = json.loads(info)
        if self.rng.random() < planning.LLAMA3_HARDWARE_SHARE:  # the node is lost: all its ranks SIGKILLed
            self.faults_injected["hardware"] += 1
            self.cluster.kill_node(info, self.rng.choice(d["nodes"]))
        else:  # one rank exits 1
            self.faults_injected["software"] += 1
            self.cluster.procs[info][self.rng.randrange(len(d["nodes"]) * d["rpn"])] = (ProcState.EXITED, 1)

    def measure(self, mark: int, began: float) -> None:
        api = self.daemon.api_url
        assert api is not None
        while self.daemon.telemetry.durable_backlog():  # what was fed is recorded: the reads see it all
            time.sleep(0.05)
        # From another process, as an operator's tool would ask (this one's threads would
        # otherwise compete with the daemon's for the interpreter).
        out = subprocess.run([sys.executable, "-c", _CLIENT, api, self.token, str(self.args.requests)],
                             capture_output=True, text=True, check=True, timeout=600)
        measured = json.loads(out.stdout)
        latency, detail = measured["latency"], measured["detail"]
        db = self.state / "supervisor.db"
        size = sum(f.stat().st_size for f in (db, db.with_name(db.name + "-wal")) if f.exists())
        conn = sqlite3.connect(db)
        try:
            rows = {t: conn.execute(f"SELECT count(*) FROM {t}").fetchone()[0]
                    for t in ("metrics", "events", "loss_curve", "attempt_stats", "faults")}
        finally:
            conn.close()
        row = {"steps": mark, "sim_days": round((self.clock() - self.t0) / 86_400, 2),
               "wall_s": round(time.monotonic() - began, 1),
               "rss_mib": round(psutil.Process().memory_info().rss / 2**20, 1),
               "db_mib": round(size / 2**20, 1), "rows": rows,
               "get_run": percentiles(latency["run"]), "get_metrics": percentiles(latency["metrics"]),
               "attempts": detail["attempts"], "faults": len(detail["faults"]), "ettr": detail["ettr"],
               "run_state": detail["state"], "step": detail["step"]}
        self.marks.append(row)
        say(json.dumps(row))


SPEC = {
    "name": "soak",
    "resources": {"nodes": NODES, "ranks_per_node": RANKS_PER_NODE, "spares": SPARES},
    "trainer": {"steps": 10**12, "checkpoint": {"every_steps": CHECKPOINT_EVERY}},
}


async def soak(args: argparse.Namespace, state: Path) -> dict[str, Any]:
    clock = SimClock(1.8e9)
    cluster = ScriptedLauncher()
    # The scripted cluster runs no process, so a daemon started as root may accept the run.
    settings = DaemonSettings(state_dir=state, api_port=0, check_trainer_config=False, tick_s=0.1,
                              allow_root_runs=True, retention=Retention(metrics_days=args.retention_days))
    daemon = Daemon(settings, clock, api=daemon_app, cluster=Cluster(cluster, cluster))
    async with daemon:
        assert daemon.service is not None and daemon.api_tokens is not None
        stop = asyncio.Event()
        task = asyncio.create_task(daemon.run(stop))
        while daemon.link is None or not daemon.link.connected:
            await asyncio.sleep(0.05)
        daemon.service.submit(parse_spec(SPEC))
        feeder = Feeder(daemon, cluster, clock, state, args, daemon.api_tokens.token)
        thread = threading.Thread(target=feeder.run, name="feeder", daemon=True)
        began = time.monotonic()
        thread.start()
        while thread.is_alive():
            await asyncio.sleep(0.2)
        wall = time.monotonic() - began
        stop.set()
        await task
        if feeder.error is not None:
            raise feeder.error
        dropped = daemon.telemetry.counts_now().get("durable_dropped", 0)
    return {"steps": args.steps, "fault_scale": args.fault_scale,
            "sim_days": round((clock() - feeder.t0) / 86_400, 2), "wall_s": round(wall, 1),
            "faults_injected": feeder.faults_injected, "durable_dropped": dropped,
            "retention_metrics_days": args.retention_days, "marks": feeder.marks}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=5_000_000)
    ap.add_argument("--marks", default="100000,1000000,5000000",
                    help="steps at which to measure, comma-separated")
    ap.add_argument("--requests", type=int, default=200, help="requests of each kind at each mark")
    ap.add_argument("--retention-days", type=float, default=14.0,
                    help="raw step metrics kept (simulated days)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--fault-scale", type=float, default=1.0,
                    help="times Llama 3's fault rate (0: no fault: one attempt, to isolate the steps' share)")
    ap.add_argument("--quick", action="store_true", help="200,000 steps, marks at 10k, 100k and 200k")
    args = ap.parse_args(argv)
    if args.quick:
        args.steps, args.marks = 200_000, "10000,100000,200000"
    args.marks = [int(m) for m in str(args.marks).split(",") if m]
    if args.steps < 1 or not args.marks or max(args.marks) > args.steps:
        ap.error("--steps >= 1, and every mark within it")
    state = Path(tempfile.mkdtemp(prefix="tsup-soak-"))
    try:
        result = asyncio.run(soak(args, state))
    finally:
        shutil.rmtree(state, ignore_errors=True)
    result["machine"] = {"cpus": os.cpu_count(), "python": sys.version.split()[0]}
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

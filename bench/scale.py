"""Telemetry at scale: the supervisor's real ingestion and hang detection under R ranks.

    python bench/scale.py [--ranks 1024,4096,32768] [--window-s 30] [--step-s 2] [--aggregate rank,node]
    python bench/scale.py --quick          # ranks 256,2048, short windows: ~4 minutes
    python bench/scale.py --ranks 16 --window-s 0.5 --warmup-s 0.2 --step-s 0.25 \
        --hang-floor-s 0.5 --silence-timeout-s 2    # ~15 s: a smoke test, no measurement

Three telemetry variants (``--aggregate``, all by default), measured one after the other
at each R, each with everything below:

- ``rank``: every rank publishes for itself (``[telemetry] aggregate = "rank"``, the
  default): a ``Heartbeat`` a second and a ``StepMetrics`` a step, R (1 + 1/step_s)
  messages a second;
- ``agent``: as ``node``, but each node's agent (node/agent.py) sends the report
  (an ``AgentReport`` on its own topic), as a run under the supervisor's launchers does;
- ``node``: node aggregation (``aggregate = "node"``, trainer/telemetry.py): each node's
  local rank 0 sends one ``NodeReport`` a second carrying all its ranks (step, phase,
  the age of each rank's slot, last step and busy time), and only global rank 0 sends
  ``StepMetrics``: R / ranks_per_node + 1/step_s messages a second. The generator keeps
  each simulated rank's slot as the trainer does: written when the rank completes a step
  and rewritten every second (its heartbeat slice), so ages are real.

What runs, for each R in ``--ranks`` and each variant (a fresh supervisor process each,
one mosquitto for all, started on a free port and stopped by its pid at the end):

- mosquitto 2.x, with ``sys_interval 1`` so that its own counters ($SYS) say what it
  received, passed on and dropped;
- the supervisor side, a child process of this script (``--role supervisor``) running
  what the daemon runs on its event loop: ``supervisor.telemetry.view.MqttLink`` feeding a
  ``TelemetryView``, and every ``tick_s`` (0.25 s, the daemon's default) the
  reconciler's judgement of the live attempt: ``Observer._observe_attempt`` (the view turned
  into one ``RankObs`` per rank, the launcher reporting every rank UNKNOWN as the Slurm
  launcher does for a running step) and then ``supervisor.policy.decide``, the function
  the reconciler calls. Both share one thread, as in the daemon, so a slow tick delays
  ingestion and the other way round. The store, the API and the Slurm queries are left
  out. Its CPU and RSS are measured from outside with psutil;
- the load generator, a thread of this script: R simulated ranks, ``--ranks-per-node``
  (8) to a node, each sending a ``Heartbeat`` every second and a ``StepMetrics`` every
  ``--step-s`` (both as trainer/telemetry.py sends them), spread evenly: rank r sends in
  the slice r/R of each second (and of each step period), 50 slices a second; in the
  ``node`` variant node i sends its ``NodeReport`` in the slice i/nodes + 1/2 of each
  second instead (half a second after its ranks rewrote their slots, the average for
  unaligned threads). Each rank first sends a ``Register`` (in both variants, as the trainer
  does). Payloads are the wire package's format exactly (checked against
  ``protocol.encode``/``decode`` at start) but are filled into byte templates instead
  of going through ``encode``, and MQTT is spoken directly (CONNECT, QoS 0
  PUBLISH, DISCONNECT; keepalive off) rather than through paho, so that the generator
  costs a few microseconds per message and the 2 cores go to the broker and the
  supervisor. Connections: a pool of at most ``--connections`` (32) TCP connections,
  node i on connection i mod 32. A real job opens one connection per rank (32,768 of
  them); that costs the broker memory and file descriptors but not the supervisor,
  which reads one subscription either way; the broker's per-connection cost is not
  measured here.

The supervisor's step-time window (``STEP_TIMES_KEPT`` values, pooled over the
attempt's ranks) is pre-filled (``--no-prefill`` to skip) so that its tick cost is that
of a run that has trained a while, not of its first seconds: the hang rule sorts that
window each tick to find the p99 step time.

Per R: a warm-up (``--warmup-s``), a steady window (``--window-s``) over which CPU,
RSS and rates are measured, then two faults, each timed from the generator's last
relevant message to the tick at which ``decide`` returns the ``RecordFault``:

- ``hang``: one rank stops completing steps; the others complete one more step and
  then wait for it (a synchronous job); heartbeats (node reports) go on carrying each
  rank's last step. This is what the hang rule judges: no step progress anywhere for
  ``hang_limit`` (max(hang_floor_s 8 s, 3 x p99 step time) once 20 step times are
  known). Timed from the last step completed: the last step-advancing message sent
  (``rank``), the last slot write of an advanced step (``node``; the report that carries
  it goes out up to a second later, dated back by its age).
- ``node_lost``: every rank of one node falls silent (no heartbeat, no step, no node
  report). One silent rank whose node-mates are heard is no fault by itself in the
  policy: silence is judged per node (``silence_timeout_s`` 10 s). Timed from that
  node's last message.

``--hang-floor-s`` and ``--silence-timeout-s`` replace those two limits of the policy
(default: the policy's own, 8 and 10 s); smaller ones make a run short (the smoke test,
tests/integration/test_bench_smoke.py), not a measurement of the default policy.

Output: one JSON object on stdout (progress on stderr). Fields:

    cpu_cores, quick, ranks_per_node, connections_max, step_s, heartbeat_hz, tick_s,
    window_s, warmup_s, prefill, mosquitto (version)
    policy: hang_floor_s, hang_k, silence_timeout_s (the limits the faults are judged by: the
        policy's defaults unless --hang-floor-s or --silence-timeout-s replaced them)
    aggregate: the variants measured
    scaled_to: {variant: the largest R whose steady window was not saturated (see
        ``saturated``), or null}
    results: one object per R: ranks, nodes, then
      summary: {variant: received_ratio, lag_p99_ms, supervisor_cpu_pct, saturated,
        hang_latency_s, node_lost_latency_s, unexpected_faults (how many)}: side by side
      rank, node: one object per variant measured, with the fields below
      aggregate (the variant), ranks, nodes, connections
      expected_per_s: messages a second the schedule calls for (rank: R heartbeats +
        R/step_s steps; node: R/ranks_per_node node reports + 1/step_s steps)
      sent_per_s: {heartbeat, step, node, total} what the generator sent, steady window
      received_per_s: messages the supervisor ingested a second, steady window
      received_ratio: received_per_s / sent_per_s (< 1: falling behind or dropping)
      totals: over the whole R (warm-up, window, faults, then drained for up to 20 s
        after the generator stopped): sent, received, malformed, lost (sent - received),
        broker_received, broker_sent, broker_dropped (mosquitto's own counters)
      supervisor: cpu_pct (of one core, from psutil; 100 = a core saturated), rss_mb (at
        the end of the window), rss_idle_mb (before the run was set up), rss_per_rank_kb,
        cpu_us_per_message (its CPU over the messages ingested; null below 100 of them),
        ingest_pct (CPU in TelemetryView.ingest: decode and apply), tick_pct (CPU in
        the ticks), transport_pct (the rest: aiomqtt/paho reading packets, the event
        loop), tick_ms {p50, max, observe_p50 (Observer._observe_attempt), decide_p50
        (policy.decide), step_time_p99_once (one TelemetryView.step_time_p99 call, which
        every observation makes)}, all CPU time; lag_ms {p50, p99, max} (receipt time
        minus the sender's ``ts``, sampled every 64th message), prefill_s
      load_generator: cpu_pct (its thread's CPU, of one core), late_slices (slices sent
        more than a slice behind schedule: the generator itself fell behind)
      broker: cpu_pct
      bench_process_cpu_pct: this whole script (generator thread included)
      machine: busy_pct (all cores; 100 = every core busy), others_cpu_pct (CPU, of one
        core, used by processes other than the three above: other users of the machine),
        loadavg_1m
      saturated: supervisor cpu_pct >= 90, or received_ratio < 0.98, or lag p99 > 1 s
      hang, node_lost: detected, latency_s, limit_s (the rule's limit), beyond_limit_s
        (latency minus limit: tick, delivery and ingestion delays), blamed_ranks (first
        16) / blamed_nodes (first 8), expected, blamed_ok (the fault named that rank or
        node and nothing else), summary (the fault's own words, first 300 characters);
        when not detected: waited_s
      unexpected_faults: faults found before the two scenarios (should be none): kind,
        nranks, nnodes, summary

Reading it: the ticks and the ingestion share one event loop, and aiomqtt reads one
MQTT packet per loop iteration. While a tick stays well under ``tick_s`` the loop
drains the socket between ticks; once a tick takes longer, the ticks run back to back
and ingestion falls to a few messages per tick, mosquitto drops the backlog
(``broker_dropped``) or cuts the connection, heartbeats stop arriving, and the
silence rule sees nodes go quiet that are alive (``unexpected_faults``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import queue
import signal
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
from mqtt_broker import BrokerCounters, Mosquitto, mosquitto
from mqtt_broker import stop as stop_process

import wire as p
from supervisor.domain import (
    Attempt,
    AttemptObs,
    AttemptState,
    FaultKind,
    Node,
    NodeState,
    Policy,
    ProcState,
    RecordFault,
    Run,
    RunState,
    RunView,
)
from supervisor.gathering.launch_specs import LaunchSpecs
from supervisor.gathering.observe import Observer
from supervisor.gathering.run_memory import RunMemory
from supervisor.launchers.base import RankProc
from supervisor.policy import decide, hang_limit
from supervisor.reconciler import pause_after
from supervisor.spec import RunSpec
from supervisor.telemetry.link import MqttLink
from supervisor.telemetry.view import STEP_TIMES_KEPT, TelemetryView

# The telemetry variants: every rank for itself, node reports from each node's local rank
# 0, or from each node's agent (node/agent.py).
VARIANTS = ("rank", "node", "agent")

RUN_ID, RUN_NUMBER, ATTEMPT = "run-1", 1, 1
SLICES_PER_S = 50
TICK_S = 0.25  # the daemon's default tick (supervisor/config.py)
LAG_SAMPLE_EVERY = 64
DEFAULT_RANKS = "1024,4096,32768"
QUICK_RANKS = "256,2048"


def log(message: str) -> None:
    print(f"[scale {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


# --- the wire: the wire package's payloads from byte templates, raw MQTT 3.1.1 -------------


@dataclass(frozen=True, slots=True)
class Templates:
    """Payload templates with the run and attempt filled in; checked against encode()."""

    register: bytes  # % (rank, ts, local_rank, world_size, node, pid, hostname)
    heartbeat: bytes  # % (rank, ts, step)
    step: bytes  # % (rank, ts, step, step_time_s, tokens_per_s, first_sample)
    node: bytes  # % (rank, ts, node, ranks, steps, phases, ages, step_times, busy): lists without brackets
    agent: bytes  # % (index, ts, node, pid, hostname, ranks, steps, phases, ages, step_times, busy)

    @classmethod
    def for_run(cls, run: str, attempt: int) -> Templates:
        head = b'{"v":1,"kind":"%s","run":"' + run.encode() + b'","attempt":' + str(attempt).encode()
        head += b',"rank":%%d,"ts":%%.6f'
        return cls(
            register=head % b"register" + b',"local_rank":%d,"world_size":%d,"node":"%s","pid":%d,'
                                          b'"hostname":"%s"}',
            heartbeat=head % b"heartbeat" + b',"step":%d,"phase":"train"}',
            step=head % b"step" + b',"step":%d,"loss":2.5,"grad_norm":0.75,"lr":0.0003,"step_time_s":%.4f,'
                                  b'"tokens_per_s":%.1f,"first_sample":%d,"busy_s":"nan","param_norm":"nan",'
                                  b'"mfu":"nan","val_loss":"nan"}',
            node=head % b"node" + b',"node":"%s","ranks":[%s],"steps":[%s],"phases":[%s],"ages":[%s],'
                                  b'"step_times":[%s],"busy":[%s]}',
            agent=(head % b"agent").replace(b'"rank"', b'"index"')
            + b',"node":"%s","pid":%d,"hostname":"%s","ranks":[%s],"steps":[%s],"phases":[%s],"ages":[%s],'
              b'"step_times":[%s],"busy":[%s]}',
        )

    def check(self, run: str, attempt: int) -> None:
        """Each template gives what protocol.encode gives for the same message."""
        ts = 1_700_000_000.25
        hdr: dict[str, Any] = {"run": run, "attempt": attempt, "rank": 7, "ts": ts}
        cases: list[tuple[bytes, p.Message]] = [
            (self.register % (7, ts, 3, 64, b"n00000", 4242, b"n00000"),
             p.Register(**hdr, local_rank=3, world_size=64, node="n00000", pid=4242, hostname="n00000")),
            (self.heartbeat % (7, ts, 12), p.Heartbeat(**hdr, step=12, phase=p.Phase.TRAIN)),
            (self.step % (7, ts, 12, 2.0, 1000.0, 12 * 1024),
             p.StepMetrics(**hdr, step=12, loss=2.5, grad_norm=0.75, lr=0.0003, step_time_s=2.0,
                           tokens_per_s=1000.0, first_sample=12 * 1024, busy_s=float("nan"))),
            (self.node % (7, ts, b"n00000", b"7,8", b"12,11", b'"train","train"', b"0.250,0.000", b"2.0,2.0",
                          b'"nan","nan"'),
             p.NodeReport(**hdr, node="n00000", ranks=(7, 8), steps=(12, 11), phases=(p.Phase.TRAIN,) * 2,
                          ages=(0.25, 0.0), step_times=(2.0, 2.0), busy=(float("nan"),) * 2)),
        ]
        agent_hdr: dict[str, Any] = {"run": run, "attempt": attempt, "index": 7, "ts": ts}
        cases.append((self.agent % (7, ts, b"n00007", 4242, b"n00007", b"56,57", b"12,11", b'"train","train"',
                                    b"0.250,0.000", b"2.0,2.0", b'"nan","nan"'),
                      p.AgentReport(**agent_hdr, node="n00007", pid=4242, hostname="n00007", ranks=(56, 57),
                                    steps=(12, 11), phases=(p.Phase.TRAIN,) * 2, ages=(0.25, 0.0),
                                    step_times=(2.0, 2.0), busy=(float("nan"),) * 2)))
        for payload, msg in cases:
            topic, expected = p.encode(msg)
            assert json.loads(payload) == json.loads(expected), (payload, expected)
            p.decode(payload, topic)  # raises ProtocolError if the receiver would reject it


def remaining_length(n: int) -> bytes:
    """MQTT's variable-length integer."""
    out = bytearray()
    while True:
        n, digit = divmod(n, 128)
        out.append(digit | (0x80 if n else 0))
        if not n:
            return bytes(out)


def mqtt_string(text: str) -> bytes:
    data = text.encode()
    return struct.pack("!H", len(data)) + data


def mqtt_connect(host: str, port: int, client_id: str) -> socket.socket:
    """CONNECT (MQTT 3.1.1, clean session, keepalive off) and wait for a CONNACK accepting it."""
    body = mqtt_string("MQTT") + bytes([4, 0x02]) + struct.pack("!H", 0) + mqtt_string(client_id)
    sock = socket.create_connection((host, port), timeout=10)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.sendall(b"\x10" + remaining_length(len(body)) + body)
    ack = b""
    while len(ack) < 4:
        chunk = sock.recv(4 - len(ack))
        if not chunk:
            raise ConnectionError("broker closed the connection before CONNACK")
        ack += chunk
    if ack[:2] != b"\x20\x02" or ack[3] != 0:
        raise ConnectionError(f"broker refused the connection: {ack!r}")
    sock.settimeout(None)
    return sock


# --- the load generator -------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Layout:
    ranks: int
    ranks_per_node: int

    @property
    def nodes(self) -> list[str]:
        return [f"n{i:05d}" for i in range(-(-self.ranks // self.ranks_per_node))]

    def node_index(self, rank: int) -> int:
        return rank // self.ranks_per_node


def spread(ranks: int, slices: int) -> list[list[int]]:
    """Rank r goes in slice r * slices // ranks: evenly over the period."""
    out: list[list[int]] = [[] for _ in range(slices)]
    for r in range(ranks):
        out[r * slices // ranks].append(r)
    return out


class Generator(threading.Thread):
    """R simulated ranks publishing on a pool of MQTT connections; see the module docstring.

    Controls (from another thread): ``hang(rank)``, ``resume()``, ``silence(node_index)``,
    ``stop()``. Read by others: ``sent``, ``cpu_s``, ``late_slices``, ``last_progress_at``,
    ``node_last_sent``.
    """

    def __init__(self, layout: Layout, broker: Mosquitto, connections: int, step_s: float,
                 aggregate: str = "rank") -> None:
        super().__init__(name="load-generator", daemon=True)
        self.layout, self.broker, self.step_s = layout, broker, step_s
        self.aggregate = aggregate
        nodes = len(layout.nodes)
        self.connections = min(connections, nodes)
        self.templates = Templates.for_run(RUN_ID, ATTEMPT)
        self.sent = {"register": 0, "heartbeat": 0, "step": 0, "node": 0}
        self.cpu_s = 0.0
        self.late_slices = 0
        self.last_progress_at = 0.0  # time.time() of the last step completed (by any rank)
        self.node_last_sent = [0.0] * nodes
        self.connected = threading.Event()
        self.error: BaseException | None = None
        self._halt = threading.Event()
        self._hang_request: int | None = None
        self._freeze: tuple[int, int] | None = None  # (step every rank stops at, the hung rank)
        self._silenced: set[int] = set()

    def hang(self, rank: int) -> None:
        self._hang_request = rank

    def resume(self) -> None:
        self._freeze = None

    def silence(self, node_index: int) -> None:
        self._silenced = {*self._silenced, node_index}

    def stop(self) -> None:
        self._halt.set()
        if self.is_alive():
            self.join(30)

    def run(self) -> None:
        socks: list[socket.socket] = []
        try:
            for i in range(self.connections):
                socks.append(mqtt_connect(self.broker.host, self.broker.port, f"scale-gen-{os.getpid()}-{i}"))
            self.connected.set()
            self._publish(socks)
        except BaseException as e:
            self.error = e
            self.connected.set()
        finally:
            for sock in socks:
                with contextlib.suppress(OSError):
                    sock.sendall(b"\xe0\x00")  # DISCONNECT: a clean goodbye
                sock.close()

    def _topics(self, kind: str) -> list[bytes]:
        return [mqtt_string(p.topic_for(RUN_ID, ATTEMPT, r, kind)) for r in range(self.layout.ranks)]

    def _publish(self, socks: list[socket.socket]) -> None:
        layout, t = self.layout, self.templates
        ranks, per_node = layout.ranks, layout.ranks_per_node
        nodes = layout.nodes
        conn_of = [layout.node_index(r) % len(socks) for r in range(ranks)]
        topic_reg, topic_hb = self._topics("register"), self._topics("heartbeat")
        topic_step = self._topics("step")
        per_step = max(1, round(self.step_s * SLICES_PER_S))
        hb_slots, step_slots = spread(ranks, SLICES_PER_S), spread(ranks, per_step)
        tokens_per_s = 1024 * 4096 / self.step_s
        last_step = [0] * ranks
        bufs = [bytearray() for _ in socks]
        sent, node_last = self.sent, self.node_last_sent
        # The node variant: each rank's slot (written at its steps and rewritten each
        # second), read by its node's local rank 0, whose report goes out in its own slice.
        by_node = self.aggregate in ("node", "agent")  # the ranks keep slots; a node report carries them
        by_agent = self.aggregate == "agent"
        written_at = [time.time()] * ranks
        # Reports go out half a second after the node's ranks rewrite their slots (as
        # unaligned threads would on average): a report's ages are 0.5 s, not 0.
        report_slots = spread(len(nodes), SLICES_PER_S)
        half = SLICES_PER_S // 2
        report_slots = report_slots[half:] + report_slots[:half]
        topic_node = [mqtt_string(p.topic_for(RUN_ID, ATTEMPT, f"n{n}", "agent") if by_agent
                                  else p.topic_for(RUN_ID, ATTEMPT, n * per_node, "node"))
                      for n in range(len(nodes))]
        node_ranks = [range(n * per_node, min(ranks, (n + 1) * per_node)) for n in range(len(nodes))]
        phases = [b",".join([b'"train"'] * len(rs)) for rs in node_ranks]
        step_times = [b",".join([b"%.1f" % self.step_s] * len(rs)) for rs in node_ranks]
        busy = [b",".join([b'"nan"'] * len(rs)) for rs in node_ranks]

        def put(rank: int, topic: bytes, payload: bytes) -> None:
            buf = bufs[conn_of[rank]]
            buf.append(0x30)  # PUBLISH, QoS 0
            buf += remaining_length(len(topic) + len(payload))
            buf += topic
            buf += payload

        started = time.monotonic()
        k = 0
        while not self._halt.is_set():
            delay = started + k / SLICES_PER_S - time.monotonic()
            if delay > 0:
                self._halt.wait(delay)
            elif delay < -1 / SLICES_PER_S:
                self.late_slices += 1
            now = time.time()
            period = k // per_step
            cap, hung = self._step_cap(period)
            silenced = self._silenced
            if k < SLICES_PER_S:  # the first second: each rank registers before its first heartbeat
                for r in hb_slots[k]:
                    node = nodes[r // per_node].encode()
                    put(r, topic_reg[r], t.register % (r, now, r % per_node, ranks, node, 100_000 + r, node))
                    sent["register"] += 1
            for r in step_slots[k % per_step]:
                n = r // per_node
                step = min(period + 1, cap - (r == hung))
                if n in silenced or step <= last_step[r]:
                    continue
                last_step[r] = step
                written_at[r] = self.last_progress_at = now
                if by_node and r != 0:  # only global rank 0 sends its steps (its loss)
                    continue
                put(r, topic_step[r], t.step % (r, now, step, self.step_s, tokens_per_s, step * 1024))
                sent["step"] += 1
                node_last[n] = now
            for r in hb_slots[k % SLICES_PER_S]:
                n = r // per_node
                if n in silenced:
                    continue
                if by_node:
                    written_at[r] = now  # the rank's sender thread rewrites its slot
                    continue
                put(r, topic_hb[r], t.heartbeat % (r, now, last_step[r]))
                sent["heartbeat"] += 1
                node_last[n] = now
            for n in report_slots[k % SLICES_PER_S] if by_node else ():
                if n in silenced:
                    continue
                rs = node_ranks[n]
                lists = (b",".join(b"%d" % r for r in rs), b",".join(b"%d" % last_step[r] for r in rs),
                         phases[n], b",".join(b"%.3f" % max(0.0, now - written_at[r]) for r in rs),
                         step_times[n], busy[n])
                name = nodes[n].encode()
                payload = (t.agent % (n, now, name, 200_000 + n, name, *lists) if by_agent
                           else t.node % (rs[0], now, name, *lists))
                put(rs[0], topic_node[n], payload)
                sent["node"] += 1
                node_last[n] = now
            for sock, buf in zip(socks, bufs, strict=True):
                if buf:
                    sock.sendall(buf)
                    buf.clear()
            k += 1
            self.cpu_s = time.thread_time()

    def _step_cap(self, period: int) -> tuple[int, int]:
        """(the step no rank goes beyond, the hung rank or -1). A hang asked for in step
        period P: every rank completes step P + 2 except the hung one, which stops at P + 1."""
        if self._hang_request is not None:
            self._freeze, self._hang_request = (period + 2, self._hang_request), None
        if self._freeze is None:
            return 2**62, -1
        return self._freeze


# --- the supervisor side (a child process: --role supervisor) ---------------------------


class TimedView(TelemetryView):
    """The daemon's TelemetryView, timing ``ingest`` (CPU) and sampling the delivery lag."""

    def __init__(self) -> None:
        super().__init__()
        self.ingest_s = 0.0
        self.lags: list[float] = []
        self._seen = 0

    def ingest(self, topic: str, payload: bytes | str, now: float) -> None:
        began = time.thread_time()  # CPU time: other processes on the cores do not count
        TelemetryView.ingest(self, topic, payload, now)
        self.ingest_s += time.thread_time() - began
        self._seen += 1
        if self._seen % LAG_SAMPLE_EVERY == 0:
            with contextlib.suppress(ValueError, KeyError, TypeError):
                self.lags.append(now - float(json.loads(payload)["ts"]))


class SlurmLikeLauncher:
    """What the observer asks of a launcher: every rank of a running Slurm step is
    UNKNOWN (not observable, never treated as dead); liveness comes from telemetry."""

    def __init__(self) -> None:
        self.procs: list[RankProc] = []

    def observe(self, launch_info: str) -> list[RankProc]:
        return self.procs


class Judge:
    """The reconciler's judgement of one live attempt, every tick: observe, then decide."""

    def __init__(self, view: TimedView, mqtt_url: str, run_dir: Path) -> None:
        self.view = view
        self.launcher = SlurmLikeLauncher()
        # Only the live attempt's observation is used: it reads the launcher and the telemetry
        # view, never the store nor the probes.
        self.observer = Observer(None, self.launcher, view, RunMemory(None),  # type: ignore[arg-type]
                                 LaunchSpecs(view, mqtt_url=mqtt_url), probing=lambda _: False,
                                 clock=time.time)
        self.spec = RunSpec(name="scale", trainer={"steps": 10**9})
        self.run_dir = run_dir
        self.run_view: RunView | None = None
        self.said: set[tuple[str, tuple[str, ...]]] = set()  # (kind, nodes) of the faults reported
        self.tick_times: list[tuple[float, float]] = []  # CPU seconds in (observe, decide)

    def setup(self, ranks: int, ranks_per_node: int, step_s: float, prefill: bool,
              policy: Policy) -> dict[str, Any]:
        now = time.time()
        layout = Layout(ranks, ranks_per_node)
        nodes = layout.nodes
        self.launcher.procs = [RankProc(rank=r, node=nodes[layout.node_index(r)], proc=ProcState.UNKNOWN)
                               for r in range(ranks)]
        began = time.perf_counter()
        if prefill:
            self._prefill(layout, step_s, now)
        run = Run(number=RUN_NUMBER, name="scale", state=RunState.RUNNING, reason="", nodes=len(nodes),
                  ranks_per_node=ranks_per_node, spares=0, total_steps=10**9, policy=policy,
                  created_at=now, started_at=now)
        attempt = Attempt(run_number=RUN_NUMBER, number=ATTEMPT, state=AttemptState.RUNNING,
                          nodes=tuple(nodes), resume_from=None, resume_step=0, created_at=now, started_at=now,
                          first_step_at=now, launch_info="scale-bench")
        allocation = tuple(Node(name=n, state=NodeState.ALLOCATED, run_number=RUN_NUMBER) for n in nodes)
        self.run_view = RunView(run=run, attempts=(attempt,), allocation=allocation, newest_checkpoint=None)
        prefill_s = time.perf_counter() - began
        began = time.thread_time()
        self.view.step_time_p99(RUN_ID, ATTEMPT)  # what every tick's observation computes
        return {"prefill_s": round(prefill_s, 2), "p99_cpu_s": time.thread_time() - began}

    def _prefill(self, layout: Layout, step_s: float, now: float) -> None:
        """Each rank registered, and a full window of step times (as after a while of training)."""
        nodes = layout.nodes
        for r in range(layout.ranks):
            node = nodes[layout.node_index(r)]
            register = p.Register(run=RUN_ID, attempt=ATTEMPT, rank=r, ts=now,
                                  local_rank=r % layout.ranks_per_node, world_size=layout.ranks,
                                  node=node, pid=100_000 + r, hostname=node)
            self.view.apply(register, now)
        for i in range(STEP_TIMES_KEPT):
            self.view.add_step_time(RUN_ID, ATTEMPT, step_s * (1 + (i % 50) / 1000))

    def rearm(self) -> None:
        """After a fault: forget what was said, and start the attempt's clock afresh."""
        assert self.run_view is not None
        now = time.time()
        attempt = self.run_view.attempts[0]
        fresh = Attempt(run_number=attempt.run_number, number=attempt.number, state=attempt.state,
                        nodes=attempt.nodes, resume_from=None, resume_step=0, created_at=attempt.created_at,
                        started_at=now, first_step_at=now, launch_info=attempt.launch_info)
        self.run_view = RunView(run=self.run_view.run, attempts=(fresh,), allocation=self.run_view.allocation,
                                newest_checkpoint=None)
        self.said.clear()

    def tick(self) -> None:
        now = time.time()
        # What the recorder would store in SQLite (rank 0's steps): dropped here.
        self.view.drop_durable(len(self.view.peek_durable()))
        if self.run_view is None:
            return
        began = time.thread_time()
        live = self.run_view.attempts[0]
        run = self.run_view.run
        self.view.expect(RUN_ID, live.number, len(live.nodes) * run.ranks_per_node)  # as the feed tells it
        obs = self.observer._observe_attempt(run, self.spec, self.run_dir, live, now)
        assert obs is not None
        observed = time.thread_time()
        effects = decide(self.run_view, obs, now)
        self.tick_times.append((observed - began, time.thread_time() - observed))
        for effect in effects:
            if isinstance(effect, RecordFault) and (str(effect.kind), effect.nodes) not in self.said:
                self.said.add((str(effect.kind), effect.nodes))
                self._report(effect, obs, now)

    def _report(self, fault: RecordFault, obs: AttemptObs, now: float) -> None:
        assert self.run_view is not None
        policy = self.run_view.run.policy
        limit = hang_limit(policy, obs, True)[0] if fault.kind is FaultKind.HANG else policy.silence_timeout_s
        emit({"event": "fault", "kind": str(fault.kind), "at": now, "limit_s": limit,
              "ranks": list(fault.ranks[:16]), "nranks": len(fault.ranks), "nodes": list(fault.nodes[:8]),
              "nnodes": len(fault.nodes), "summary": fault.summary[:300]})

    async def tick_forever(self) -> None:
        """Like the daemon's _reconcile_forever: a tick, then the daemon's pause (what is left
        of tick_s, and never less than keeps the ticks to their share of the time)."""
        while True:
            began = time.monotonic()
            self.tick()
            await asyncio.sleep(pause_after(TICK_S, time.monotonic() - began))

    def stats(self) -> dict[str, Any]:
        """Cumulative counters; the tick times and lags since the last call."""
        parts, self.tick_times = self.tick_times, []
        ticks = [a + b for a, b in parts]
        lags, self.view.lags = self.view.lags, []
        return {"event": "stats", "counts": dict(self.view.counts), "ingest_s": self.view.ingest_s,
                "ticks": len(ticks), "tick_total_s": sum(ticks), "tick_p50_s": _median(ticks),
                "tick_max_s": max(ticks, default=0.0), "observe_p50_s": _median([a for a, _ in parts]),
                "decide_p50_s": _median([b for _, b in parts]), "lag_p50_s": _median(lags),
                "lag_p99_s": _quantile(lags, 0.99), "lag_max_s": max(lags, default=0.0), "lags": len(lags),
                "up": self.view.up_since is not None}


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else 0.0


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))] if ordered else 0.0


def emit(event: dict[str, Any]) -> None:
    print(json.dumps(event), flush=True)


async def supervise(port: int) -> None:
    """The child: MqttLink + ticks on one event loop; commands on stdin, events on stdout."""
    loop = asyncio.get_running_loop()
    commands: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue()

    def read_stdin() -> None:
        for line in sys.stdin:
            loop.call_soon_threadsafe(commands.put_nowait, json.loads(line))
        loop.call_soon_threadsafe(commands.put_nowait, None)  # the parent is gone

    view = TimedView()
    with tempfile.TemporaryDirectory(prefix="scale-sup-") as run_dir:
        judge = Judge(view, f"mqtt://127.0.0.1:{port}", Path(run_dir))
        link = MqttLink(p.parse_broker_url(f"mqtt://127.0.0.1:{port}"), view, time.time,
                        client_id=f"bench-supervisor-{os.getpid()}")
        tasks = [asyncio.create_task(link.run()), asyncio.create_task(judge.tick_forever())]
        threading.Thread(target=read_stdin, daemon=True).start()
        while view.up_since is None:
            await asyncio.sleep(0.05)
        emit({"event": "ready"})
        while (cmd := await commands.get()) is not None and cmd["cmd"] != "quit":
            if cmd["cmd"] == "setup":
                emit({"event": "setup", **judge.setup(cmd["ranks"], cmd["ranks_per_node"], cmd["step_s"],
                                                      cmd["prefill"], policy_of(cmd["policy"]))})
            elif cmd["cmd"] == "rearm":
                judge.rearm()
                emit({"event": "rearmed"})
            elif cmd["cmd"] == "stats":
                emit(judge.stats())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


class SupervisorProc:
    """The parent's handle on the supervisor child."""

    def __init__(self, port: int) -> None:
        self.proc = subprocess.Popen([sys.executable, __file__, "--role", "supervisor", "--port", str(port)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.ps = psutil.Process(self.proc.pid)
        self.faults: list[dict[str, Any]] = []
        self._events: queue.Queue[dict[str, Any]] = queue.Queue()
        self._lock = threading.Lock()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            event = json.loads(line)
            if event["event"] == "fault":
                with self._lock:
                    self.faults.append(event)
            else:
                self._events.put(event)

    def expect(self, event: str, timeout_s: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                got = self._events.get(timeout=0.5)
            except queue.Empty:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"the supervisor child exited ({self.proc.returncode})") from None
                if time.monotonic() > deadline:
                    raise TimeoutError(f"no {event!r} from the supervisor child in {timeout_s} s") from None
                continue
            if got["event"] == event:
                return got

    def request(self, cmd: dict[str, Any], event: str, timeout_s: float = 120) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return self.expect(event, timeout_s)

    def stats(self) -> dict[str, Any]:
        return self.request({"cmd": "stats"}, "stats")

    def fault_count(self) -> int:
        with self._lock:
            return len(self.faults)

    def wait_fault(self, kind: str, timeout_s: float, after: int) -> dict[str, Any] | None:
        """The first fault of ``kind`` among those reported after the first ``after``."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with self._lock:
                found = [f for f in self.faults[after:] if f["kind"] == kind]
            if found:
                return found[0]
            time.sleep(0.05)
        return None

    def close(self) -> None:
        with contextlib.suppress(OSError, ValueError):
            assert self.proc.stdin is not None
            self.proc.stdin.write(json.dumps({"cmd": "quit"}) + "\n")
            self.proc.stdin.close()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            stop_process(self.proc)


# --- measuring ------------------------------------------------------------------------------


def cpu_s(proc: psutil.Process) -> float:
    t = proc.cpu_times()
    return float(t.user + t.system)


@dataclass
class Snapshot:
    at: float
    supervisor_cpu: float
    broker_cpu: float
    bench_cpu: float
    generator_cpu: float
    sent: dict[str, int]
    stats: dict[str, Any]
    machine: Any
    rss: int = 0

    @classmethod
    def take(cls, sup: SupervisorProc, broker: psutil.Process, gen: Generator) -> Snapshot:
        return cls(at=time.monotonic(), supervisor_cpu=cpu_s(sup.ps), broker_cpu=cpu_s(broker),
                   bench_cpu=cpu_s(psutil.Process()), generator_cpu=gen.cpu_s, sent=dict(gen.sent),
                   stats=sup.stats(), machine=psutil.cpu_times(), rss=sup.ps.memory_info().rss)


def received(stats: dict[str, Any]) -> int:
    return int(stats["counts"].get("received", 0))


def expected_per_s(layout: Layout, step_s: float, aggregate: str) -> float:
    """Messages a second the schedule calls for, registers left out."""
    if aggregate in ("node", "agent"):
        return len(layout.nodes) + 1 / step_s
    return layout.ranks * (1 + 1 / step_s)


def steady_state(a: Snapshot, b: Snapshot, layout: Layout, step_s: float, aggregate: str) -> dict[str, Any]:
    """Rates, CPU and memory between two snapshots."""
    dt = b.at - a.at
    sent = {k: (b.sent[k] - a.sent[k]) / dt for k in ("heartbeat", "step", "node")}
    sent_total = sum(b.sent.values()) - sum(a.sent.values())
    got = received(b.stats) - received(a.stats)
    sup_pct = 100 * (b.supervisor_cpu - a.supervisor_cpu) / dt
    ingest_pct = 100 * (b.stats["ingest_s"] - a.stats["ingest_s"]) / dt
    tick_pct = 100 * b.stats["tick_total_s"] / dt
    broker_pct = 100 * (b.broker_cpu - a.broker_cpu) / dt
    bench_pct = 100 * (b.bench_cpu - a.bench_cpu) / dt
    busy = _machine_busy(a.machine, b.machine)
    cores = psutil.cpu_count() or 1
    ratio = got / sent_total if sent_total else 0.0
    sup_cpu = b.supervisor_cpu - a.supervisor_cpu
    return {
        "expected_per_s": round(expected_per_s(layout, step_s, aggregate)),
        "sent_per_s": {**{k: round(v) for k, v in sent.items()}, "total": round(sent_total / dt)},
        "received_per_s": round(got / dt),
        "received_ratio": round(ratio, 4),
        "supervisor": {
            "cpu_pct": round(sup_pct, 1),
            "rss_mb": round(b.rss / 2**20, 1),
            "cpu_us_per_message": round(1e6 * sup_cpu / got, 1) if got >= 100 else None,
            "ingest_pct": round(ingest_pct, 1),
            "tick_pct": round(tick_pct, 1),
            "transport_pct": round(max(0.0, sup_pct - ingest_pct - tick_pct), 1),
            "tick_ms": {name: round(1e3 * b.stats[f"{key}_s"], 1) for name, key in (
                ("p50", "tick_p50"), ("max", "tick_max"), ("observe_p50", "observe_p50"),
                ("decide_p50", "decide_p50"))},
            "lag_ms": {q: round(1e3 * b.stats[f"lag_{q}_s"], 1) for q in ("p50", "p99", "max")},
        },
        "load_generator": {"cpu_pct": round(100 * (b.generator_cpu - a.generator_cpu) / dt, 1)},
        "broker": {"cpu_pct": round(broker_pct, 1)},
        "bench_process_cpu_pct": round(bench_pct, 1),
        "machine": {"busy_pct": round(busy, 1),
                    "others_cpu_pct": round(max(0.0, busy * cores - sup_pct - broker_pct - bench_pct), 1),
                    "loadavg_1m": round(os.getloadavg()[0], 2)},
    }


def _machine_busy(a: Any, b: Any) -> float:
    idle = (b.idle - a.idle) + (getattr(b, "iowait", 0.0) - getattr(a, "iowait", 0.0))
    total = sum(b) - sum(a)
    return 100 * (1 - idle / total) if total > 0 else 0.0


def fault_result(fault: dict[str, Any] | None, since: float, expected: Any, blamed_key: str,
                 waited_s: float) -> dict[str, Any]:
    if fault is None:
        return {"detected": False, "waited_s": round(waited_s), "expected": expected}
    latency = fault["at"] - since
    blamed = fault[blamed_key]
    return {"detected": True, "latency_s": round(latency, 2), "limit_s": fault["limit_s"],
            "beyond_limit_s": round(latency - fault["limit_s"], 2), f"blamed_{blamed_key}": blamed,
            "expected": expected, "blamed_ok": blamed == [expected] and fault[f"n{blamed_key}"] == 1,
            "summary": fault["summary"]}


def hang_scenario(sup: SupervisorProc, gen: Generator, layout: Layout, step_s: float,
                  policy: Policy) -> dict[str, Any]:
    hung = layout.ranks // 2 + 1
    log(f"  hang: rank {hung} stops completing steps")
    after = sup.fault_count()
    gen.hang(hung)
    # the limit is max(hang_floor_s, hang_k x p99 step time): allow for both, and a margin
    wait_s = 2 * step_s + max(policy.hang_floor_s, policy.hang_k * step_s) + 40
    fault = sup.wait_fault(str(FaultKind.HANG), wait_s, after)
    result = fault_result(fault, gen.last_progress_at, hung, "ranks", wait_s)
    gen.resume()
    time.sleep(step_s + 0.5)  # progress again before the clock restarts
    sup.request({"cmd": "rearm"}, "rearmed")
    return result


def node_lost_scenario(sup: SupervisorProc, gen: Generator, layout: Layout, policy: Policy) -> dict[str, Any]:
    index = len(layout.nodes) - 1
    node = layout.nodes[index]
    log(f"  node_lost: every rank of {node} falls silent")
    after = sup.fault_count()
    gen.silence(index)
    wait_s = policy.silence_timeout_s + 40
    fault = sup.wait_fault(str(FaultKind.NODE_LOST), wait_s, after)
    return fault_result(fault, gen.node_last_sent[index], node, "nodes", wait_s)


def drain(sup: SupervisorProc, sent: int, limit_s: float = 20) -> dict[str, Any]:
    """Wait until the supervisor has everything, or stops receiving for 2 s; its last stats."""
    deadline = time.monotonic() + limit_s
    stats = sup.stats()
    quiet_since = time.monotonic()
    while time.monotonic() < deadline and received(stats) < sent:
        time.sleep(0.5)
        latest = sup.stats()
        if received(latest) != received(stats):
            quiet_since = time.monotonic()
        elif time.monotonic() - quiet_since > 2:
            return latest
        stats = latest
    return stats


def measure(ranks: int, aggregate: str, broker: Mosquitto, counters: BrokerCounters,
            args: argparse.Namespace) -> dict[str, Any]:
    layout = Layout(ranks, args.ranks_per_node)
    log(f"R={ranks}, aggregate={aggregate}: {len(layout.nodes)} nodes")
    broker_ps = psutil.Process(broker.pid)
    sys_before = counters.snapshot()
    with contextlib.ExitStack() as stack:
        sup = SupervisorProc(broker.port)
        stack.callback(sup.close)
        sup.expect("ready", 60)
        rss_idle = sup.ps.memory_info().rss
        setup = sup.request({"cmd": "setup", "ranks": ranks, "ranks_per_node": args.ranks_per_node,
                             "step_s": args.step_s, "prefill": not args.no_prefill,
                             "policy": policy_overrides(args)}, "setup", 600)
        gen = Generator(layout, broker, args.connections, args.step_s, aggregate)
        gen.start()
        stack.callback(gen.stop)
        gen.connected.wait(60)
        if gen.error is not None:
            raise RuntimeError(f"load generator failed: {gen.error!r}")
        time.sleep(args.warmup_s)
        log(f"  steady window: {args.window_s} s")
        first = Snapshot.take(sup, broker_ps, gen)
        time.sleep(args.window_s)
        last = Snapshot.take(sup, broker_ps, gen)
        result: dict[str, Any] = {"aggregate": aggregate, "ranks": ranks, "nodes": len(layout.nodes),
                                  "connections": gen.connections,
                                  **steady_state(first, last, layout, args.step_s, aggregate)}
        result["load_generator"]["late_slices"] = gen.late_slices
        sup_info = result["supervisor"]
        sup_info["rss_idle_mb"] = round(rss_idle / 2**20, 1)
        sup_info["rss_per_rank_kb"] = round((last.rss - rss_idle) / ranks / 1024, 2)
        sup_info["prefill_s"] = setup["prefill_s"]
        sup_info["tick_ms"]["step_time_p99_once"] = round(1e3 * setup["p99_cpu_s"], 1)
        unexpected = list(sup.faults)
        policy = policy_of(policy_overrides(args))
        result["hang"] = hang_scenario(sup, gen, layout, args.step_s, policy)
        result["node_lost"] = node_lost_scenario(sup, gen, layout, policy)
        gen.stop()
        if gen.error is not None:
            raise RuntimeError(f"load generator failed: {gen.error!r}")
        sent_total = sum(gen.sent.values())
        final = drain(sup, sent_total)
    time.sleep(1.5)  # a fresh $SYS sample (sys_interval 1)
    sys_after = counters.snapshot()
    got = received(final)
    malformed = int(final["counts"].get("malformed", 0))
    result["totals"] = {"sent": sent_total, "received": got, "malformed": malformed,
                        "lost": sent_total - got - malformed,
                        **{f"broker_{k}": sys_after.get(k, 0) - sys_before.get(k, 0)
                           for k in ("received", "sent", "dropped")}}
    result["saturated"] = (sup_info["cpu_pct"] >= 90 or result["received_ratio"] < 0.98
                           or sup_info["lag_ms"]["p99"] > 1000)
    result["unexpected_faults"] = [{k: f[k] for k in ("kind", "nranks", "nnodes", "summary")}
                                   for f in unexpected]
    log(f"  supervisor {sup_info['cpu_pct']} % CPU, received {result['received_per_s']} of "
        f"{result['sent_per_s']['total']} msgs/s; detected hang in {result['hang'].get('latency_s')} s, "
        f"node_lost in {result['node_lost'].get('latency_s')} s")
    return result


def side_by_side(result: dict[str, Any]) -> dict[str, Any]:
    """The few numbers that say whether a variant kept up, for the summary."""
    return {"received_ratio": result["received_ratio"], "lag_p99_ms": result["supervisor"]["lag_ms"]["p99"],
            "supervisor_cpu_pct": result["supervisor"]["cpu_pct"], "saturated": result["saturated"],
            "hang_latency_s": result["hang"].get("latency_s"),
            "node_lost_latency_s": result["node_lost"].get("latency_s"),
            "unexpected_faults": len(result["unexpected_faults"])}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--ranks", help=f"comma-separated rank counts (default {DEFAULT_RANKS}; "
                                        f"--quick: {QUICK_RANKS})")
    parser.add_argument("--quick", action="store_true", help="short windows and small R: about 4 minutes")
    parser.add_argument("--aggregate", default=",".join(VARIANTS),
                        help="comma-separated telemetry variants to measure at each R: rank, node, agent "
                             "(default all three)")
    parser.add_argument("--ranks-per-node", type=int, default=8)
    parser.add_argument("--connections", type=int, default=32, help="most MQTT connections of the generator")
    parser.add_argument("--step-s", type=float, default=2.0,
                        help="simulated step time: a StepMetrics per rank per step")
    parser.add_argument("--window-s", type=float, help="steady window (default 30; --quick 8)")
    parser.add_argument("--warmup-s", type=float, help="before the window (default 5; --quick 3)")
    parser.add_argument("--no-prefill", action="store_true",
                        help="start the supervisor with empty step-time windows")
    parser.add_argument("--hang-floor-s", type=float, default=Policy().hang_floor_s,
                        help="the policy's hang_floor_s the hang is judged by (default the policy's, "
                             "%(default)s)")
    parser.add_argument("--silence-timeout-s", type=float, default=Policy().silence_timeout_s,
                        help="the policy's silence_timeout_s the lost node is judged by (default the "
                             "policy's, %(default)s)")
    parser.add_argument("--role", choices=["bench", "supervisor"], default="bench", help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.ranks = [int(x) for x in (args.ranks or (QUICK_RANKS if args.quick else DEFAULT_RANKS)).split(",")]
    args.aggregate = [x.strip() for x in args.aggregate.split(",") if x.strip()]
    if not args.aggregate or any(x not in VARIANTS for x in args.aggregate):
        parser.error(f"--aggregate: expected a comma-separated choice of {', '.join(VARIANTS)}")
    args.window_s = args.window_s or (8.0 if args.quick else 30.0)
    args.warmup_s = args.warmup_s or (3.0 if args.quick else 5.0)
    return args


def policy_overrides(args: argparse.Namespace) -> dict[str, float]:
    """The Policy fields set on the command line (the rest are the policy's defaults)."""
    return {"hang_floor_s": args.hang_floor_s, "silence_timeout_s": args.silence_timeout_s}


def policy_of(overrides: dict[str, float]) -> Policy:
    """The default Policy with the fields of ``policy_overrides`` replaced."""
    return Policy(hang_floor_s=overrides["hang_floor_s"], silence_timeout_s=overrides["silence_timeout_s"])


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.role == "supervisor":
        asyncio.run(supervise(args.port))
        return
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # clean up (finally blocks) on SIGTERM too
    Templates.for_run(RUN_ID, ATTEMPT).check(RUN_ID, ATTEMPT)
    policy = policy_of(policy_overrides(args))
    report: dict[str, Any] = {
        "cpu_cores": psutil.cpu_count(), "quick": args.quick, "ranks_per_node": args.ranks_per_node,
        "connections_max": args.connections, "step_s": args.step_s, "heartbeat_hz": 1, "tick_s": TICK_S,
        "window_s": args.window_s, "warmup_s": args.warmup_s, "prefill": not args.no_prefill,
        "policy": {"hang_floor_s": policy.hang_floor_s, "hang_k": policy.hang_k,
                   "silence_timeout_s": policy.silence_timeout_s},
        "aggregate": args.aggregate,
    }
    with (tempfile.TemporaryDirectory(prefix="scale-bench-") as tmp,
          mosquitto(Path(tmp), sys_interval=1) as broker):
        report["mosquitto"] = broker.version
        counters = BrokerCounters(broker)
        results: list[dict[str, Any]] = []
        try:
            for r in args.ranks:
                variants = {a: measure(r, a, broker, counters, args) for a in args.aggregate}
                results.append({"ranks": r, "nodes": len(Layout(r, args.ranks_per_node).nodes),
                                "summary": {a: side_by_side(v) for a, v in variants.items()}, **variants})
        finally:
            counters.close()
    report["scaled_to"] = {}
    for a in args.aggregate:
        fine = [r["ranks"] for r in results if not r[a]["saturated"]]
        report["scaled_to"][a] = max(fine) if fine else None
    report["results"] = results
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()

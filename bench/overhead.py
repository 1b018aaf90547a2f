"""Trainer step time with telemetry on and off, and the training stall per checkpoint save.

    python bench/overhead.py [--ranks 2] [--steps 200] [--checkpoint-every 50] [--repeats 3]
    python bench/overhead.py --quick      # 2 ranks, 40 steps, two pairs of runs: about 1 minute

Runs the reference trainer (``python -m trainer``, the ``tiny`` model, gloo on CPU) as
``--ranks`` local processes with torchrun-style variables, the way
bench/trainer_step_time.py does (its parsing of rank 0's progress lines is imported
from there), in two modes, ``--repeats`` times each, alternating which mode goes first:

- ``off``: no TSUP_* variable set, so ``Telemetry`` is the no-op publisher;
- ``on``: TSUP_MQTT_URL points at a real mosquitto started by this script on a free
  port (stopped by its pid at the end), so every rank publishes its step metrics,
  phases and 1 Hz heartbeats. A subscriber here counts what arrives, to show that
  telemetry really flowed.

Two per-step times, the first ``--warmup`` steps left out, pooled over the repeats of
a mode:

- ``step_time_ms``: the trainer's own ``step_time_s`` (data, forward, backward,
  optimizer and the loss all-reduce), from rank 0's progress line, which prints it to
  the millisecond;
- ``step_period_ms``: the time from one progress line to the next (stamped on
  arrival here, microseconds), periods that contain a save left out. It also holds
  what the training thread does between steps, the telemetry call included, and is
  the one that sets throughput.

Telemetry costs the training thread one non-blocking queue put a step; its sender
thread (and paho's) compete for the GIL and the cores, which shows in both times.

Stall per checkpoint: the save is synchronous (trainer/train.py ``_save`` calls
trainer/checkpoint.py ``save`` on the training thread: a barrier, the DCP write, a
barrier, the commit), so the training thread and every rank wait for all of it. Two
measures of it:

- ``reported_ms``: what the trainer reports, ``SaveResult.duration_s`` (first barrier
  to commit), from rank 0's "checkpoint step N committed ... in X s" line; the same
  number travels in the ``checkpoint`` telemetry message (``telemetry.checkpoint_ms``);
- ``blocked_ms``: derived, and covering everything between two steps: the time between
  the progress lines of the checkpoint step N and of step N + 1 (stamped on arrival
  here), less step N + 1's own step_time_s, less the same gap's median over ordinary
  steps (``between_steps_ms``: printing, reporting, the loop). The final step's save
  has no next step and only a reported time.

Output: one JSON object on stdout (progress on stderr). Fields:

    ranks, steps, checkpoint_every, global_batch, warmup_steps, repeats, cpu_cores,
    loadavg_1m (at the end: other users of the machine), mosquitto (version)
    step_time_ms, step_period_ms: {off, on}: {p50, p90, n} over the steps of every run
        of that mode
    telemetry_overhead: {step_time, step_period}: {ms, pct}: on p50 minus off p50,
        absolute and relative to off
    runs: one per trainer run, in order: mode, step_time_p50_ms, step_period_p50_ms,
        wall_s (process start to exit; the first run also pays the cold imports),
        exit_codes (every rank's), trainers_cpu_pct (all ranks, of one core, over the
        run), others_cpu_pct (the rest of the machine's busy CPU, mosquitto and this
        script left out: other users; on a shared machine, compare runs with little)
    checkpoint: {off, on}: reported_ms (every save, in order), blocked_ms (every save
        but the last), blocked_p50_ms, between_steps_ms
    telemetry: what the subscriber received over all ``on`` runs: received {kind:
        count}, step_messages_expected (ranks x steps x repeats), checkpoint_ms (the
        duration_s of each ``checkpoint`` message)
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import paho.mqtt.client as mqtt
import psutil
from mqtt_broker import Mosquitto, mosquitto
from mqtt_broker import stop as stop_process
from paho.mqtt.enums import CallbackAPIVersion
from trainer_step_time import REPO, SAVE_LINE, STEP_LINE, free_port, percentile

import wire as protocol

RUN_PREFIX = "bench-overhead"


def log(message: str) -> None:
    print(f"[overhead {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


@dataclass
class TrainerRun:
    mode: str  # "on" or "off"
    lines: list[tuple[float, str]]  # rank 0's stdout, each line with its arrival (time.monotonic())
    exit_codes: list[int]
    wall_s: float
    cpu: dict[str, float]  # CpuWindow.stop()


def cpu_s(proc: psutil.Process) -> float:
    times = proc.cpu_times()
    return float(times.user + times.system)


class CpuWindow:
    """CPU over a run: the trainers' (reaped children), and everyone else's on the machine."""

    def __init__(self, broker: psutil.Process) -> None:
        self.broker = broker
        self.broker_cpu = cpu_s(broker)
        self.machine = psutil.cpu_times()
        self.me = cpu_s(psutil.Process())
        self.children = resource.getrusage(resource.RUSAGE_CHILDREN)
        self.started = time.monotonic()

    def stop(self) -> dict[str, float]:
        wall = time.monotonic() - self.started
        machine, children = psutil.cpu_times(), resource.getrusage(resource.RUSAGE_CHILDREN)
        total = sum(machine) - sum(self.machine)
        idle = (machine.idle - self.machine.idle) + (getattr(machine, "iowait", 0.0)
                                                     - getattr(self.machine, "iowait", 0.0))
        busy_cores = (total - idle) / total * (psutil.cpu_count() or 1) if total > 0 else 0.0
        trainers = (children.ru_utime + children.ru_stime) - (self.children.ru_utime + self.children.ru_stime)
        me = cpu_s(psutil.Process()) - self.me
        others = busy_cores * wall - trainers - me - (cpu_s(self.broker) - self.broker_cpu)
        return {"trainers_cpu_pct": round(100 * trainers / wall, 1),
                "others_cpu_pct": round(max(0.0, 100 * others / wall), 1)}


@dataclass
class Parsed:
    step_s: dict[int, float]  # step -> its step_time_s
    arrived: dict[int, float]  # step -> when its progress line arrived
    saves: dict[int, float]  # step -> the save's reported duration_s


class TelemetryCounter:
    """Subscribes to the bench runs' telemetry; counts messages by kind, keeps save times."""

    def __init__(self, broker: Mosquitto) -> None:
        self.received: Counter[str] = Counter()
        self.checkpoint_s: list[float] = []
        self._lock = threading.Lock()
        self._client = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=f"bench-overhead-{os.getpid()}")
        self._client.on_message = self._on_message
        self._client.connect(broker.host, broker.port)
        self._client.subscribe(protocol.topic_filter())
        self._client.loop_start()

    def _on_message(self, _c: Any, _u: Any, message: mqtt.MQTTMessage) -> None:
        try:
            msg = protocol.decode(bytes(message.payload), message.topic)
        except protocol.ProtocolError:
            msg = None
        with self._lock:
            self.received[msg.kind if msg else "malformed"] += 1
            if isinstance(msg, protocol.CheckpointCommitted):
                self.checkpoint_s.append(msg.duration_s)

    def close(self) -> None:
        self._client.disconnect()
        self._client.loop_stop()


def write_config(workdir: Path, args: argparse.Namespace) -> Path:
    config = workdir / "bench.toml"
    config.write_text(
        f"steps = {args.steps}\nglobal_batch_size = {args.global_batch}\n"
        f'output_dir = "{workdir}/out"\n'
        f'[checkpoint]\ndir = "{workdir}/ckpt"\nevery_steps = {args.checkpoint_every}\n'
    )
    return config


def trainer_env(rank: int, ranks: int, master_port: int, run_id: str,
                mqtt_url: str | None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TSUP_")}
    env.update(RANK=str(rank), WORLD_SIZE=str(ranks), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(ranks),
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(master_port), PYTHONPATH=str(REPO))
    if mqtt_url is not None:
        env.update(TSUP_MQTT_URL=mqtt_url, TSUP_RUN_ID=run_id, TSUP_ATTEMPT="1", TSUP_NODE="bench-node")
    return env


def run_trainer(mode: str, run_id: str, broker: Mosquitto, args: argparse.Namespace) -> TrainerRun:
    """One training run in a fresh directory; every rank stopped by pid, even on error."""
    url = broker.url if mode == "on" else None
    with tempfile.TemporaryDirectory(prefix="overhead-run-") as tmp:
        workdir = Path(tmp)
        config = write_config(workdir, args)
        port = free_port()
        procs: list[subprocess.Popen[str]] = []
        lines: list[tuple[float, str]] = []
        started, cpu = time.monotonic(), CpuWindow(psutil.Process(broker.pid))
        try:
            with open(workdir / "stderr.log", "w") as errors:
                for rank in range(args.ranks):
                    procs.append(subprocess.Popen(
                        [sys.executable, "-m", "trainer", "--config", str(config), "--resume", "none"],
                        env=trainer_env(rank, args.ranks, port, run_id, url), cwd=tmp, text=True,
                        stdout=subprocess.PIPE if rank == 0 else subprocess.DEVNULL, stderr=errors))
                assert procs[0].stdout is not None
                for line in procs[0].stdout:  # flushed per line by the trainer: arrival ~ print time
                    lines.append((time.monotonic(), line.rstrip("\n")))
                codes = [p.wait() for p in procs]
            if any(codes):
                log(f"{mode}: exit codes {codes}; stderr: {(workdir / 'stderr.log').read_text()[-2000:]}")
        finally:
            for p in procs:
                stop_process(p)
        return TrainerRun(mode=mode, lines=lines, exit_codes=codes, wall_s=time.monotonic() - started,
                          cpu=cpu.stop())


def parse(run: TrainerRun) -> Parsed:
    parsed = Parsed(step_s={}, arrived={}, saves={})
    for at, line in run.lines:
        if m := STEP_LINE.match(line):
            step = int(m[1])
            parsed.step_s[step], parsed.arrived[step] = float(m[2]), at
        elif m := SAVE_LINE.match(line):
            parsed.saves[int(m[1])] = float(m[2])
    return parsed


def timed_steps(parsed: Parsed, warmup: int) -> list[float]:
    return [t for step, t in parsed.step_s.items() if step > warmup]


def step_periods(parsed: Parsed, warmup: int) -> list[float]:
    """Progress line to progress line, for steps after warmup not preceded by a save."""
    return [parsed.arrived[n] - parsed.arrived[n - 1] for n in parsed.arrived
            if n - 1 > warmup and n - 1 in parsed.arrived and n - 1 not in parsed.saves]


def stalls(parsed: Parsed, warmup: int) -> tuple[list[float], float | None]:
    """(blocked seconds per checkpoint with a next step, the ordinary between-steps gap)."""
    gap = {n: parsed.arrived[n + 1] - parsed.arrived[n] - parsed.step_s[n + 1]
           for n in parsed.arrived if n + 1 in parsed.arrived}
    ordinary = [g for n, g in gap.items() if n > warmup and n not in parsed.saves]
    if not ordinary:
        return [], None
    baseline = statistics.median(ordinary)
    return [gap[n] - baseline for n in sorted(parsed.saves) if n in gap], baseline


@dataclass
class ModeResult:
    step_s: list[float] = field(default_factory=list)
    period_s: list[float] = field(default_factory=list)
    reported_s: list[float] = field(default_factory=list)
    blocked_s: list[float] = field(default_factory=list)
    baselines_s: list[float] = field(default_factory=list)

    def add(self, parsed: Parsed, warmup: int) -> None:
        self.step_s += timed_steps(parsed, warmup)
        self.period_s += step_periods(parsed, warmup)
        self.reported_s += [parsed.saves[n] for n in sorted(parsed.saves)]
        blocked, baseline = stalls(parsed, warmup)
        self.blocked_s += blocked
        if baseline is not None:
            self.baselines_s.append(baseline)

    def step_time_ms(self) -> dict[str, Any]:
        return summary_ms(self.step_s)

    def step_period_ms(self) -> dict[str, Any]:
        return summary_ms(self.period_s)

    def checkpoint(self) -> dict[str, Any]:
        return {"reported_ms": [ms(x) for x in self.reported_s],
                "blocked_ms": [ms(x) for x in self.blocked_s],
                "blocked_p50_ms": ms(statistics.median(self.blocked_s)) if self.blocked_s else None,
                "between_steps_ms": ms(statistics.median(self.baselines_s)) if self.baselines_s else None}


def ms(seconds: float) -> float:
    return round(1e3 * seconds, 2)


def summary_ms(values: list[float]) -> dict[str, Any]:
    if not values:
        return {"p50": None, "p90": None, "n": 0}
    return {"p50": ms(statistics.median(values)), "p90": ms(percentile(values, 0.9)), "n": len(values)}


def difference(off: float | None, on: float | None) -> dict[str, float | None]:
    if off is None or on is None:
        return {"ms": None, "pct": None}
    return {"ms": round(on - off, 2), "pct": round(100 * (on - off) / off, 1)}


def run_summary(run: TrainerRun, parsed: Parsed, warmup: int) -> dict[str, Any]:
    return {"mode": run.mode, "step_time_p50_ms": summary_ms(timed_steps(parsed, warmup))["p50"],
            "step_period_p50_ms": summary_ms(step_periods(parsed, warmup))["p50"],
            "wall_s": round(run.wall_s, 2), "exit_codes": run.exit_codes, **run.cpu}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="40 steps, two pairs of runs")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--steps", type=int, help="default 200; --quick 40")
    parser.add_argument("--checkpoint-every", type=int, help="default 50; --quick 15")
    parser.add_argument("--repeats", type=int, help="runs per mode (default 3; --quick 2)")
    parser.add_argument("--global-batch", type=int, default=16)
    parser.add_argument("--warmup", type=int, default=3, help="first steps left out of the step times")
    args = parser.parse_args(argv)
    args.steps = args.steps or (40 if args.quick else 200)
    args.checkpoint_every = args.checkpoint_every or (15 if args.quick else 50)
    args.repeats = args.repeats or (2 if args.quick else 3)
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    results = {"off": ModeResult(), "on": ModeResult()}
    runs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="overhead-bench-") as tmp, mosquitto(Path(tmp)) as broker:
        counter = TelemetryCounter(broker)
        try:
            for i in range(args.repeats):
                for mode in ("off", "on") if i % 2 == 0 else ("on", "off"):
                    log(f"run {i + 1}/{args.repeats}, telemetry {mode}: {args.ranks} ranks, "
                        f"{args.steps} steps")
                    run = run_trainer(mode, f"{RUN_PREFIX}-{i}", broker, args)
                    parsed = parse(run)
                    results[mode].add(parsed, args.warmup)
                    runs.append(run_summary(run, parsed, args.warmup))
            time.sleep(1)  # the last messages in flight
        finally:
            counter.close()
        version = broker.version
    off, on = results["off"], results["on"]
    report = {
        "ranks": args.ranks, "steps": args.steps, "checkpoint_every": args.checkpoint_every,
        "global_batch": args.global_batch, "warmup_steps": args.warmup, "repeats": args.repeats,
        "cpu_cores": os.cpu_count(), "loadavg_1m": round(os.getloadavg()[0], 2), "mosquitto": version,
        "step_time_ms": {mode: r.step_time_ms() for mode, r in results.items()},
        "step_period_ms": {mode: r.step_period_ms() for mode, r in results.items()},
        "telemetry_overhead": {
            "step_time": difference(off.step_time_ms()["p50"], on.step_time_ms()["p50"]),
            "step_period": difference(off.step_period_ms()["p50"], on.step_period_ms()["p50"])},
        "runs": runs,
        "checkpoint": {mode: r.checkpoint() for mode, r in results.items()},
        "telemetry": {"received": dict(counter.received),
                      "step_messages_expected": args.ranks * args.steps * args.repeats,
                      "checkpoint_ms": [ms(x) for x in counter.checkpoint_s]},
    }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()

"""Shared machinery of bench/mttr.py and bench/ettr.py; not a benchmark itself.

What it provides:

- ``workspace()``: a temp directory for one benchmark invocation. On the way out (error
  or not) every process whose command line names the directory is SIGKILLed by pid (the
  trainers, torchrun, the supervisor and mosquitto all carry a path inside it), then the
  directory is removed.
- ``mosquitto(root)``: a private mosquitto broker on a free loopback port.
- ``Tap``: an MQTT subscriber to every trainer's telemetry (wire/). It
  keeps each message with the *sender's* timestamp (``ts``, time.time() on the rank at
  the moment the message was made; everything here runs on one host, one clock), so
  phase boundaries are the trainer's own instants, not when a poller noticed them. It
  needs per-rank telemetry (``[telemetry] aggregate = "rank"``, the default: ``write_spec``
  replaces the spec's whole [telemetry] table, and the other launches leave
  TSUP_TELEMETRY_AGGREGATE unset).
- ``attempt_times``: from the Tap, the instants of one attempt: every rank up (its first
  message: telemetry starts as train() begins, once Python and torch are loaded), rank 0
  entering ``restore``, rank 0 entering ``train`` (checkpoint loaded), rank 0's first
  step.
- ``SupervisorRun``: ``training-supervisor run`` as a child process, and its SQLite.
- ``Torchrun``: ``python -m torch.distributed.run`` on the same trainer, its agent's log
  lines timestamped (from the lines' own glog time stamps).
- ``plain_launcher``/``plain_spec``: the supervisor's own local launcher without the
  supervisor (same env contract, same process layout), for cold starts and unsupervised
  runs.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import itertools
import json
import os
import re
import shutil
import signal
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import tomllib
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import mqtt_broker
import paho.mqtt.client as mqtt
import psutil
from paho.mqtt.enums import CallbackAPIVersion

import wire as protocol
from supervisor.domain import ProcState
from supervisor.launchers.base import Launcher, LaunchSpec
from supervisor.runfiles import trainer_cmd
from supervisor.spec import load_spec

REPO = Path(__file__).resolve().parents[1]
EXAMPLE_SPEC = REPO / "examples" / "tiny-llama.toml"
PY = sys.executable
T = TypeVar("T")
_STARTED = time.monotonic()


def say(text: str) -> None:
    """Progress, on stderr (stdout is for the one JSON object)."""
    print(f"[{time.monotonic() - _STARTED:7.1f}s] {text}", file=sys.stderr, flush=True)


def rounded(value: float | None, digits: int = 3) -> float | None:
    return None if value is None else round(value, digits)


def median_of(rows: Sequence[Mapping[str, Any]], key: str) -> float | None:
    values = [r[key] for r in rows if isinstance(r.get(key), (int, float)) and not isinstance(r[key], bool)]
    return rounded(statistics.median(values)) if values else None


def wait_until(check: Callable[[], T | None], timeout_s: float, every_s: float = 0.05) -> T | None:
    """Poll ``check`` until it returns something other than None, or time runs out."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = check()
        if value is not None or time.monotonic() >= deadline:
            return value
        time.sleep(every_s)


def exit_on_sigterm() -> None:
    """SIGTERM unwinds like Ctrl-C, so every ``finally`` cleans up."""
    signal.signal(signal.SIGTERM, lambda _sig, _frame: sys.exit(143))


# --- processes and temp dirs ---------------------------------------------------------


def kill_marked(marker: str) -> int:
    """SIGKILL, by pid, every process of ours whose command line contains ``marker`` (a
    path inside a temp dir this benchmark created, so nobody else's). Returns how many."""
    me = os.getpid()
    victims = []
    for p in psutil.process_iter(["pid", "cmdline"]):
        with contextlib.suppress(psutil.Error):
            if p.pid != me and any(marker in arg for arg in (p.info["cmdline"] or [])):
                victims.append(p)
    for p in victims:
        with contextlib.suppress(psutil.Error):
            p.kill()
    psutil.wait_procs(victims, timeout=10)
    return len(victims)


def kill_tree(proc: subprocess.Popen[Any]) -> None:
    """SIGKILL a child process and everything under it (a snapshot of its descendants)."""
    try:
        family = [*psutil.Process(proc.pid).children(recursive=True), psutil.Process(proc.pid)]
    except psutil.Error:
        family = []
    for p in family:
        with contextlib.suppress(psutil.Error):
            p.kill()
    psutil.wait_procs(family, timeout=10)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(10)


@contextlib.contextmanager
def workspace(prefix: str) -> Iterator[Path]:
    root = Path(tempfile.mkdtemp(prefix=prefix))
    try:
        yield root
    finally:
        left = kill_marked(str(root))
        if left:
            say(f"cleanup: killed {left} leftover process(es)")
        shutil.rmtree(root, ignore_errors=True)


# --- the broker and the telemetry tap -------------------------------------------------


@contextlib.contextmanager
def mosquitto(root: Path) -> Iterator[str]:
    """A private mosquitto on a free loopback port (bench/mqtt_broker.py); yields its mqtt:// URL."""
    with mqtt_broker.mosquitto(root) as broker:
        yield broker.url


class Tap:
    """Every telemetry message (heartbeats left out) of every run on the broker."""

    def __init__(self, url: str) -> None:
        host, port = protocol.parse_mqtt_url(url)
        self._lock = threading.Lock()
        self._msgs: list[protocol.Message] = []
        self._subscribed = threading.Event()
        self._client = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=f"bench-tap-{os.getpid()}")
        # Every cluster's: a daemon's cluster id is a fingerprint of its host and state directory.
        self._client.on_connect = lambda c, _u, _f, _r, _p: c.subscribe(protocol.topic_filter("+"))
        self._client.on_subscribe = lambda *_a: self._subscribed.set()
        self._client.on_message = self._on_message
        self._client.connect(host, port)
        self._client.loop_start()
        if not self._subscribed.wait(10):
            raise SystemExit("the telemetry tap could not subscribe")
        # Ranks launched without a supervisor (the cold starts, torchrun) use the default
        # cluster id, and hold their telemetry until someone there says it listens.
        self._client.publish(protocol.presence_topic(), protocol.PRESENCE_ONLINE, qos=1, retain=True)

    def close(self) -> None:
        self._client.publish(protocol.presence_topic(), protocol.PRESENCE_CLEARED, qos=1, retain=True)
        self._client.disconnect()
        self._client.loop_stop()

    def clear(self) -> None:
        with self._lock:
            self._msgs.clear()

    def _on_message(self, _client: Any, _userdata: Any, m: mqtt.MQTTMessage) -> None:
        try:
            msg = protocol.decode(bytes(m.payload), m.topic, cluster=m.topic.split("/")[2])
        except protocol.ProtocolError:
            return
        if isinstance(msg, protocol.Heartbeat):
            return
        with self._lock:
            self._msgs.append(msg)

    def messages(self, run: str, kind: type[T], *, attempt: int | None = None,
                 rank: int | None = None) -> list[T]:
        """The run's messages of one kind (``protocol.Header``: of every kind), oldest first."""
        with self._lock:
            return [m for m in self._msgs if m.run == run and isinstance(m, kind)
                    and (attempt is None or m.attempt == attempt)
                    and (rank is None or getattr(m, "rank", None) == rank)]

    def steps(self, run: str, attempt: int | None = None) -> list[protocol.StepMetrics]:
        """Rank 0's step reports (one per step and attempt)."""
        return self.messages(run, protocol.StepMetrics, attempt=attempt, rank=0)

    def max_step(self, run: str, attempt: int | None = None) -> int:
        return max((m.step for m in self.steps(run, attempt)), default=0)

    def max_attempt(self, run: str) -> int:
        return max((m.attempt for m in self.messages(run, protocol.Header)), default=0)

    def wait_step(self, run: str, step: int, timeout_s: float, attempt: int | None = None) -> bool:
        reached = wait_until(lambda: True if self.max_step(run, attempt) >= step else None, timeout_s)
        return reached is not None

    def pid_of(self, run: str, attempt: int, rank: int) -> int | None:
        regs = self.messages(run, protocol.Register, attempt=attempt, rank=rank)
        return regs[-1].pid if regs else None

    def first_fault_ts(self, run: str, attempt: int) -> float | None:
        faults = self.messages(run, protocol.FaultInjected, attempt=attempt)
        return min((f.ts for f in faults), default=None)


@dataclass(frozen=True, slots=True)
class AttemptTimes:
    """Instants (unix seconds) of one attempt, from its ranks' own telemetry."""

    up: float | None  # every rank's telemetry started (the last rank's first message)
    restore_begin: float | None  # rank 0 announced phase "restore" (None: a fresh start)
    train_begin: float | None  # rank 0 announced phase "train" (checkpoint loaded, if any)
    first_step: float | None  # rank 0 reported its first step
    first_step_number: int | None


def attempt_times(tap: Tap, run: str, attempt: int, world: int) -> AttemptTimes:
    firsts: dict[int, float] = {}
    for m in tap.messages(run, protocol.Header, attempt=attempt):
        firsts[m.rank] = min(firsts.get(m.rank, m.ts), m.ts)
    phases = tap.messages(run, protocol.PhaseChange, attempt=attempt, rank=0)
    steps = tap.steps(run, attempt)
    first = min(steps, key=lambda m: m.ts) if steps else None
    return AttemptTimes(
        up=max(firsts.values()) if len(firsts) >= world else None,
        restore_begin=next((p.ts for p in phases if p.phase is protocol.Phase.RESTORE), None),
        train_begin=next((p.ts for p in phases if p.phase is protocol.Phase.TRAIN), None),
        first_step=first.ts if first else None,
        first_step_number=first.step if first else None,
    )


def chain(points: Sequence[tuple[str, float | None]]) -> dict[str, float | None]:
    """Durations between consecutive instants: {name_s: t[i] - t[i-1]} (None when either
    end is unknown); the first point is the origin and names nothing."""
    out: dict[str, float | None] = {}
    for (_, before), (name, after) in itertools.pairwise(points):
        out[f"{name}_s"] = rounded(after - before) if before is not None and after is not None else None
    return out


_RESUMED = re.compile(r"resumed from \S+ at step (\d+) in ([0-9.]+) s")


def restore_load_s(log: Path) -> float | None:
    """The checkpoint load time rank 0 printed ("resumed from ... in X s")."""
    try:
        m = _RESUMED.search(log.read_text(errors="replace"))
    except OSError:
        return None
    return float(m.group(2)) if m else None


def goodput(tap: Tap, run: str) -> dict[str, float | int]:
    """Productive time and step counts from rank 0's step reports: a step is kept when
    it is the copy the latest attempt ran (as supervisor/goodput.py counts)."""
    latest: dict[int, protocol.StepMetrics] = {}
    steps = tap.steps(run)
    for m in steps:
        if m.step not in latest or m.attempt >= latest[m.step].attempt:
            latest[m.step] = m
    return {"productive_s": round(sum(m.step_time_s for m in latest.values()), 3),
            "kept_steps": len(latest), "lost_steps": len(steps) - len(latest),
            "final_step": max(latest, default=0)}


# --- specs and configs -----------------------------------------------------------------


def write_spec(base: Path, dest: Path, *, mqtt_url: str, steps: int | None = None,
               every_steps: int | None = None, standby: bool = False, memory_every_steps: int = 0,
               launcher: str | None = None) -> Path:
    """A copy of ``base`` with telemetry on ``mqtt_url`` and, if given, other steps, warm
    standbys, the memory tier (with persistent saves beside training), or another launcher."""
    data = tomllib.loads(base.read_text())
    if launcher is not None:
        data.setdefault("resources", {})["launcher"] = launcher
    if standby:
        data.setdefault("resources", {})["standby"] = True
    if memory_every_steps:
        data.setdefault("trainer", {}).setdefault("checkpoint", {}).update(
            memory_every_steps=memory_every_steps, asynchronous=True)
    if steps is not None:
        data.setdefault("trainer", {})["steps"] = steps
    if every_steps is not None:
        data.setdefault("trainer", {}).setdefault("checkpoint", {})["every_steps"] = every_steps
    data["telemetry"] = {"mqtt_url": mqtt_url}
    dest.write_text(_toml(data))
    load_spec(dest)  # fail here, not in a child process
    return dest


def _toml(table: Mapping[str, Any], path: tuple[str, ...] = ()) -> str:
    """Enough TOML for a run spec: scalars, lists of scalars, nested tables."""
    lines = [f"{k} = {_toml_value(v)}" for k, v in table.items() if not isinstance(v, dict)]
    head = [f"[{'.'.join(path)}]"] if path and lines else []
    parts = ["\n".join(head + lines)] if lines else []
    parts += [_toml(v, (*path, k)) for k, v in table.items() if isinstance(v, dict)]
    return "\n\n".join(p for p in parts if p) + ("\n" if not path else "")


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v)
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    raise TypeError(f"cannot write {type(v).__name__} as TOML")


def spec_shape(spec: Path) -> dict[str, Any]:
    s = load_spec(spec)
    assert s.trainer is not None
    return {"nodes": s.resources.nodes, "ranks_per_node": s.resources.ranks_per_node,
            "spares": s.resources.spares, "steps": s.total_steps,
            "every_steps": s.trainer.get("checkpoint", {}).get("every_steps")}


def steps_past(spec: Path, fault_step: int, after: int = 10) -> int | None:
    """Steps for a copy of ``spec`` whose run goes ``after`` steps past ``fault_step``, or
    None when the spec's own do. A fault with warm standbys comes late enough for them to
    be warm, as faults hours apart find them (on this machine's 2 cores, beside 4
    training ranks, importing torch and warming takes them 15-25 s)."""
    steps = int(spec_shape(spec)["steps"])
    return fault_step + after if fault_step + after > steps else None


def world_of(spec: Path) -> int:
    """The spec's ranks (4 in the example: 2 nodes x 2)."""
    shape = spec_shape(spec)
    return int(shape["nodes"] * shape["ranks_per_node"])


def faulty_rank(spec: Path) -> int:
    """The rank the faults strike: the highest (3 in the example), the one the supervisor's
    chaos picks by default."""
    return world_of(spec) - 1


def write_trainer_config(spec: Path, run_dir: Path) -> Path:
    """The trainer config the supervisor would write for this spec (trainer_cmd), with
    checkpoints and output under ``run_dir``."""
    config = trainer_cmd.trainer_config(load_spec(spec), run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / "trainer.json"
    path.write_text(json.dumps(config, indent=2, sort_keys=True))
    return path


def result_digest(run_dir: Path) -> str | None:
    try:
        return str(json.loads((run_dir / "output" / "result.json").read_text())["model_digest"])
    except (OSError, ValueError, KeyError):
        return None


# --- the supervisor ---------------------------------------------------------------------


class SupervisorRun:
    """``training-supervisor run SPEC --json`` in the background; its DB once it is over."""

    def __init__(self, spec: Path, state_dir: Path, chaos: Sequence[str],
                 env: Mapping[str, str] | None = None) -> None:
        self.state_dir = state_dir
        state_dir.mkdir(parents=True, exist_ok=True)
        args = [PY, "-m", "slurmbox.tsup", "run", str(spec), "--state-dir", str(state_dir), "--json",
                "--quiet", "--api-port", "-1"]
        for c in chaos:
            args += ["--chaos", c]
        self.launched_at = time.time()
        with open(state_dir / "summary.json", "wb") as out, open(state_dir / "run.err", "wb") as err:
            self.proc = subprocess.Popen(args, stdout=out, stderr=err, stdin=subprocess.DEVNULL,
                                         cwd=REPO, start_new_session=True, env={**os.environ, **(env or {})})
        self.exited_at: float | None = None

    def wait(self, timeout_s: float) -> bool:
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            return False
        self.exited_at = time.time()
        return True

    def cancel(self, timeout_s: float = 60) -> None:
        """SIGINT: the run is cancelled, its attempt stopped, the daemon exits."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            self.wait(timeout_s)

    def close(self) -> None:
        """Kill what is left: the daemon and its trainer children (they run in their own
        process groups, so the descendants are found before the daemon dies)."""
        if self.proc.poll() is None:
            self.cancel(30)
        if self.proc.poll() is None:
            kill_tree(self.proc)
        kill_marked(str(self.state_dir))

    def summary(self) -> dict[str, Any] | None:
        try:
            return dict(json.loads((self.state_dir / "summary.json").read_text()))
        except (OSError, ValueError):
            return None

    def stderr_tail(self) -> str:
        with contextlib.suppress(OSError):
            return (self.state_dir / "run.err").read_text(errors="replace")[-1500:]
        return ""

    def db(self) -> SupervisorDb:
        return SupervisorDb(self.state_dir / "supervisor.db")

    def rank0_log(self, attempt: int) -> Path | None:
        return rank0_log(self.state_dir / "runs" / "run-1" / "attempts" / str(attempt))


def rank0_log(log_dir: Path) -> Path | None:
    """Rank 0's output in an attempt's ``log_dir``: ``rank-0000.<node>.log`` from the local
    launcher, ``rank-0.log`` from srun (its ``%t``)."""
    logs = sorted(log_dir.glob("rank-0000.*.log")) or sorted(log_dir.glob("rank-0.log"))
    return logs[0] if logs else None


@dataclass(frozen=True, slots=True)
class Event:
    id: int
    ts: float
    kind: str
    data: dict[str, Any]


class SupervisorDb:
    """Read-only views of a finished run's SQLite (supervisor/store/schema.py)."""

    def __init__(self, path: Path) -> None:
        self.events: list[Event] = []
        self.attempts: dict[int, dict[str, Any]] = {}
        self.run: dict[str, Any] = {}
        if path.is_file():  # not there: the supervisor failed before it made one
            self._read(path)

    def _read(self, path: Path) -> None:
        conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
        conn.row_factory = sqlite3.Row
        try:
            self.events = [Event(r["id"], r["ts"], r["kind"], json.loads(r["data"] or "{}"))
                           for r in conn.execute("SELECT id, ts, kind, data FROM events ORDER BY id")]
            self.attempts = {r["number"]: dict(r) for r in conn.execute(
                "SELECT number, state, nodes, resume_step, created_at, started_at, first_step_at, "
                "ended_at, outcome, final_step, launch_info FROM attempts WHERE run_number = 1")}
            run = conn.execute("SELECT started_at, ended_at, state FROM runs WHERE number = 1").fetchone()
            self.run = dict(run) if run else {}
        finally:
            conn.close()

    def first(self, kind: str, where: Callable[[Event], bool] = lambda _e: True) -> Event | None:
        return next((e for e in self.events if e.kind == kind and where(e)), None)


# --- torchrun ----------------------------------------------------------------------------

# Run inside sh so that each worker tells its telemetry which restart it belongs to:
# TORCHELASTIC_RESTART_COUNT is 0 for the first worker group, 1 after the first restart.
_WORKER = 'TSUP_ATTEMPT=$((TORCHELASTIC_RESTART_COUNT + 1)) exec "$0" -m trainer --config "$1" --resume auto'
_GLOG = re.compile(r"^[IWEF]\d{4} (\d\d):(\d\d):(\d\d(?:\.\d+)?) ")
# The agent's first word on a failure: it SIGTERMs the surviving workers ("Sending process
# N closing signal SIGTERM"), then logs the failure ("failed (exitcode: ...)").
DETECTED = re.compile(r"closing signal|failed \(exitcode|Worker group (FAILED|UNHEALTHY)")
TORN_DOWN = re.compile(r"Rendezvous'ing worker group")
LAUNCHED = re.compile(r"Starting worker group")


# LOGLEVEL=INFO: the agent logs its restarts (the lines timed below) at INFO.
# TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: torch's opt-out of sharing the rendezvous TCPStore
# with the workers. With the default (shared), the store outlives a worker group, the
# restarted group's gloo rendezvous reads the dead group's addresses from it, and every
# restart fails with "Gloo connectFullMesh failed ... Connection refused" until
# --max-restarts is spent (seen with torch 2.13 on CPU). With the opt-out, rank 0 of each
# group hosts a fresh store.
TORCHRUN_ENV = {"LOGLEVEL": "INFO", "PYTHONUNBUFFERED": "1", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}


class Torchrun:
    """``torchrun --standalone --nproc-per-node N --max-restarts R`` running the trainer
    with ``--resume auto``; the agent's log lines kept with their time stamps."""

    def __init__(self, config: Path, workdir: Path, *, nproc: int, max_restarts: int,
                 env: Mapping[str, str]) -> None:
        self.workdir = workdir
        self.log_dir = workdir / "torchrun-logs"
        self.lines: list[tuple[float, str]] = []
        self._lock = threading.Lock()
        args = [PY, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
                "--max-restarts", str(max_restarts), "--log-dir", str(self.log_dir), "--redirects", "3",
                "--no-python", "sh", "-c", _WORKER, PY, str(config)]
        full_env = {**os.environ, **TORCHRUN_ENV, **env}
        self.launched_at = time.time()
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                     stdin=subprocess.DEVNULL, env=full_env, cwd=workdir,
                                     start_new_session=True)
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stderr is not None
        with open(self.workdir / "torchrun.err", "w") as copy:
            for raw in self.proc.stderr:
                rx = time.time()
                line = raw.decode(errors="replace").rstrip("\n")
                copy.write(line + "\n")
                with self._lock:
                    self.lines.append((_glog_time(line, rx), line))

    def first_line(self, pattern: re.Pattern[str], after: float) -> float | None:
        with self._lock:
            return next((ts for ts, line in self.lines if ts >= after and pattern.search(line)), None)

    def exited(self) -> bool:
        return self.proc.poll() is not None

    def close(self) -> None:
        if self.proc.poll() is None:
            kill_tree(self.proc)
        kill_marked(str(self.workdir))
        self._reader.join(5)

    def rank0_log(self, attempt: int) -> Path | None:
        logs = sorted(self.log_dir.glob(f"*/attempt_{attempt - 1}/0/stdout.log"))
        return logs[0] if logs else None


def _glog_time(line: str, rx: float) -> float:
    """The time stamp torch's glog-style prefix carries (local time of day, microseconds),
    on the date the line arrived; the arrival time when there is none."""
    m = _GLOG.match(line)
    if m is None:
        return rx
    day = dt.datetime.fromtimestamp(rx).date()
    secs = float(m.group(3))
    stamp = dt.datetime.combine(day, dt.time(int(m.group(1)), int(m.group(2)))).timestamp() + secs
    return stamp - 86_400 if stamp > rx + 60 else stamp  # a line from just before midnight


# --- the supervisor's local launcher, without the supervisor -----------------------------


def plain_spec(config: Path, run_id: str, attempt: int, nodes: int, ranks_per_node: int,
               mqtt_url: str, extra_env: Mapping[str, str] | None = None) -> LaunchSpec:
    """``python -m trainer --config C --resume auto`` on every rank, laid out and
    environed exactly as the supervisor's local launcher does it."""
    log_dir = config.parent / "attempts" / str(attempt)
    env = {"TSUP_MQTT_URL": mqtt_url, "TSUP_RUN_ID": run_id, "TSUP_ATTEMPT": str(attempt),
           **(extra_env or {})}
    names = tuple(f"{run_id}-node{i + 1}" for i in range(nodes))
    return LaunchSpec(run_id=run_id, attempt=attempt, nodes=names,
                      ranks_per_node=ranks_per_node, argv=trainer_cmd.trainer_argv(config, "auto"), env=env,
                      log_dir=log_dir, marker=str(config))


def all_exited(launcher: Launcher, info: str) -> bool:
    return all(r.proc in (ProcState.EXITED, ProcState.VANISHED) for r in launcher.observe(info))


def stop_plain(launcher: Launcher, info: str) -> None:
    """SIGKILL every rank of the launch (frozen ones too: the local launcher's process
    groups, Slurm's step) and wait for them to be gone."""
    launcher.stop(info, force=True)
    wait_until(lambda: True if all_exited(launcher, info) else None, 30)
    launcher.forget(info)

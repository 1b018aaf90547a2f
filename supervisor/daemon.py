"""The daemon: the composition root and the lifecycle of its root tasks.

``Daemon(settings)`` builds every adapter from the settings and does no I/O;
``async with daemon:`` takes the state-directory lock, opens the store and starts the
broker and the API socket; ``await daemon.run(stop)`` runs the root tasks until
``stop`` is set or one of them dies, in which case every task stops and ``run``
raises, so that the process exits non-zero (and systemd restarts it).

Shutdown (SIGTERM sets ``stop``): the reconciler finishes the tick it is in (a tick
never awaits, so cancelling lands between ticks) and the API stops; then the events
still in the outbox are published within ``shutdown_flush_s``; then the MQTT link
closes. Nothing is lost either way: an event not published stays in the outbox for the
next start. Trainers keep running; the next daemon adopts them. The `serve` process
bounds the whole stop (cli/daemon.py: ``STOP_WITHIN_S``).

Under systemd (``Type=notify``) the daemon says READY=1 after its first tick and
WATCHDOG=1 after each tick that completes (supervisor/sdnotify.py).

Root tasks, created here and nowhere else:
    reconciler   observe/decide/persist/act, every ``tick_s``
    telemetry    the MQTT link (trainer telemetry in, supervisor events out)
    outbox       publishes recorded events, and ended attempts' fences, on MQTT
                 (supervisor/telemetry/outbox.py)
    webhooks     POST notices to the [[notify]] webhooks (supervisor/webhooks.py)
    api          the HTTP API (uvicorn), when a port is configured
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import socket
import sys
import time
from collections.abc import Callable, Coroutine, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import TracebackType
from typing import Any, Literal

import aiomqtt
import uvicorn

from supervisor.domain import LIVE_ATTEMPT_STATES, DrainBudget
from supervisor.domain.events import EventKind
from supervisor.errors import StoreError, SupervisorError
from supervisor.gathering.settled import SettledHistory
from supervisor.launchers.base import ChaosHooks, Launcher, NodeAdmin, waiting_standbys
from supervisor.launchers.local import LocalLauncher
from supervisor.metrics import SupervisorMetrics
from supervisor.reconciler import Reconciler, ReconcilerConfig, pause_after
from supervisor.recorder import Retention
from supervisor.root_tasks import cancelled
from supervisor.runfiles import user_tree
from supervisor.sdnotify import Notifier
from supervisor.service import SupervisorService
from supervisor.slurm.cluster import SlurmCluster, slurm_cluster
from supervisor.slurm.launcher import prefix_for
from supervisor.state_lock import StateDirLock
from supervisor.store import SqlStore
from supervisor.telemetry.access import SUPERVISOR_USER, BrokerAccess
from supervisor.telemetry.broker import (
    READER_PASSWORD_FILE,
    SUPERVISOR_PASSWORD_FILE,
    EmbeddedBroker,
    broker_addresses,
)
from supervisor.telemetry.link import MqttLink
from supervisor.telemetry.outbox import Outbox
from supervisor.telemetry.view import TelemetryView
from supervisor.token_file import (
    READ_TOKEN_FILE_NAME,
    TELEMETRY_SECRET_NAME,
    TOKEN_FILE_NAME,
    ApiTokens,
    ensure_token,
)
from supervisor.views import DaemonHealth
from supervisor.webhooks import Webhook, Webhooks
from wire import parse_broker_url

log = logging.getLogger(__name__)

# A tick that keeps failing this many times in a row (database gone, disk full) ends
# the daemon instead of spinning: systemd restarts it and the operator sees why.
_MAX_FAILED_TICKS = 100
_STALLED_AFTER_S = 30.0  # /healthz answers 503 when no tick finished for this long
# The telemetry's replay marks (TelemetryView.replay_marks) are kept in the state directory
# this often and on the way out: a daemon restarted after a crash refuses replays of what
# its predecessor verified, bar the last few seconds'.
_REPLAY_MARKS_FILE = "telemetry-replay.json"
_REPLAY_MARKS_EVERY_S = 5.0


@dataclass(frozen=True, slots=True, kw_only=True)
class DaemonSettings:
    state_dir: Path
    mqtt_url: str | None = None  # None: start the embedded broker
    # Where the embedded broker listens, what ranks are told (None: supervisor/telemetry/broker.py's rule)
    mqtt_bind: str | None = None
    mqtt_advertise_url: str | None = None
    mqtt_ca_file: Path | None = None  # a CA bundle for an mqtts:// broker (None: the system's)
    cluster_id: str | None = None  # in every topic; None: derived from the state directory
    run_as: str | None = None  # runs execute as this user when their spec names none (users.py)
    allow_root_runs: bool = False
    run_users: tuple[str, ...] | None = None  # who a spec's user may be (None: users.may_run_as)
    shared_dir: Path | None = None  # run directories go under <shared_dir>/runs (None: the state dir)
    slurm_admin_prefix: tuple[str, ...] = ()  # before scontrol's privileged calls, e.g. ("sudo", "-n")
    runs_share_admin_rights: bool = False  # runs may execute as the daemon's user despite that prefix
    hyperpod: bool = False  # SageMaker HyperPod: repairs are asked with its Action: reasons
    api_host: str = "127.0.0.1"
    api_port: int | None = 8470  # None: no API; 0: any free port
    tick_s: float = 0.25
    max_local_nodes: int = 64
    check_trainer_config: bool = True
    launcher: Literal["local", "slurm"] = "local"
    slurm_conf: str | None = None  # None: SLURM_CONF from the environment, or Slurm's default
    slurm_bin_dir: Path | None = None  # where sbatch, srun, scontrol ... are (None: on PATH)
    sweep_every_s: float | None = None  # probe idle and drained nodes this often (None: never)
    sweep_args: tuple[str, ...] = ()  # extra arguments to the sweep's python -m health
    return_after: int = 3  # clean sweep probes in a row that return a node it drained (0: never)
    drain_budget: DrainBudget = field(default_factory=DrainBudget)  # its own drains, whatever the cause
    shutdown_flush_s: float = 5.0  # at most this long publishing the outbox on the way out
    api_token_file: Path | None = None  # None: <state_dir>/api-token (api/auth.py)
    tls_cert: Path | None = None  # both set: the API speaks HTTPS
    tls_key: Path | None = None
    retention: Retention = field(default_factory=Retention)
    notify: tuple[Webhook, ...] = ()  # webhooks (supervisor/webhooks.py)
    node_python: str = sys.executable  # the node programs' interpreter on every node (probes, agents)

    @property
    def token_file(self) -> Path:
        return self.api_token_file or self.state_dir / TOKEN_FILE_NAME

    @property
    def runs_dir(self) -> Path:
        """Run directories (trainer logs, checkpoints): where every node and the run's user can reach."""
        return (self.shared_dir or self.state_dir) / "runs"


# Builds the HTTP API for the daemon to serve (api/app.py: daemon_app): the API layer sits
# above this module, so the caller (the CLI) hands it down.
ApiFactory = Callable[[SupervisorService, ApiTokens, SupervisorMetrics], Any]


@dataclass(frozen=True, slots=True)
class Cluster:
    """The adapters of the cluster runs go to: launching, node administration, chaos."""

    launcher: Launcher
    nodes: NodeAdmin
    chaos: ChaosHooks | None = None  # local nodes are process groups here: drills signal them
    slurm: SlurmCluster | None = None  # its poll is started with the daemon


def make_cluster(settings: DaemonSettings) -> Cluster:
    if settings.launcher == "slurm":
        slurm = slurm_cluster(slurm_conf=settings.slurm_conf, state_dir=settings.state_dir,
                              admin_prefix=settings.slurm_admin_prefix, hyperpod=settings.hyperpod,
                              bin_dir=settings.slurm_bin_dir, node_python=settings.node_python)
        return Cluster(slurm.launcher, slurm.nodes, slurm=slurm)
    local = LocalLauncher(max_nodes=settings.max_local_nodes)
    return Cluster(local, local, chaos=local)


class Daemon:
    def __init__(self, settings: DaemonSettings, clock: Callable[[], float] = time.time, *,
                 api: ApiFactory | None = None, cluster: Cluster | None = None) -> None:
        self.settings = settings
        self.clock = clock
        self.store = SqlStore(settings.state_dir / "supervisor.db")
        self.cluster = cluster or make_cluster(settings)
        self.launcher = self.cluster.launcher
        # Topics carry it, as Slurm job names carry the same fingerprint: two daemons on one
        # broker or one cluster never see each other's runs.
        self.cluster_id = settings.cluster_id or prefix_for(settings.state_dir)
        self.telemetry = TelemetryView(cluster=self.cluster_id, is_live=self._attempt_is_live)
        self._api_factory = api
        # The reconciler's tick runs here, never on the event loop (supervisor/reconciler.py).
        self._tick_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="reconciler")
        self.broker = EmbeddedBroker(settings.state_dir) if settings.mqtt_url is None else None
        self.webhooks = Webhooks(self.store, list(settings.notify), self.cluster_id)
        self.api_url: str | None = None
        self._lock: StateDirLock | None = None
        self._last_tick_at: float | None = None  # time.monotonic() of the last good tick
        self._api_socket: socket.socket | None = None
        # Built in __aenter__, once the broker's address is known:
        self.mqtt_url: str = ""  # what ranks are told (an external broker's may hold their login)
        self.link: MqttLink | None = None
        self.outbox: Outbox | None = None
        self.reconciler: Reconciler | None = None
        self.service: SupervisorService | None = None
        self.notifier = Notifier()
        self.history = SettledHistory()  # the API's and the metrics' reads share what settled
        self.metrics = SupervisorMetrics(self.store, self.telemetry,
                                         lambda: self.link is not None and self.link.connected, clock,
                                         standbys=waiting_standbys(self.launcher), history=self.history)
        self.api_tokens: ApiTokens | None = None

    async def __aenter__(self) -> Daemon:
        self.settings.state_dir.mkdir(parents=True, exist_ok=True)
        self._lock = StateDirLock(self.settings.state_dir)
        self._lock.acquire()
        try:
            self.store.open()
            self._record_start()
            self.webhooks.start()
            self._load_replay_marks()
            await self._open_telemetry()
            st = self.settings
            config = ReconcilerConfig(mqtt_url=self.mqtt_url, mqtt_ca_file=st.mqtt_ca_file,
                                      sweep_every_s=st.sweep_every_s,
                                      sweep_args=st.sweep_args, return_after=st.return_after,
                                      drain_budget=st.drain_budget, retention=st.retention,
                                      node_python=st.node_python)
            self.reconciler = Reconciler(self.store, self.telemetry, config, launcher=self.launcher,
                                         nodes=self.cluster.nodes, clock=self.clock)
            self.service = SupervisorService(
                self.store, self.settings.runs_dir, mqtt_url=self.mqtt_url,
                launcher=self.launcher,
                check_trainer=self.settings.check_trainer_config, run_as=st.run_as,
                allow_root_runs=st.allow_root_runs, run_users=st.run_users,
                admin_rights=bool(st.slurm_admin_prefix) and not st.runs_share_admin_rights,
                clock=self.clock, health=self.health, history=self.history,
            )
            if self.cluster.slurm is not None:
                self.cluster.slurm.state.start()
            if self.settings.api_port is not None and self._api_factory is not None:
                read_file = self.settings.state_dir / READ_TOKEN_FILE_NAME
                self.api_tokens = ApiTokens(
                    token=_secret(self.settings.token_file, "API token"), token_file=self.settings.token_file,
                    read_token=_secret(read_file, "read-only API token", group_may_read=True),
                    read_token_file=read_file)
                self._api_socket = _listen(self.settings.api_host, self.settings.api_port)
                bound = self._api_socket.getsockname()
                scheme = "https" if self.settings.tls_cert else "http"
                host = f"[{bound[0]}]" if ":" in bound[0] else bound[0]
                self.api_url = f"{scheme}://{host}:{bound[1]}"
        except BaseException:
            await self._close()
            raise
        return self

    async def _open_telemetry(self) -> None:
        """Start the embedded broker (or check the external one), and know what to tell ranks.

        The embedded broker takes logins only (supervisor/telemetry/broker.py): the daemon's own,
        with the password kept in the state directory, and one per attempt, which its
        ranks are given in their environment (supervisor/gathering/launch_specs.py); the URL ranks are
        told carries none. An external broker's URL may carry the daemon's password:
        then ranks must be told another (``mqtt_advertise_url``, with their own account),
        or the daemon does not start, rather than hand every run's user its login."""
        st = self.settings
        secret = _secret(st.state_dir / TELEMETRY_SECRET_NAME).encode()
        self.telemetry.secret = secret
        if self.broker is not None:
            slurm = self.cluster.slurm
            nodes = None if slurm is None else [n.addr for n in (slurm.state.nodes() or {}).values()]
            own, port, advertised = broker_addresses(st.mqtt_bind, st.mqtt_advertise_url, nodes)
            self.broker.host, self.broker.port = own, port or 0
            password = _secret(st.state_dir / SUPERVISOR_PASSWORD_FILE, "embedded broker's password")
            reader = _secret(st.state_dir / READER_PASSWORD_FILE, "broker reader's password",
                             group_may_read=True)
            access = BrokerAccess(self.cluster_id, secret, password, reader_password=reader,
                                  is_live=self._attempt_is_live)
            loop = asyncio.get_running_loop()

            def forget_login(run: str, number: int) -> None:  # called on the tick's thread
                loop.call_soon_threadsafe(access.end_attempt, run, number)

            self.telemetry.on_end.append(forget_login)
            await self.broker.start(access)
            own_url = replace(parse_broker_url(self.broker.url), username=SUPERVISOR_USER, password=password)
            self.mqtt_url = advertised.format(port=self.broker.port)
            self.telemetry.broker_logins = True
        else:
            assert st.mqtt_url is not None
            own_url = parse_broker_url(st.mqtt_url)
            self.mqtt_url = st.mqtt_advertise_url or st.mqtt_url
        self.link = MqttLink(own_url, self.telemetry, self.clock, ca_file=st.mqtt_ca_file,
                             client_id=f"training-supervisor-{self.cluster_id}-{os.getpid()}")
        self.outbox = Outbox(self.store, self.link, self.cluster_id, self.telemetry.secret)
        # Both ends are tried once now: a bad address or credentials stop the start with
        # the key to fix, rather than costing every run its telemetry.
        await _try_broker(self.link, "mqtt_bind" if self.broker else "mqtt_url")
        ranks_url = parse_broker_url(self.mqtt_url)
        if self.broker is None and own_url.password and (ranks_url.username, ranks_url.password) == (
                own_url.username, own_url.password):
            unset = "unset, so " if st.mqtt_advertise_url is None else ""
            raise SupervisorError(
                f"mqtt_advertise_url: {unset}ranks would be told the daemon's own login to {own_url}; set "
                "mqtt_advertise_url to the broker's URL with an account of the ranks' own (one that may "
                "publish telemetry only)")
        if self.broker is not None:  # checked with the daemon's login: the ranks' differ by attempt
            ranks_url = replace(ranks_url, username=own_url.username, password=own_url.password)
        if ranks_url != own_url:
            ranks = MqttLink(ranks_url, TelemetryView(), self.clock, ca_file=st.mqtt_ca_file,
                             client_id=f"training-supervisor-check-{os.getpid()}")
            await _try_broker(ranks, "mqtt_advertise_url" if st.mqtt_advertise_url else "mqtt_bind",
                              "ranks would be told ")

    def _attempt_is_live(self, run_id: str, number: int) -> bool:
        """Whether the store has ``run_id``'s attempt ``number`` live (asked by the broker at
        an attempt's login, by the telemetry at its first verified message). A store that
        cannot answer is taken as yes: the message or login was verified already."""
        run = run_id.removeprefix("run-")
        if not run.isdigit():
            return False
        try:
            with self.store.tx() as tx:
                return tx.attempt_is_live(int(run), number)
        except StoreError as e:
            log.warning("cannot tell whether %s#%d is live, taken as live: %s", run_id, number, e)
            return True

    def _record_start(self) -> None:
        """An audit line per start: which live attempts this daemon takes over."""
        with self.store.tx() as tx:
            live = [f"run-{r.number}#{a.number}" for r in tx.list_runs()
                    for a in tx.list_attempts(r.number)[-1:] if a.state in LIVE_ATTEMPT_STATES]
            message = f"training-supervisor started (pid {os.getpid()})"
            if live:
                message += f"; taking over live attempts {', '.join(live)}"
            tx.add_event(None, EventKind.DAEMON_STARTED, message, {"pid": os.getpid(), "live_attempts": live},
                         self.clock())

    async def __aexit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self._close()

    def _load_replay_marks(self) -> None:
        path = self.settings.state_dir / _REPLAY_MARKS_FILE
        try:
            marks = json.loads(path.read_text())
            self.telemetry.load_replay_marks((str(m[0]), int(m[1]), str(m[2]), int(m[3])) for m in marks)
        except FileNotFoundError:
            return
        except (OSError, ValueError, TypeError, IndexError) as e:  # the daemon's own file: say so, go on
            log.warning("%s unreadable (%s): replays of messages sent before this start are not refused",
                        path, e)

    def _keep_replay_marks(self) -> None:
        path = self.settings.state_dir / _REPLAY_MARKS_FILE
        tmp = path.with_suffix(".tmp")
        try:
            tmp.write_text(json.dumps(self.telemetry.replay_marks()))
            tmp.replace(path)
        except OSError as e:
            log.warning("cannot keep the telemetry's replay marks in %s: %s", path, e)

    async def _close(self) -> None:
        if self.link is not None and self.reconciler is not None:
            self._keep_replay_marks()
        if self.reconciler is not None:
            self.reconciler.close()
        self._tick_thread.shutdown(wait=True)
        user_tree.close_all()  # the run users' file workers (each also ends with its pipe)
        if self.cluster.slurm is not None:
            self.cluster.slurm.state.stop()
        if self._api_socket is not None:
            self._api_socket.close()
        if self.broker is not None:
            await self.broker.stop()
        self.store.close()
        if self._lock is not None:
            self._lock.release()

    async def run(self, stop: asyncio.Event) -> None:
        assert self.link is not None and self.outbox is not None
        roots: dict[str, Coroutine[Any, Any, None]] = {
            "reconciler": self._reconcile_forever(),
            "telemetry": self.link.run(),
            "outbox": self.outbox.publish_forever(),
            "pulse": self.link.pulse_forever(),
            "webhooks": self.webhooks.deliver_forever(),
        }
        if self._api_socket is not None:
            roots["api"] = self._serve_api(self._api_socket)
        tasks = {name: asyncio.create_task(coro, name=name) for name, coro in roots.items()}
        stopper = asyncio.create_task(stop.wait(), name="stop")
        done, _ = await asyncio.wait([*tasks.values(), stopper], return_when=asyncio.FIRST_COMPLETED)
        died = [t for t in tasks.values() if t in done]
        self.notifier.stopping("stopping" if not died else f"root task {died[0].get_name()} stopped")
        # First stop deciding and taking requests, then flush what was decided, then hang up.
        await cancelled([tasks[n] for n in ("reconciler", "api", "outbox") if n in tasks])
        if not died:
            flushed = 0
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.settings.shutdown_flush_s):
                    flushed = await self.outbox.flush()
            log.info("stopped: %d event(s) published on the way out", flushed)
        await cancelled([*tasks.values(), stopper])
        for t in died:
            err = t.exception() if not t.cancelled() else None
            raise SupervisorError(f"root task {t.get_name()!r} stopped: {err!r}") from err

    async def _tick(self) -> None:
        """One tick on the reconciler's thread; cancelled, it still finishes the tick."""
        assert self.reconciler is not None
        done = asyncio.get_running_loop().run_in_executor(self._tick_thread, self.reconciler.tick)
        try:
            await asyncio.shield(done)
        except asyncio.CancelledError:
            with contextlib.suppress(Exception):
                await done
            raise

    async def _reconcile_forever(self) -> None:
        failures, ready = 0, False
        marks_kept = time.monotonic()
        while True:
            began = time.monotonic()
            if began - marks_kept >= _REPLAY_MARKS_EVERY_S:
                self._keep_replay_marks()
                marks_kept = began
            try:
                await self._tick()
                self._last_tick_at = time.monotonic()
                self.metrics.tick_seconds.observe(self._last_tick_at - began)
                failures = 0
                if not ready:
                    ready = True
                    self.notifier.ready(f"reconciling; API {self.api_url or 'off'}, MQTT {self.mqtt_url}")
                self.notifier.watchdog()
            except (StoreError, OSError) as e:
                failures += 1
                log.error("reconciler tick failed (%d in a row): %s", failures, e)
                if failures >= _MAX_FAILED_TICKS:
                    raise
            await asyncio.sleep(pause_after(self.settings.tick_s, time.monotonic() - began))

    def health(self) -> DaemonHealth:
        """Healthy while the reconciler keeps ticking (a stalled loop is the one thing
        an operator must hear about); the MQTT link is reported, not judged."""
        age = None if self._last_tick_at is None else time.monotonic() - self._last_tick_at
        ok = age is not None and age < _STALLED_AFTER_S
        linked = self.link is not None and self.link.connected
        return DaemonHealth(ok=ok, last_tick_age_s=age, mqtt_connected=linked)

    async def _serve_api(self, sock: socket.socket) -> None:
        assert self.service is not None and self.api_tokens is not None and self._api_factory is not None
        app = self._api_factory(self.service, self.api_tokens, self.metrics)
        tls = self.settings
        config = uvicorn.Config(app, log_level="warning", lifespan="off", access_log=False,
                                ssl_certfile=str(tls.tls_cert) if tls.tls_cert else None,
                                ssl_keyfile=str(tls.tls_key) if tls.tls_key else None)
        server = _EmbeddedServer(config)
        try:
            await server.serve(sockets=[sock])
        finally:
            server.should_exit = True


class _EmbeddedServer(uvicorn.Server):
    """uvicorn inside a host program: the host keeps the signal handlers."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


async def _try_broker(link: MqttLink, key: str, what: str = "") -> None:
    try:
        async with asyncio.timeout(10):
            await link.check()
    except (aiomqtt.MqttError, TimeoutError) as e:
        why = str(e) or "no answer in 10 s"
        raise SupervisorError(f"{key}: {what}{link.broker}, which does not answer: {why}") from e


def _secret(path: Path, what: str = "telemetry secret", *, group_may_read: bool = False) -> str:
    """A token or secret kept in ``path`` (supervisor/token_file.py), made on the first start."""
    try:
        return ensure_token(path, what, group_may_read=group_may_read)
    except OSError as e:
        raise SupervisorError(f"{path}: cannot read or create the {what}: {e.strerror}") from e
    except ValueError as e:
        raise SupervisorError(str(e)) from e


def _listen(host: str, port: int) -> socket.socket:
    # IPPROTO_TCP named: asyncio sets TCP_NODELAY only on accepted sockets that say TCP (with
    # proto 0, a keep-alive request's response waited 40 ms for the client's delayed ACK).
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM,
                         socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise SupervisorError(f"cannot listen on {host}:{port} for the API: {e.strerror}") from e
    sock.listen(128)
    sock.setblocking(False)
    return sock

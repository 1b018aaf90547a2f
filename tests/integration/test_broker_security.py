"""The embedded broker against someone on the node network: each test starts the daemon
(its event loop in a thread of the test, a scripted launcher, no API) with the broker
its own code starts, and the attack runs as a second process, a paho client
(``ATTACKER``) that says in one JSON line what the broker let it do. What got through
is seen by a subscriber with the dashboards' login (the API's read-only token).

Every test is named for the exploit it shows refused (supervisor/telemetry/broker.py says who may
do what). Before the broker took logins, each attack succeeded.
"""

from __future__ import annotations

import asyncio
import json
import os
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import paho.mqtt.client as mqtt
import pytest
from paho.mqtt.enums import CallbackAPIVersion

import wire as p
from supervisor.daemon import Cluster, Daemon, DaemonSettings
from supervisor.domain import Policy, run_id_of
from supervisor.errors import SupervisorError
from supervisor.spec import parse_spec
from supervisor.telemetry.broker import READER_PASSWORD_FILE
from supervisor.token_file import READ_TOKEN_FILE_NAME, TELEMETRY_SECRET_NAME, ensure_token
from tests.conftest import REPO, start_mosquitto, stop_by_pid, wait_for
from tests.fakes import ScriptedLauncher

CLUSTER = "sec"
EVENTS = f"tsup/v1/{CLUSTER}/events/#"
TELEMETRY = p.topic_filter(CLUSTER)
PRESENCE = p.presence_topic(CLUSTER)
MARK = b"forged"  # in every payload an attacker publishes

# One client, as the plan (JSON, argv[1]) says: connect (login, client id, clean session,
# will), subscribe, publish, stay a while; then one JSON line of what happened.
ATTACKER = r"""
import json, sys, threading, time
import paho.mqtt.client as mqtt
from paho.mqtt.enums import CallbackAPIVersion

plan = json.loads(sys.argv[1])
out = {"refused": None, "granted": {}, "received": [], "disconnected": False}
answered, subscribed = threading.Event(), threading.Event()

def on_connect(client, _u, _f, rc, _p):
    if out["refused"] is None:
        out["refused"] = rc.is_failure
    answered.set()

def on_subscribe(client, _u, mid, rcs, _p):
    out["granted"][str(mid)] = [not rc.is_failure for rc in rcs]
    subscribed.set()

def on_message(client, _u, m):
    out["received"].append([m.topic, len(m.payload), bytes(m.payload[:64]).decode(errors="replace"), m.retain])

def on_disconnect(client, _u, _f, rc, _p):
    out["disconnected"] = True
    answered.set()

c = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=plan["client_id"], clean_session=plan.get("clean", True))
if plan.get("username") is not None:
    c.username_pw_set(plan["username"], plan.get("password"))
if plan.get("will"):
    will = plan["will"]
    c.will_set(will["topic"], b"x" * will.get("size", 0) or b"forged will", qos=0, retain=will.get("retain", False))
c.on_connect, c.on_subscribe, c.on_message, c.on_disconnect = on_connect, on_subscribe, on_message, on_disconnect
c.reconnect_delay_set(60, 60)  # one try: a refused client must not come back within the test
try:
    c.connect(plan["host"], plan["port"], keepalive=10)
except OSError as e:
    out["refused"] = True
c.loop_start()
answered.wait(10)
ids = {}
if out["refused"] is False and not out["disconnected"]:
    for f in plan.get("subscribe", []):
        ids[c.subscribe(f, qos=1)[1]] = f
    if ids:
        subscribed.wait(5)
    time.sleep(0.3)
    for m in plan.get("publish", []):
        payload = m["payload"].encode() if "payload" in m else b"forged" + b"x" * m.get("size", 0)
        c.publish(m["topic"], payload, qos=m.get("qos", 1), retain=m.get("retain", False))
time.sleep(plan.get("linger", 1.0))
out["granted"] = {ids[int(k)]: v[0] for k, v in out["granted"].items() if int(k) in ids}
if plan.get("vanish"):  # gone without a DISCONNECT: the broker publishes its will
    if c.socket() is not None:
        c.socket().close()
else:
    c.disconnect()
c.loop_stop()
print(json.dumps(out), flush=True)
"""


def attack(port: int, *plans: dict[str, Any]) -> list[dict[str, Any]]:
    """Run each plan as an attacker process, all at once; what each reported."""
    procs = [subprocess.Popen([sys.executable, "-c", ATTACKER, json.dumps({"host": "127.0.0.1", "port": port,
                                                                         "client_id": "attacker", **plan})],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO)
             for plan in plans]
    reports = []
    for proc in procs:
        out, err = proc.communicate(timeout=60)
        assert proc.returncode == 0, err[-3000:]
        reports.append(json.loads(out.strip().splitlines()[-1]))
    return reports


@dataclass
class Listener:
    """A paho client of this process (the dashboard's login unless told another) that
    keeps what it receives."""

    port: int
    username: str
    password: str
    topics: tuple[str, ...] = ()
    client_id: str = "dashboard"
    received: list[tuple[str, bytes, bool]] = field(default_factory=list)
    disconnects: int = 0

    def __post_init__(self) -> None:
        self._lock = threading.Lock()
        self._subscribed = threading.Event()
        self._pending = len(self.topics)
        self.client = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=self.client_id)
        self.client.username_pw_set(self.username, self.password)
        self.client.on_message = self._on_message
        self.client.on_subscribe = self._on_subscribe
        self.client.on_disconnect = self._on_disconnect
        self.client.connect("127.0.0.1", self.port, keepalive=10)
        self.client.loop_start()
        for topic in self.topics:
            self.client.subscribe(topic, qos=1)
        if self.topics:
            assert self._subscribed.wait(10), "the listener's subscriptions"

    def _on_message(self, _c: Any, _u: Any, m: mqtt.MQTTMessage) -> None:
        with self._lock:
            self.received.append((m.topic, bytes(m.payload), bool(m.retain)))

    def _on_subscribe(self, _c: Any, _u: Any, _mid: Any, rcs: Any, _p: Any) -> None:
        assert not any(rc.is_failure for rc in rcs), rcs
        self._pending -= 1
        if self._pending <= 0:
            self._subscribed.set()

    def _on_disconnect(self, *_: Any) -> None:
        self.disconnects += 1

    def got(self) -> list[tuple[str, bytes, bool]]:
        with self._lock:
            return list(self.received)

    def forged(self) -> set[str]:
        """The topics of what it received from an attacker."""
        return {t for t, payload, _ in self.got() if payload.startswith(MARK)}

    def close(self) -> None:
        self.client.on_disconnect = None  # its own going is not counted
        self.client.disconnect()
        self.client.loop_stop()


class AttemptsLive(Daemon):
    """A daemon to whom every attempt is live: the attacks log in as attempts of runs
    nobody submitted (the broker's other checks are the ones under test here)."""

    def _attempt_is_live(self, run_id: str, number: int) -> bool:
        return True


class Running:
    """A daemon started by its own code, in a thread of this process, with its broker."""

    def __init__(self, state: Path, **settings: Any) -> None:
        self.state = state
        self.launcher = ScriptedLauncher()
        self.daemon = AttemptsLive(DaemonSettings(state_dir=state, api_port=None, cluster_id=CLUSTER,
                                                  check_trainer_config=False, allow_root_runs=True,
                                                  **settings),
                                   cluster=Cluster(self.launcher, self.launcher))
        self._ready = threading.Event()
        self._failed: BaseException | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._thread = threading.Thread(target=asyncio.run, args=(self._main(),), daemon=True)
        self._thread.start()
        self._ready.wait(30)
        if self._failed is not None:
            raise self._failed
        assert self._stop is not None, "the daemon did not start in 30 s"
        wait_for(lambda: self.daemon.link is not None and self.daemon.link.connected, 10, "the daemon's link")

    async def _main(self) -> None:
        self._loop, self._stop = asyncio.get_running_loop(), asyncio.Event()
        try:
            async with self.daemon:
                self._ready.set()
                await self.daemon.run(self._stop)
        except BaseException as e:
            self._failed = e
            self._ready.set()

    @property
    def port(self) -> int:
        assert self.daemon.broker is not None
        return self.daemon.broker.port

    def login(self, run: str, attempt: int) -> dict[str, str]:
        secret = (self.state / TELEMETRY_SECRET_NAME).read_text().strip().encode()
        username, password = p.attempt_login(secret, CLUSTER, run, attempt)
        return {"username": username, "password": password}

    def listener(self, *topics: str) -> Listener:
        """A dashboard, logged in as the broker's reader, subscribed to ``topics``."""
        return Listener(self.port, "reader", (self.state / READER_PASSWORD_FILE).read_text().strip(), topics)

    def event(self) -> None:
        """One more event in the daemon's log: its outbox publishes it on the broker."""
        with self.daemon.store.tx() as tx:
            tx.add_event(None, "test.secret", "what only the supervisor's readers may see", {}, time.time())

    def retained(self) -> dict[str, bytes]:
        assert self.daemon.broker is not None
        broker = self.daemon.broker._broker
        return {t: bytes(m.data) for t, m in broker.retained_messages.items()}

    def stop(self) -> None:
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(30)


@pytest.fixture
def running(tmp_path: Path) -> Iterator[Running]:
    state = tmp_path / "state"
    state.mkdir()
    # The API's read-only token, made here as an operator would have it (the broker's reader
    # has a password of its own, which the daemon makes).
    ensure_token(state / READ_TOKEN_FILE_NAME, "read-only API token", group_may_read=True)
    daemon = Running(state)
    try:
        yield daemon
    finally:
        daemon.stop()


def with_events(running: Running, plans: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Run the attackers while the daemon's event log grows (an event every 0.3 s)."""
    done = threading.Event()

    def grow() -> None:
        while not done.wait(0.3):
            running.event()

    grower = threading.Thread(target=grow, daemon=True)
    grower.start()
    try:
        return attack(running.port, *plans)
    finally:
        done.set()
        grower.join(5)


def test_an_anonymous_client_cannot_subscribe_to_the_event_log(running: Running) -> None:
    dashboard = running.listener(EVENTS)
    try:
        anonymous, guessed = with_events(running, [
            {"subscribe": ["tsup/v1/#", "#"], "linger": 2.0},
            {"username": "supervisor", "password": "guessed", "client_id": "training-supervisor-x",
             "subscribe": ["tsup/v1/#"], "linger": 2.0}])
    finally:
        dashboard.close()
    assert anonymous["refused"] and guessed["refused"], (anonymous, guessed)
    assert anonymous["received"] == [] and guessed["received"] == []
    assert any(t.startswith(f"tsup/v1/{CLUSTER}/events/") for t, _, _ in dashboard.got()), \
        "the event log went out meanwhile, to the dashboards' login"


def test_the_apis_read_token_is_no_login_of_the_broker(running: Running) -> None:
    """Issue 37, item 7: the broker's reader logged in with the API's read token, so one
    leaked secret opened both. It has a password of its own (broker-reader-password)."""
    token = (running.state / READ_TOKEN_FILE_NAME).read_text().strip()
    assert token != (running.state / READER_PASSWORD_FILE).read_text().strip()
    [with_token] = with_events(running, [{"username": "reader", "password": token, "client_id": "dash-2",
                                          "subscribe": ["tsup/v1/#"], "linger": 2.0}])
    assert with_token["refused"] and with_token["received"] == [], with_token


def test_a_rank_cannot_read_the_event_log_or_other_ranks_telemetry(running: Running) -> None:
    spy, other = with_events(running, [
        {**running.login("run-1", 1), "client_id": "tsup-run-1-1-0-7",
         "subscribe": [EVENTS, TELEMETRY, "tsup/v1/#", "#", f"tsup/v1/{CLUSTER}/telemetry/run-2/#", PRESENCE],
         "linger": 3.0},
        {**running.login("run-2", 1), "client_id": "tsup-run-2-1-0-8",
         "publish": [{"topic": p.topic_for("run-2", 1, 0, "step", CLUSTER), "qos": 1}] * 5}])
    assert not spy["refused"] and not other["refused"], (spy, other)
    assert spy["granted"] == {EVENTS: False, TELEMETRY: False, "tsup/v1/#": False, "#": False,
                              f"tsup/v1/{CLUSTER}/telemetry/run-2/#": False, PRESENCE: True}, spy["granted"]
    assert [t for t, *_ in spy["received"] if t != PRESENCE] == [], spy["received"]


def test_a_rank_cannot_publish_as_another_attempt(running: Running) -> None:
    dashboard = running.listener(EVENTS, TELEMETRY, PRESENCE)
    own = p.topic_for("run-1", 2, 0, "heartbeat", CLUSTER)
    foreign = [p.topic_for("run-1", 1, r, kind, CLUSTER) for r in (0, 1) for kind in ("lost", "exit", "step")]
    foreign += [p.topic_for("run-2", 1, 0, "lost", CLUSTER), f"tsup/v1/{CLUSTER}/events/run-1",
                f"tsup/v1/{CLUSTER}/telemetry/run-1/1/0/step/x", "tsup/v1/other/telemetry/run-1/2/0/lost"]
    try:
        (report,) = attack(running.port, {
            **running.login("run-1", 2), "client_id": "tsup-run-1-2-0-9",
            "publish": [{"topic": t} for t in foreign] + [{"topic": PRESENCE, "retain": True}, {"topic": own}]})
        # Its messages leave in order on one connection, its own topic's last: once that one
        # arrived, a foreign one the broker had let through would have arrived before it.
        wait_for(lambda: own in dashboard.forged(), 5, "the attacker's message on its own topic")
    finally:
        dashboard.close()
    assert not report["refused"], report
    assert dashboard.forged() == {own}, "only its own attempt's topic took its messages"
    assert running.retained() == {PRESENCE: p.PRESENCE_ONLINE}, "the supervisor's presence stands"


def test_a_retained_flood_is_refused(running: Running) -> None:
    flood = [{"topic": p.topic_for("run-1", 1, r, "heartbeat", CLUSTER), "retain": True, "size": 1000}
             for r in range(300)]
    login = {**running.login("run-1", 1), "client_id": "tsup-run-1-1-0-10"}
    flooder, will = attack(running.port, {**login, "publish": flood, "linger": 2.0}, {
        **login, "client_id": "tsup-run-1-1-1-11", "vanish": True,
        "will": {"topic": p.topic_for("run-1", 1, 1, "lost", CLUSTER), "retain": True}})
    assert not flooder["refused"], flooder
    assert will["refused"], "a will it would have the broker retain is refused with its connection"
    assert running.retained() == {PRESENCE: p.PRESENCE_ONLINE}, "nothing but the supervisor's presence is kept"
    late = running.listener(TELEMETRY, PRESENCE)  # subscribes after the flood: receives what was kept
    try:
        # The broker sends each subscription's retained messages in the order subscribed:
        # once the presence (subscribed last) is in, any telemetry it kept is in too.
        wait_for(lambda: any(t == PRESENCE and retained for t, _, retained in late.got()), 5,
                 "the retained presence")
    finally:
        late.close()
    assert [(t, payload) for t, payload, retained in late.got() if retained] == [(PRESENCE, p.PRESENCE_ONLINE)]


def test_a_huge_packet_is_refused(running: Running) -> None:
    dashboard = running.listener(TELEMETRY)
    own = p.topic_for("run-1", 1, 0, "step", CLUSTER)
    try:
        (huge,) = attack(running.port, {
            **running.login("run-1", 1), "client_id": "tsup-run-1-1-0-12",
            "publish": [{"topic": own, "size": 4 * 1024 * 1024, "qos": 0}, {"topic": own, "qos": 0}]})
        (after,) = attack(running.port, {**running.login("run-1", 1), "client_id": "tsup-run-1-1-0-13",
                                         "publish": [{"topic": own, "qos": 1}]})
        # The attack's connection ended before the next one began: nothing of it comes later.
        wait_for(lambda: dashboard.got(), 5, "the message after the attack")
    finally:
        dashboard.close()
    assert not huge["refused"] and huge["disconnected"], "its connection ended at the packet's header"
    assert not after["refused"] and dashboard.disconnects == 0, "the broker serves on"
    assert [len(payload) for _, payload, _ in dashboard.got()] == [len(MARK)], "nothing of 4 MiB got through"


def test_a_session_takeover_by_client_id_is_refused(running: Running) -> None:
    """A rank's client id is in its Register message; its session must stay its own, or
    10 s of silence would have the supervisor drain its node."""
    victim_id = p.client_id("run-1", 1, 0, 4242)
    own = p.topic_for("run-1", 1, 0, "heartbeat", CLUSTER)
    login = running.login("run-1", 1)
    victim = Listener(running.port, login["username"], login["password"], (PRESENCE,), client_id=victim_id)
    dashboard = running.listener(TELEMETRY)
    beating = threading.Event()

    def beat() -> None:
        while not beating.wait(0.1):
            victim.client.publish(own, b"beat", qos=0)

    beater = threading.Thread(target=beat, daemon=True)
    beater.start()
    try:
        logins: list[dict[str, str]] = [{}, running.login("run-1", 2), running.login("run-1-1", 1),
                                        {"username": "reader",
                                         "password": (running.state / READER_PASSWORD_FILE).read_text().strip()}]
        reports = attack(running.port, *({**login, "client_id": victim_id, "clean": clean, "linger": 0.5}
                                         for login in logins for clean in (True, False)))
        heard = len(dashboard.got())
        wait_for(lambda: len(dashboard.got()) > heard + 5, 5, "the victim's messages after the attacks")
    finally:
        beating.set()
        beater.join(5)
        victim.close()
        dashboard.close()
    assert all(r["refused"] for r in reports), reports
    assert victim.disconnects == 0, "the victim's connection was never taken over"
    assert running.daemon.broker is not None
    assert any(s.client_id == victim_id for s, _ in running.daemon.broker._broker.subscriptions.get(PRESENCE, [])), \
        "nor its subscription dropped"


SPEC = {"name": "told", "resources": {"nodes": 1, "ranks_per_node": 1, "spares": 0}, "trainer": {"steps": 10}}

RANK = """
import os, time
from trainer.telemetry import Telemetry
t = Telemetry.from_env(os.environ, rank=0, local_rank=0, world_size=1, heartbeat_interval_s=0.2)
t.start()
for step in (1, 2, 3):
    t.step_completed(step=step, loss=1.0, grad_norm=1.0, lr=0.1, step_time_s=0.05, tokens_per_s=1.0)
time.sleep(120)
"""


def test_ranks_are_never_told_the_supervisors_password(running: Running) -> None:
    """Ranks get their attempt's own login in their environment, the URL holds none, and
    the supervisor's password (0600 in the state directory) is nowhere in what they get;
    with that login a real rank's telemetry reaches the supervisor."""
    password_file = running.state / "broker-password"
    assert stat.S_IMODE(password_file.stat().st_mode) == 0o600
    supervisor_password = password_file.read_text().strip()
    assert running.daemon.service is not None
    run_id = running.daemon.service.submit(parse_spec(SPEC)).run_id
    spec = wait_for(lambda: running.launcher.started and running.launcher.started[0], 10, "the launch")
    env = spec.env
    assert "@" not in env["TSUP_MQTT_URL"] and not any(supervisor_password in v for v in env.values()), env
    login = running.login(run_id, 1)
    assert (env[p.USERNAME_ENV], env[p.PASSWORD_ENV]) == (login["username"], login["password"])
    assert env[p.PASSWORD_ENV] != env[p.KEY_ENV], "the password is not the attempt's key"
    rank = subprocess.Popen([sys.executable, "-c", RANK], env={**os.environ, **env, "PYTHONPATH": str(REPO)},
                            cwd=REPO)
    try:
        wait_for(lambda: running.daemon.telemetry.max_step(run_id, 1) == 3, 20, "the rank's steps 1..3")
    finally:
        rank.kill()
        rank.wait()
    counts = running.daemon.telemetry.counts_now()
    assert not any(counts.get(k) for k in ("unsigned", "bad_mac", "replay")), counts


def test_ranks_are_never_told_the_supervisors_password_on_an_external_broker(tmp_path: Path) -> None:
    """An external broker's URL with the daemon's login and nothing else for the ranks: the
    daemon does not start, and says to set mqtt_advertise_url; with one, it does."""
    broker, mosquitto = start_mosquitto(tmp_path)  # anonymous: it takes any login
    own = f"mqtt://tsup:sup-secret@127.0.0.1:{broker.port}"
    try:
        for advertised in (None, own):
            state = tmp_path / f"state-{advertised is None}"
            with pytest.raises(SupervisorError) as refused:
                Running(state, mqtt_url=own, mqtt_advertise_url=advertised)
            said = str(refused.value)
            assert said.startswith("mqtt_advertise_url: ") and "sup-secret" not in said, said
        ranks = f"mqtt://rank:rank-secret@127.0.0.1:{broker.port}"
        started = Running(tmp_path / "state", mqtt_url=own, mqtt_advertise_url=ranks)
        try:
            assert started.daemon.mqtt_url == ranks
        finally:
            started.stop()
    finally:
        stop_by_pid(mosquitto)


def test_a_message_replayed_after_a_daemon_restart_is_dropped(tmp_path: Path) -> None:
    """A rank's genuine sealed message, captured, is published again by a second process
    after the daemon restarted. Before: replay state lived only in memory, and the new
    daemon accepted it once (issue 26, item 12)."""
    state = tmp_path / "state"
    state.mkdir()
    ensure_token(state / READ_TOKEN_FILE_NAME, "read-only API token", group_may_read=True)
    first = Running(state)
    secret = (state / TELEMETRY_SECRET_NAME).read_text().strip().encode()
    seal = p.Seal(key=p.attempt_key(secret, CLUSTER, "run-1", 1), conn="00000000000000aa", seq=7)
    beat = p.Heartbeat(run="run-1", attempt=1, rank=0, ts=time.time(), step=3, phase=p.Phase.TRAIN)
    topic, payload = p.encode(beat, cluster=CLUSTER, seal=seal)
    rank = {**first.login("run-1", 1), "client_id": "tsup-run-1-1-0-4242"}
    try:
        attack(first.port, {**rank, "publish": [{"topic": topic, "payload": payload.decode()}]})
        wait_for(lambda: 0 in first.daemon.telemetry.ranks("run-1", 1), 10, "the genuine message")
    finally:
        first.stop()
    second = Running(state)
    try:
        attack(second.port, {**rank, "client_id": "tsup-run-1-1-0-4343",
                             "publish": [{"topic": topic, "payload": payload.decode()}]})
        wait_for(lambda: second.daemon.telemetry.counts_now().get("replay", 0) >= 1
                 or second.daemon.telemetry.counts_now().get("received", 0) >= 1, 10, "the replay to arrive")
        counts = second.daemon.telemetry.counts_now()
        assert counts.get("replay") == 1 and not counts.get("received"), counts
    finally:
        second.stop()


def test_an_ended_attempts_fence_reaches_its_own_agents_only_and_cannot_be_forged(running: Running) -> None:
    """The daemon fences an attempt once it ended (its outbox publishes the fence,
    retained): the attempt's own account reads it, sealed with the attempt's key; another
    attempt's account may not subscribe to it, and no rank may write one."""
    with running.daemon.store.tx() as tx:
        tx.add_event(None, "attempt.ended", "not a run's: no fence", {"attempt": 1}, time.time())
    secret = (running.state / TELEMETRY_SECRET_NAME).read_text().strip().encode()
    with running.daemon.store.tx() as tx:
        run_number = tx.create_run(name="fenced", spec_json="{}", run_dir_root=running.state / "runs", nodes=1,
                                   ranks_per_node=1, spares=0, total_steps=10, policy=Policy(), now=time.time()).number
    assert run_number == 1
    with running.daemon.store.tx() as tx:
        tx.add_event(run_number, "attempt.ended", "attempt 2 ended FAILED at step 25: node-lost",
                     {"attempt": 2, "outcome": "FAILED", "final_step": 25}, time.time())
    fence = p.fence_topic(CLUSTER, "run-1", 2)
    wait_for(lambda: fence in running.retained(), 10, "the fence, retained")
    key = p.attempt_key(secret, CLUSTER, "run-1", 2)
    assert p.fence_reason(running.retained()[fence], fence, key=key, cluster=CLUSTER, run="run-1",
                          attempt=2) == "attempt 2 ended FAILED at step 25: node-lost"
    own, other, forger = attack(running.port, {
        **running.login("run-1", 2), "client_id": "tsup-run-1-2-n0-9", "subscribe": [fence], "linger": 2.0}, {
        **running.login("run-1", 3), "client_id": "tsup-run-1-3-n0-9", "subscribe": [fence], "linger": 2.0}, {
        **running.login("run-1", 3), "client_id": "tsup-run-1-3-0-9",
        "publish": [{"topic": p.fence_topic(CLUSTER, "run-1", 3), "qos": 1, "retain": True}]})
    assert own["granted"] == {fence: True} and [t for t, *_ in own["received"]] == [fence], own
    assert other["granted"] == {fence: False} and other["received"] == [], other
    assert p.fence_topic(CLUSTER, "run-1", 3) not in running.retained(), "a rank wrote a fence"


def test_a_connecting_client_is_not_handed_the_retained_messages_of_other_clients_subscriptions(
        running: Running) -> None:
    """amqtt offers a session that connects the retained messages of every filter any
    session subscribed to. Attempt 2's agent holds a subscription to its fence; attempt 3's
    account then connects, subscribing to nothing: it reads no fence of attempt 2's."""
    with running.daemon.store.tx() as tx:
        run_number = tx.create_run(name="fenced", spec_json="{}", run_dir_root=running.state / "runs", nodes=1,
                                   ranks_per_node=1, spares=0, total_steps=10, policy=Policy(), now=time.time()).number
        tx.add_event(run_number, "attempt.ended", "attempt 2 ended FAILED at step 25: node-lost",
                     {"attempt": 2, "outcome": "FAILED", "final_step": 25}, time.time())
    fence = p.fence_topic(CLUSTER, run_id_of(run_number), 2)
    wait_for(lambda: fence in running.retained(), 10, "the fence, retained")
    login = running.login(run_id_of(run_number), 2)
    agent = Listener(running.port, login["username"], login["password"], (fence,),
                     client_id=f"tsup-{run_id_of(run_number)}-2-n0-7")
    try:
        wait_for(lambda: agent.received, 10, "the agent to read its fence")
        [other] = attack(running.port, {**running.login(run_id_of(run_number), 3),
                                        "client_id": f"tsup-{run_id_of(run_number)}-3-n0-9", "linger": 1.5})
        assert not other["refused"], other
        assert other["received"] == [], other
    finally:
        agent.close()


def test_a_nodes_probe_is_answered_and_refused_without_a_warning_a_strangers_connect_is_not(
        running: Running, caplog: pytest.LogCaptureFixture) -> None:
    """The preflight proves the broker from each node with a CONNECT without a login
    (health/broker.py): the broker answers it (CONNACK 5), and logs it at debug, not as the
    refusal a stranger's CONNECT is."""
    from health import broker

    caplog.set_level("DEBUG", logger="supervisor.telemetry.broker")
    found = broker.probe(f"mqtt://127.0.0.1:{running.port}")
    assert found.status.value == "healthy" and "refused: not authorized" in found.evidence, found
    wait_for(lambda: "a node's probe, answered" in caplog.text, 5, "the probe's debug line")
    assert not [r for r in caplog.records if r.levelname == "WARNING" and "refused" in r.getMessage()]
    [stranger] = attack(running.port, {"client_id": "tsup-probe-x", "linger": 0.1})
    assert stranger["refused"]
    wait_for(lambda: any(r.levelname == "WARNING" and "refused 'anonymous'" in r.getMessage()
                         for r in caplog.records), 5, "the stranger's refusal logged")

"""Telemetry through a mosquitto set up as a site would: TLS with the site's CA, a
password file, and an ACL that lets ranks only write telemetry and the supervisor only
read it (and write its events). Two supervisors of different clusters share it."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import aiomqtt
import pytest

from supervisor.telemetry.link import MqttLink
from supervisor.telemetry.view import TelemetryView
from tests.conftest import SecuredBroker, secure_mosquitto, start_mosquitto, stop_by_pid
from tests.integration.test_mqtt_mosquitto import PUBLISHER, SECRET, until
from wire import attempt_key, parse_broker_url


@pytest.fixture
def secured(tmp_path: Path) -> Iterator[SecuredBroker]:
    broker = secure_mosquitto(tmp_path)
    try:
        yield broker
    finally:
        stop_by_pid(broker.proc)


def rank_env(url: str, cluster: str, node: str, ca_file: Path | None = None) -> dict[str, str]:
    env = {**os.environ, "TSUP_MQTT_URL": url, "TSUP_RUN_ID": "run-3", "TSUP_ATTEMPT": "2", "TSUP_NODE": node,
           "PYTHONPATH": str(Path(__file__).resolve().parents[2]), "TSUP_CLUSTER": cluster,
           "TSUP_TELEMETRY_KEY": attempt_key(SECRET, cluster, "run-3", 2).hex()}
    if ca_file is not None:
        env["TSUP_MQTT_CA_FILE"] = str(ca_file)
    return env


def test_tls_passwords_and_an_acl(secured: SecuredBroker) -> None:
    """The supervisor and a rank, each with its own account over mqtts://: the rank's
    steps arrive under an ACL that lets it write telemetry and nothing else."""
    async def scenario() -> None:
        view = TelemetryView(cluster="it", secret=SECRET)
        link = MqttLink(parse_broker_url(secured.url("supervisor")), view,
                        clock=lambda: asyncio.get_running_loop().time(), ca_file=secured.ca_file)
        task = asyncio.create_task(link.run())
        proc = None
        try:
            await until(lambda: link.connected, 10, "the supervisor to subscribe over TLS")
            proc = subprocess.Popen([sys.executable, "-c", PUBLISHER],
                                    env=rank_env(secured.url("rank"), "it", "local-9", secured.ca_file))
            await until(lambda: view.max_step("run-3", 2) == 3, 30, "steps 1..3 over TLS")
            assert view.ranks("run-3", 2)[1].node == "local-9"
            counts = view.counts_now()
            assert not {k: v for k, v in counts.items() if k in ("unsigned", "bad_mac", "replay") and v}, counts
            assert await link.publish("tsup/v1/it/events/run-3/attempt.started", b"{}"), "events are writable"
        finally:
            if proc is not None:
                proc.kill()
                proc.wait()
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    asyncio.run(scenario())


def test_bad_credentials_and_an_unknown_ca_are_refused(secured: SecuredBroker) -> None:
    """What serve's start-up check (`_try_broker`) turns into a one-line error."""
    async def refused(url: str, ca_file: Path | None) -> str:
        link = MqttLink(parse_broker_url(url), TelemetryView(), clock=lambda: 0.0, ca_file=ca_file)
        with pytest.raises(aiomqtt.MqttError) as e:
            await link.check()
        return str(e.value)

    async def scenario() -> None:
        assert "authoriz" in (await refused(secured.url("supervisor", "wrong"), secured.ca_file)).lower()
        assert "certificate" in (await refused(secured.url("supervisor"), None)).lower()  # not the system's CA
        plain = f"mqtt://supervisor:{'sup-pass'}@127.0.0.1:{secured.broker.port}"
        await refused(plain, None)  # no TLS against a TLS listener

    asyncio.run(scenario())


def test_two_clusters_on_one_broker_never_see_each_other(tmp_path: Path) -> None:
    """Two supervisors (clusters `west` and `east`) on one broker, each with a rank of its
    own run-3 attempt 2: each hears its own rank only; neither even receives the other's."""
    broker, mosquitto = start_mosquitto(tmp_path)

    async def scenario() -> None:
        clock = asyncio.get_running_loop().time
        views = {c: TelemetryView(cluster=c, secret=SECRET) for c in ("west", "east")}
        links = [MqttLink(parse_broker_url(broker.url), v, clock=clock, client_id=f"tsup-{c}")
                 for c, v in views.items()]
        tasks = [asyncio.create_task(link.run()) for link in links]
        procs = []
        try:
            await until(lambda: all(link.connected for link in links), 10, "both supervisors to subscribe")
            procs = [subprocess.Popen([sys.executable, "-c", PUBLISHER], env=rank_env(broker.url, c, f"{c}-node"))
                     for c in views]
            for c, v in views.items():
                await until(lambda v=v: v.max_step("run-3", 2) == 3, 30, f"{c}'s rank")
                assert {r.node for r in v.ranks("run-3", 2).values()} == {f"{c}-node"}
                counts = v.counts_now()
                assert not any(counts.get(k) for k in ("unsigned", "bad_mac", "replay", "malformed")), counts
        finally:
            for proc in procs:
                proc.kill()
                proc.wait()
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    try:
        asyncio.run(scenario())
    finally:
        stop_by_pid(mosquitto)

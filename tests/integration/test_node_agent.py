"""The node agent (node/agent.py) as a real process, through a real mosquitto."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import paho.mqtt.client as mqtt
from paho.mqtt.enums import CallbackAPIVersion

import wire as p
from supervisor.telemetry.link import MqttLink
from supervisor.telemetry.view import TelemetryView
from tests.conftest import Broker, wait_for
from tests.integration.test_mqtt_mosquitto import SECRET, publisher_env, until

# Two ranks of one node in aggregated mode, under an agent: steps 1..3, then wait.
RANK = """
import os, sys, time
from trainer.telemetry import Telemetry
rank = int(sys.argv[1])
t = Telemetry.from_env(os.environ, rank=rank, local_rank=rank, world_size=2, local_world_size=2,
                       heartbeat_interval_s=0.2)
t.start()
for step in (1, 2, 3):
    t.step_completed(step=step, loss=1.0, grad_norm=1.0, lr=0.1, step_time_s=0.05, tokens_per_s=1.0)
print("ranked", flush=True)
time.sleep(120)
"""


def node_env(broker: Broker, slots: Path) -> dict[str, str]:
    return {**publisher_env(broker), "TSUP_TELEMETRY_AGGREGATE": "node", "TSUP_SLOTS_DIR": str(slots),
            "MASTER_PORT": "29500", p.NODE_AGENT_ENV: "1", "TSUP_NODE_INDEX": "0",
            "TSUP_AGENT_INTERVAL_S": "0.2"}


def agent(env: dict[str, str]) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-m", "node.agent"], env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)


def _scenario(broker: Broker, body: Callable[[TelemetryView, list[subprocess.Popen[bytes]]], object]) -> None:
    async def run() -> None:
        view = TelemetryView(cluster="it", secret=SECRET)
        loop = asyncio.get_running_loop()
        link = MqttLink(p.parse_broker_url(broker.url), view, clock=loop.time)
        task = asyncio.create_task(link.run())
        procs: list[subprocess.Popen[bytes]] = []
        try:
            await until(lambda: link.connected, 10, "the supervisor to subscribe")
            await body(view, procs)  # type: ignore[misc]
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
                proc.wait()
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    asyncio.run(run())


def test_the_agent_reports_its_node_and_its_ranks_slots_and_leaves_a_will(mosquitto: Broker, tmp_path: Path) -> None:
    """The ranks keep slots and send no node report of their own (TSUP_NODE_AGENT=1); the
    agent reports the node with every slot in it. Stopped with SIGTERM it leaves no will;
    killed outright, its will says the node went."""
    env = node_env(mosquitto, tmp_path / "slots")

    async def body(view: TelemetryView, procs: list[subprocess.Popen[bytes]]) -> None:
        procs += [subprocess.Popen([sys.executable, "-c", RANK, str(r)], env=env) for r in (0, 1)]
        procs.append(agent(env))
        await until(lambda: "local-9" in view.agents("run-3", 2), 20, "the agent's first report")
        await until(lambda: {r: s.last_step for r, s in view.ranks("run-3", 2).items()} == {0: 3, 1: 3}, 20,
                    "both ranks at step 3, from the agent's report of their slots")
        seen = view.agents("run-3", 2)["local-9"]
        assert (seen.index, seen.pid, seen.lost) == (0, procs[2].pid, False)
        counts = view.counts_now()
        assert counts.get("node", 0) == 0 and counts["agent"] >= 1, counts
        before = seen.last_seen_at
        await until(lambda: (view.agents("run-3", 2)["local-9"].last_seen_at or 0) > (before or 0), 5,
                    "a second report")

        procs[2].send_signal(signal.SIGTERM)
        assert procs[2].wait(10) == 0
        await asyncio.sleep(1.0)
        assert not view.agents("run-3", 2)["local-9"].lost, "a clean stop is no node loss"

        procs.append(agent(env))
        await until(lambda: view.agents("run-3", 2)["local-9"].pid == procs[3].pid, 20, "the new agent")
        os.kill(procs[3].pid, signal.SIGKILL)
        await until(lambda: view.agents("run-3", 2)["local-9"].lost, 20, "the killed agent's will")
        assert view.counts_now().get("will_unattributed", 0) == 0

    _scenario(mosquitto, body)


def test_an_agent_with_an_environment_it_cannot_use_stays_up_and_silent(mosquitto: Broker, tmp_path: Path) -> None:
    """The agent is its node's own process on the local launcher: a bad setting is logged,
    and it does not end (which would read as its node's death)."""
    env = {**node_env(mosquitto, tmp_path / "slots"), "TSUP_NODE_INDEX": "first"}
    proc = subprocess.Popen([sys.executable, "-m", "node.agent"], env=env, stderr=subprocess.PIPE)
    try:
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(3)
        assert proc.poll() is None, "it ended on its own"
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=10)
        assert proc.returncode == 0
        assert b"TSUP_NODE_INDEX (or SLURM_NODEID): expected the node's index, got 'first'" in err
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_fence_ends_what_is_left_of_its_attempt_on_the_node_and_a_forged_one_nothing(
        mosquitto: Broker, tmp_path: Path) -> None:
    """The attempt has ended, but a rank of it lives on (its node was cut off while the
    supervisor ended it). A forged fence, retained before the agent connects, changes
    nothing; the authentic one (retained too: an agent back from a partition reads it on
    reconnecting) has the agent SIGKILL the attempt's processes on its node, and only
    those, and end."""
    marker = str(tmp_path / "attempts" / "2" / "trainer.json")
    env = {**node_env(mosquitto, tmp_path / "slots"), "TSUP_MARKER": marker}
    sleeper = [sys.executable, "-c", "import time; time.sleep(120)"]
    leftover = subprocess.Popen(sleeper, env=env)
    other = subprocess.Popen(sleeper, env={**env, "TSUP_MARKER": marker + ".next"})  # the next attempt's
    key = p.attempt_key(SECRET, "it", "run-3", 2)
    publisher = mqtt.Client(CallbackAPIVersion.VERSION2, client_id="supervisor-test")
    publisher.connect(mosquitto.host, mosquitto.port)
    publisher.loop_start()
    log = tmp_path / "agent.log"
    procs = [leftover, other]
    try:
        forged = p.encode_fence("run-3", 2, "forged", key=b"not the key" * 3, cluster="it")
        publisher.publish(*forged, qos=1, retain=True).wait_for_publish(5)
        with open(log, "wb") as out:
            procs.append(subprocess.Popen([sys.executable, "-m", "node.agent"], env=env, stdout=out,
                                          stderr=subprocess.STDOUT))
        wait_for(lambda: "ignored a fence" in log.read_text(), 20, "the agent to read the forged fence")
        assert leftover.poll() is None and procs[2].poll() is None, "a forged fence was obeyed"
        genuine = p.encode_fence("run-3", 2, "attempt 2 ended FAILED at step 25: node-lost", key=key, cluster="it")
        publisher.publish(*genuine, qos=1, retain=True).wait_for_publish(5)
        assert leftover.wait(20) == -signal.SIGKILL
        assert procs[2].wait(20) == 0, log.read_text()
        assert other.poll() is None, "a process of another attempt was killed"
        said = log.read_text()
        assert "fenced (attempt 2 ended FAILED at step 25: node-lost): SIGKILL to 1 process(es)" in said, said
    finally:
        publisher.loop_stop()
        publisher.disconnect()
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait()


def test_a_fence_is_authentic_only_for_its_own_attempt_and_topic() -> None:
    key = p.attempt_key(SECRET, "it", "run-3", 2)
    topic, payload = p.encode_fence("run-3", 2, "ended", key=key, cluster="it")
    assert p.fence_reason(payload, topic, key=key, cluster="it", run="run-3", attempt=2) == "ended"
    assert p.fence_reason(payload, topic, key=key, cluster="it", run="run-3", attempt=3) is None
    assert p.fence_reason(payload, p.fence_topic("it", "run-3", 3), key=key, cluster="it", run="run-3",
                          attempt=3) is None
    other_key = p.attempt_key(SECRET, "it", "run-3", 3)
    assert p.fence_reason(payload, topic, key=other_key, cluster="it", run="run-3", attempt=2) is None
    assert p.fence_reason(b"", topic, key=key, cluster="it", run="run-3", attempt=2) is None  # cleared
    tampered = payload.replace(b"ended", b"ENDED")
    assert p.fence_reason(tampered, topic, key=key, cluster="it", run="run-3", attempt=2) is None

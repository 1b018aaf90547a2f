"""Telemetry through a real mosquitto: trainer publisher -> broker -> supervisor's MqttLink."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from pathlib import Path

import paho.mqtt.client as mqtt
from paho.mqtt.enums import CallbackAPIVersion

from supervisor.telemetry.link import MqttLink
from supervisor.telemetry.view import TelemetryView
from tests.conftest import Broker, start_mosquitto, stop_by_pid
from wire import StepMetrics, attempt_key, encode, parse_broker_url

# One rank's publisher: registers, completes steps 1..3, then waits to be killed.
PUBLISHER = """
import os, sys, time
from trainer.telemetry import Telemetry
t = Telemetry.from_env(os.environ, rank=1, local_rank=1, world_size=2, heartbeat_interval_s=0.2)
t.start()
for step in (1, 2, 3):
    t.step_completed(step=step, loss=3.0 - step, grad_norm=1.0, lr=0.1, step_time_s=0.05, tokens_per_s=1.0)
print("published", flush=True)
time.sleep(120)
"""


async def until(predicate, timeout_s: float, what: str) -> None:  # type: ignore[no-untyped-def]
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not predicate():
        if loop.time() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        await asyncio.sleep(0.05)


SECRET = b"the supervisor's secret"


def publisher_env(broker: Broker) -> dict[str, str]:
    return {**os.environ, "TSUP_MQTT_URL": broker.url, "TSUP_RUN_ID": "run-3", "TSUP_ATTEMPT": "2",
            "TSUP_NODE": "local-9", "PYTHONPATH": str(Path(__file__).resolve().parents[2]),
            "TSUP_CLUSTER": "it", "TSUP_TELEMETRY_KEY": attempt_key(SECRET, "it", "run-3", 2).hex()}


def test_rank_telemetry_malformed_messages_and_last_will(mosquitto: Broker) -> None:
    """A rank sealing with its attempt's key, through a real broker: its messages and its
    last will are taken; malformed ones and a well-formed forgery are dropped and counted."""
    async def scenario() -> None:
        view = TelemetryView(cluster="it", secret=SECRET)
        link = MqttLink(parse_broker_url(mosquitto.url), view, clock=lambda: asyncio.get_running_loop().time())
        task = asyncio.create_task(link.run())
        proc = None
        try:
            await until(lambda: link.connected, 10, "the supervisor to subscribe")
            proc = subprocess.Popen([sys.executable, "-c", PUBLISHER], env=publisher_env(mosquitto))
            await until(lambda: view.max_step("run-3", 2) == 3, 20, "steps 1..3 from rank 1")
            rank = view.ranks("run-3", 2)[1]
            assert (rank.node, rank.pid) == ("local-9", proc.pid)
            await until(lambda: view.counts["heartbeat"] >= 2, 10, "heartbeats")

            raw = mqtt.Client(CallbackAPIVersion.VERSION2, client_id="vandal")
            raw.connect(mosquitto.host, mosquitto.port)
            raw.loop_start()
            raw.publish("tsup/v1/it/telemetry/run-3/2/1/step", b"{not json").wait_for_publish(5)
            raw.publish("tsup/v1/it/telemetry/run-3/2/1/step", b'{"v": 7}').wait_for_publish(5)
            raw.publish(*encode(StepMetrics(run="run-3", attempt=2, rank=1, ts=0.0, step=9, loss=float("nan"),
                                            grad_norm=1.0, lr=0.1, step_time_s=0.1, tokens_per_s=1.0),
                                cluster="it")).wait_for_publish(5)
            raw.loop_stop()
            raw.disconnect()
            await until(lambda: view.counts["malformed"] == 2 and view.counts["unsigned"] == 1, 10,
                        "two malformed messages and a forgery counted")
            assert view.max_step("run-3", 2) == 3 and view.ranks("run-3", 2)[1].nonfinite_step is None

            os.kill(proc.pid, signal.SIGKILL)
            await until(lambda: view.ranks("run-3", 2)[1].lost, 20, "the rank's last will")
            assert view.peek_durable() == []  # rank 1's steps are not persisted
        finally:
            if proc is not None and proc.poll() is None:
                proc.kill()
            if proc is not None:
                proc.wait()
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    asyncio.run(scenario())


# A rank training through an outage: a step every 0.1 s until STEPS, then a clean close.
STEADY_PUBLISHER = """
import os, time
from trainer.telemetry import Telemetry
t = Telemetry.from_env(os.environ, rank=0, local_rank=0, world_size=1, heartbeat_interval_s=0.5)
t.start()
for step in range(1, int(os.environ["STEPS"]) + 1):
    t.step_completed(step=step, loss=1.0, grad_norm=1.0, lr=0.1, step_time_s=0.1, tokens_per_s=1.0)
    time.sleep(0.1)
t.close(exit_code=0, final_step=step, reason="done")
"""

# Past both reconnect backoffs' caps (the rank's 2 s, the link's 1 s) several times over:
# a longer outage would wait the same at its end.
OUTAGE_S = 10.0


def steady_rank(broker: Broker, steps: int) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-c", STEADY_PUBLISHER],
                            env={**publisher_env(broker), "STEPS": str(steps)})


async def _stop(rank: subprocess.Popen[bytes] | None, link_task: asyncio.Task[None]) -> None:
    """Kill the rank if it still runs, and stop the supervisor's link."""
    if rank is not None and rank.poll() is None:
        rank.kill()
        rank.wait()
    link_task.cancel()
    await asyncio.gather(link_task, return_exceptions=True)


def test_a_broker_down_for_10_s_hears_the_ranks_within_5_s_of_its_return(tmp_path: Path) -> None:
    """The broker stopped for 10 s under a live rank and started again on its port: the
    supervisor hears the rank again within 5 s, and gets the steps made meanwhile (the
    rank's buffer), none twice."""
    broker, proc = start_mosquitto(tmp_path)
    steps = 250  # 25 s of training: begun before the outage, ended after it

    async def scenario() -> None:
        nonlocal proc
        loop = asyncio.get_running_loop()
        view = TelemetryView(cluster="it", secret=SECRET)
        link = MqttLink(parse_broker_url(broker.url), view, clock=loop.time)
        task = asyncio.create_task(link.run())
        rank = None
        try:
            await until(lambda: link.connected, 10, "the supervisor to subscribe")
            rank = steady_rank(broker, steps)
            await until(lambda: view.max_step("run-3", 2) >= 20, 30, "the rank's first steps")
            stop_by_pid(proc)
            down_at_step = view.max_step("run-3", 2)
            await asyncio.sleep(OUTAGE_S)
            _, proc = start_mosquitto(tmp_path, port=broker.port)
            back = loop.time()
            await until(lambda: view.max_step("run-3", 2) > down_at_step, 10, "the rank heard again")
            heard_after_s = loop.time() - back
            assert heard_after_s < 5.0, f"heard {heard_after_s:.1f} s after the broker's return"
            # Steps made while the broker was away (about 100 of them) arrive from the buffer.
            await until(lambda: rank.poll() is not None and view.ranks("run-3", 2)[0].exit_code == 0, 60,
                        "the rank to finish")
            assert view.max_step("run-3", 2) == steps
            counts = view.counts_now()
            # QoS 0: a message written in the instant the broker went, before the rank saw
            # its connection close, is lost; everything after that waits in the buffer.
            assert steps - 2 <= counts["step"] <= steps, f"{counts['step']} of {steps} steps arrived"
            assert counts.get("replay", 0) == 0 and counts.get("bad_mac", 0) == 0
        finally:
            await _stop(rank, task)

    try:
        asyncio.run(scenario())
    finally:
        stop_by_pid(proc)


def test_an_unreachable_broker_never_marks_the_link_up() -> None:
    async def scenario() -> None:
        view = TelemetryView()
        link = MqttLink(parse_broker_url("mqtt://127.0.0.1:1"), view, clock=lambda: 0.0)
        task = asyncio.create_task(link.run())
        await asyncio.sleep(1.0)
        assert view.up_since is None and not link.connected
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    asyncio.run(scenario())


def test_ranks_back_before_the_supervisor_keep_their_buffer_until_it_is_subscribed(tmp_path: Path) -> None:
    """The broker returns and the rank reconnects at once, but the supervisor comes back
    only 4 s later (a daemon restart): the rank holds what it buffered until the
    supervisor's presence says it listens, so the steps of the outage are not published
    to nobody (QoS 0 keeps nothing for an absent subscriber)."""
    broker, proc = start_mosquitto(tmp_path)
    steps = 150  # 15 s of training

    async def scenario() -> None:
        nonlocal proc
        loop = asyncio.get_running_loop()
        view = TelemetryView(cluster="it", secret=SECRET)
        link = MqttLink(parse_broker_url(broker.url), view, clock=loop.time)
        task = asyncio.create_task(link.run())
        rank = None
        try:
            await until(lambda: link.connected, 10, "the supervisor to subscribe")
            rank = steady_rank(broker, steps)
            await until(lambda: view.max_step("run-3", 2) >= 10, 30, "the rank's first steps")
            task.cancel()  # the supervisor goes away, and the broker with it
            await asyncio.gather(task, return_exceptions=True)
            stop_by_pid(proc)
            await asyncio.sleep(3)
            _, proc = start_mosquitto(tmp_path, port=broker.port)
            await asyncio.sleep(4)  # the rank reconnects meanwhile (its backoff is at most 2 s)
            task = asyncio.create_task(link.run())
            await until(lambda: rank.poll() is not None and view.ranks("run-3", 2)[0].exit_code == 0, 60,
                        "the rank to finish")
            counts = view.counts_now()
            assert steps - 2 <= counts["step"] <= steps, f"{counts['step']} of {steps} steps arrived"
        finally:
            await _stop(rank, task)

    try:
        asyncio.run(scenario())
    finally:
        stop_by_pid(proc)

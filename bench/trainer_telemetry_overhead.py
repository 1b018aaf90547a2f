"""Cost of one telemetry publish on the training thread, by broker condition.

For each condition, starts a trainer.telemetry.Telemetry, then times ``--messages``
calls of ``step_completed`` (what the train loop calls once per step) and prints one
JSON object with p50/p99/max microseconds per call and the publisher's counters:

    up        an embedded amqtt broker on a free local port, connected before timing
    absent    a local port nobody listens on (connection refused, retried with backoff)
    silent    a listener that accepts TCP connections and never answers (no CONNACK)
    disabled  TSUP_MQTT_URL unset: the no-op publisher

    PYTHONPATH=. python bench/trainer_telemetry_overhead.py --messages 20000
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from amqtt.broker import Broker

from supervisor.ports import free_port
from trainer.telemetry import Telemetry
from trainer.telemetry_env import Broker as BrokerAddress
from trainer.telemetry_env import Identity
from wire import BrokerUrl

IDENTITY = Identity(run="bench", attempt=1, rank=0, local_rank=0, world_size=1, node="bench")


@contextmanager
def amqtt_broker() -> Iterator[BrokerAddress]:
    port = free_port()
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    broker = Broker({
        "listeners": {"default": {"type": "tcp", "bind": f"127.0.0.1:{port}"}},
        "plugins": {"amqtt.plugins.authentication.AnonymousAuthPlugin":
                    {"allow_anonymous": True}},
    }, loop=loop)
    asyncio.run_coroutine_threadsafe(broker.start(), loop).result(timeout=30)
    try:
        yield BrokerAddress(BrokerUrl("127.0.0.1", port))
    finally:
        asyncio.run_coroutine_threadsafe(broker.shutdown(), loop).result(timeout=30)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=10)


@contextmanager
def silent_listener() -> Iterator[BrokerAddress]:
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        yield BrokerAddress(BrokerUrl("127.0.0.1", listener.getsockname()[1]))


def measure(address: BrokerAddress | None, messages: int, wait_connected: bool,
            pace_s: float) -> dict[str, Any]:
    telemetry = Telemetry(IDENTITY, address, heartbeat_interval_s=1.0)
    telemetry.start()
    if wait_connected:
        deadline = time.monotonic() + 30
        while not telemetry.connected and time.monotonic() < deadline:
            time.sleep(0.01)
        assert telemetry.connected, "publisher did not connect to the embedded broker"
    samples_ns = []
    for step in range(1, messages + 1):
        started = time.perf_counter_ns()
        telemetry.step_completed(step=step, loss=2.5, grad_norm=0.7, lr=3e-4,
                                 step_time_s=0.05, tokens_per_s=1e4)
        samples_ns.append(time.perf_counter_ns() - started)
        if pace_s:
            time.sleep(pace_s)  # leave the sender time to drain, like real steps do
    close_started = time.monotonic()
    telemetry.close(exit_code=0, final_step=messages, reason="finished")
    close_s = time.monotonic() - close_started
    samples_ns.sort()

    def pct(q: float) -> float:
        return round(samples_ns[min(len(samples_ns) - 1, int(q * len(samples_ns)))] / 1e3, 2)

    return {"p50_us": pct(0.50), "p99_us": pct(0.99), "max_us": round(samples_ns[-1] / 1e3, 2),
            "close_s": round(close_s, 3), **telemetry.stats()}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--messages", type=int, default=20000)
    parser.add_argument("--pace-us", type=float, default=50.0,
                        help="sleep between publishes; 0 = a burst that overflows the queue")
    args = parser.parse_args()
    logging.getLogger("amqtt").setLevel(logging.CRITICAL)  # shutdown noise, not results
    pace_s = args.pace_us / 1e6
    results: dict[str, Any] = {"messages": args.messages, "pace_us": args.pace_us}
    with amqtt_broker() as address:
        results["up"] = measure(address, args.messages, True, pace_s)
    refused = BrokerAddress(BrokerUrl("127.0.0.1", free_port()))
    results["absent"] = measure(refused, args.messages, False, pace_s)
    with silent_listener() as address:
        results["silent"] = measure(address, args.messages, False, pace_s)
    results["disabled"] = measure(None, args.messages, False, pace_s)
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()

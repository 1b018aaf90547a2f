"""A throwaway mosquitto for the benchmarks (bench/scale.py, bench/overhead.py).

``mosquitto(workdir)`` starts ``mosquitto`` on a free loopback port (or on ``host``: the
Slurm box's bridge address, bench/_mttr_slurm.py) with a config
written into ``workdir`` (anonymous, no persistence, like the integration tests'
broker), waits until it listens, and stops it by its pid on the way out, SIGKILL
after 10 s. ``sys_interval`` makes it publish its ``$SYS`` counters that often.

``BrokerCounters`` follows the broker's own message counters ($SYS/broker/publish/
messages/{received,sent,dropped}): what it took in, what it passed on to subscribers,
and what it threw away (an outgoing queue over its limit, a slow subscriber).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import paho.mqtt.client as mqtt
from paho.mqtt.enums import CallbackAPIVersion
from trainer_step_time import free_port

SYS_COUNTERS = "$SYS/broker/publish/messages/"


@dataclass(frozen=True, slots=True)
class Mosquitto:
    host: str
    port: int
    pid: int
    version: str

    @property
    def url(self) -> str:
        return f"mqtt://{self.host}:{self.port}"


def binary() -> str:
    found = shutil.which("mosquitto") or ("/usr/sbin/mosquitto" if os.path.exists("/usr/sbin/mosquitto")
                                           else None)
    if found is None:
        raise SystemExit("mosquitto is not installed (apt-get install mosquitto)")
    return found


def _listening(host: str, port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.2)
        return s.connect_ex((host, port)) == 0


def _version(path: str) -> str:
    out = subprocess.run([path, "-h"], capture_output=True, text=True, timeout=10, check=False).stdout
    first = out.splitlines()[0] if out else ""
    return first.removeprefix("mosquitto version ").strip()


@contextlib.contextmanager
def mosquitto(workdir: Path, *, sys_interval: int | None = None,
              host: str = "127.0.0.1") -> Iterator[Mosquitto]:
    path = binary()
    port = free_port()
    conf = workdir / f"mosquitto-{port}.conf"
    lines = [f"listener {port} {host}", "allow_anonymous true", "persistence false"]
    if sys_interval is not None:
        lines.append(f"sys_interval {sys_interval}")
    conf.write_text("\n".join(lines) + "\n")
    log_path = workdir / f"mosquitto-{port}.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([path, "-c", str(conf)], stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 10
        while not _listening(host, port):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"mosquitto did not start: {log_path.read_text()[-2000:]}")
            time.sleep(0.05)
        yield Mosquitto(host, port, proc.pid, _version(path))
    finally:
        stop(proc)


def stop(proc: subprocess.Popen[Any]) -> None:
    """SIGTERM by pid, SIGKILL after 10 s; a no-op for a process already gone."""
    if proc.poll() is not None:
        return
    os.kill(proc.pid, signal.SIGTERM)
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()


class BrokerCounters:
    """The latest values of the broker's $SYS publish counters (needs ``sys_interval``)."""

    def __init__(self, broker: Mosquitto) -> None:
        self._values: dict[str, int] = {}
        self._lock = threading.Lock()
        self._client = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=f"bench-sys-{os.getpid()}")
        self._client.on_connect = lambda c, *_: c.subscribe(SYS_COUNTERS + "#")
        self._client.on_message = self._on_message
        self._client.connect(broker.host, broker.port)
        self._client.loop_start()

    def _on_message(self, _c: Any, _u: Any, message: mqtt.MQTTMessage) -> None:
        name = message.topic.removeprefix(SYS_COUNTERS)
        with contextlib.suppress(ValueError), self._lock:
            self._values[name] = int(message.payload)

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self._values)

    def close(self) -> None:
        self._client.disconnect()
        self._client.loop_stop()

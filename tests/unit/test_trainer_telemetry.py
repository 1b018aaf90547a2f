"""trainer.telemetry without a broker: settings, and never blocking the training thread.

Delivery to a real broker (Register, will, Exit) is covered by
tests/integration/test_trainer_resume.py.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator

import pytest

from trainer.errors import UsageError
from trainer.protocol import Phase
from trainer.telemetry import Broker, Identity, Telemetry, parse_mqtt_url, settings_from_env

IDENTITY = Identity(run="run-1", attempt=1, rank=0, local_rank=0, world_size=1, node="n1")


def test_settings_defaults_and_overrides() -> None:
    identity, broker = settings_from_env({}, rank=3, local_rank=1, world_size=4)
    assert broker is None
    assert (identity.run, identity.attempt, identity.rank, identity.local_rank,
            identity.world_size) == ("run-local", 1, 3, 1, 4)
    assert identity.node  # the host name
    identity, broker = settings_from_env(
        {"TSUP_MQTT_URL": "mqtt://broker.example:1884", "TSUP_RUN_ID": "run-42",
         "TSUP_ATTEMPT": "3", "TSUP_NODE": "node7"}, rank=0, local_rank=0, world_size=1)
    assert broker == Broker("broker.example", 1884)
    assert (identity.run, identity.attempt, identity.node) == ("run-42", 3, "node7")
    assert parse_mqtt_url("mqtt://h") == Broker("h", 1883)


@pytest.mark.parametrize("env", [
    {"TSUP_MQTT_URL": "http://h:1"}, {"TSUP_MQTT_URL": "mqtt://h:notaport"},
    {"TSUP_RUN_ID": "has/slash"}, {"TSUP_ATTEMPT": "0"}, {"TSUP_ATTEMPT": "x"},
])
def test_bad_settings_are_usage_errors(env: dict[str, str]) -> None:
    with pytest.raises(UsageError):
        settings_from_env(env, rank=0, local_rank=0, world_size=1)


def test_disabled_telemetry_is_a_no_op() -> None:
    telemetry = Telemetry(IDENTITY, None, heartbeat_interval_s=0.01)
    telemetry.start()
    telemetry.set_phase(Phase.TRAIN, 0)
    telemetry.step_completed(step=1, loss=1.0, grad_norm=1.0, lr=1e-3, step_time_s=0.1,
                             tokens_per_s=1.0)
    telemetry.close(exit_code=0, final_step=1, reason="finished")
    assert telemetry.stats() == {"sent": 0, "dropped_queue_full": 0,
                                 "dropped_not_connected": 0}


@pytest.fixture(params=["refused", "silent"])
def unusable_broker(request: pytest.FixtureRequest) -> Iterator[Broker]:
    """A port nobody listens on, or a listener that accepts and never answers."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    if request.param == "refused":
        listener.close()
    else:
        listener.listen(8)  # the kernel completes handshakes; CONNACK never comes
    yield Broker("127.0.0.1", port)
    listener.close()


def test_publishing_never_blocks_when_the_broker_is_unusable(unusable_broker: Broker) -> None:
    telemetry = Telemetry(IDENTITY, unusable_broker, heartbeat_interval_s=0.05, queue_size=8)
    telemetry.start()
    slowest_s = 0.0
    for step in range(1, 2001):
        started = time.perf_counter()
        telemetry.step_completed(step=step, loss=1.0, grad_norm=0.5, lr=1e-3,
                                 step_time_s=0.1, tokens_per_s=100.0)
        slowest_s = max(slowest_s, time.perf_counter() - started)
    # Well below a millisecond each in practice; the bound only guards against blocking
    # on the network (a connect timeout is seconds).
    assert slowest_s < 0.05
    assert not telemetry.connected
    # The queue holds 8 (one is the initial PhaseChange); everything else is counted.
    assert telemetry.dropped_queue_full >= 2000 - 8
    started = time.monotonic()
    telemetry.close(exit_code=0, final_step=2000, reason="finished", timeout_s=2.0)
    assert time.monotonic() - started < 2.5
    assert telemetry.stats()["sent"] == 0

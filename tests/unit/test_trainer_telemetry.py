"""trainer.telemetry without a broker: settings, and never blocking the training thread.

Delivery to a real broker (Register, will, Exit) is covered by
tests/integration/test_trainer_resume.py.
"""

from __future__ import annotations

import math
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from trainer.telemetry import Telemetry
from trainer.telemetry_env import (
    Aggregation,
    Broker,
    Identity,
    aggregation_from_env,
    parse_mqtt_url,
    settings_from_env,
)
from wire import BrokerUrl, Phase
from wire.errors import UsageError
from wire.slots import SLOT_BYTES, NodeSlots, slot_path, unpack

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
    assert broker == Broker(BrokerUrl("broker.example", 1884))
    assert (identity.run, identity.attempt, identity.node) == ("run-42", 3, "node7")
    on_slurm, _ = settings_from_env({"SLURMD_NODENAME": "trn1-12"}, rank=0, local_rank=0, world_size=1)
    assert on_slurm.node == "trn1-12", "Slurm's node name, where the launcher sets none"
    assert parse_mqtt_url("mqtt://h") == BrokerUrl("h", 1883)
    _, sealed = settings_from_env(
        {"TSUP_MQTT_URL": "mqtts://tr:pw@b", "TSUP_CLUSTER": "c-1", "TSUP_TELEMETRY_KEY": "ab" * 32,
         "TSUP_MQTT_CA_FILE": "/ca.pem"}, rank=0, local_rank=0, world_size=1)
    assert sealed == Broker(BrokerUrl("b", 8883, tls=True, username="tr", password="pw"), cluster="c-1",
                            key=bytes.fromhex("ab" * 32), ca_file="/ca.pem")


@pytest.mark.parametrize("env", [
    {"TSUP_MQTT_URL": "http://h:1"}, {"TSUP_MQTT_URL": "mqtt://h:notaport"},
    {"TSUP_RUN_ID": "has/slash"}, {"TSUP_ATTEMPT": "0"}, {"TSUP_ATTEMPT": "x"},
    {"TSUP_MQTT_URL": "mqtt://h", "TSUP_CLUSTER": "a/b"},
    {"TSUP_MQTT_URL": "mqtt://h", "TSUP_TELEMETRY_KEY": "not hex"},
    {"TSUP_MQTT_URL": "mqtt://h", "TSUP_TELEMETRY_KEY": "abcd"},
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
    yield Broker(BrokerUrl("127.0.0.1", port))
    listener.close()


def test_publishing_never_blocks_when_the_broker_is_unusable(unusable_broker: Broker) -> None:
    telemetry = Telemetry(IDENTITY, unusable_broker, heartbeat_interval_s=0.05, queue_size=8)
    telemetry.start()
    for step in range(1, 2001):
        telemetry.step_completed(step=step, loss=1.0, grad_norm=0.5, lr=1e-3,
                                 step_time_s=0.1, tokens_per_s=100.0)
    assert not telemetry.connected
    # The queue holds 8 (one is the initial PhaseChange); every other call returned at once,
    # counted as dropped, instead of waiting for room. What a call costs, by broker
    # condition: bench/trainer_telemetry_overhead.py.
    assert telemetry.dropped_queue_full >= 2000 - 8
    started = time.monotonic()
    telemetry.close(exit_code=0, final_step=2000, reason="finished", timeout_s=2.0)
    assert time.monotonic() - started < 2.5
    assert telemetry.stats()["sent"] == 0


# ---- node aggregation (TSUP_TELEMETRY_AGGREGATE=node) ----------------------------------


def test_aggregation_setting() -> None:
    assert aggregation_from_env({}, local_rank=0, local_world_size=8) is None
    assert aggregation_from_env({"TSUP_TELEMETRY_AGGREGATE": "rank"}, local_rank=0, local_world_size=8) is None
    agg = aggregation_from_env({"TSUP_TELEMETRY_AGGREGATE": "node", "TSUP_SLOTS_DIR": "/x", "MASTER_PORT": "7"},
                               local_rank=3, local_world_size=8)
    assert agg is not None and agg.slots_dir == Path("/x") and agg.job == "7"
    for env, local_rank, local_world in (({"TSUP_TELEMETRY_AGGREGATE": "nodes"}, 0, 8),
                                         ({"TSUP_TELEMETRY_AGGREGATE": "node"}, 0, 2000),
                                         ({"TSUP_TELEMETRY_AGGREGATE": "node"}, 8, 8)):
        with pytest.raises(UsageError, match="TSUP_TELEMETRY_AGGREGATE"):
            aggregation_from_env(env, local_rank=local_rank, local_world_size=local_world)


def test_slots_round_trip_and_skip_what_was_never_written(tmp_path: Path) -> None:
    assert slot_path(tmp_path, "run-1", 2, "n1", "29500").name == "tsup-run-1-2-n1-29500.slots"
    path = slot_path(tmp_path, "run-1", 2, "gpu/node 7")
    assert path.name == "tsup-run-1-2-gpu_node_7.slots"
    reader = NodeSlots(path, rank=8, local_rank=0, local_world_size=4)
    writer = NodeSlots(path, rank=11, local_rank=3, local_world_size=4)
    assert reader.read_all() == []
    before = time.time()
    writer.update(step=5, phase=Phase.TRAIN, step_time_s=0.5, busy_s=0.25)
    reader.update(step=5, phase=Phase.CHECKPOINT)
    slots = reader.read_all()  # local ranks 1 and 2 never wrote: left out
    assert [(s.rank, s.step, s.phase) for s in slots] == [(8, 5, Phase.CHECKPOINT), (11, 5, Phase.TRAIN)]
    assert slots[1].step_time_s == 0.5 and slots[1].busy_s == 0.25 and slots[1].written_at >= before
    assert math.isnan(slots[0].step_time_s)
    assert unpack(b"\0" * SLOT_BYTES) is None and unpack(b"junk") is None
    writer.close()
    assert path.exists(), "only local rank 0 removes the file"
    writer.touch()  # after close: a no-op, never an error
    reader.close()
    assert not path.exists()


def test_the_local_rank_zero_reports_its_node_and_the_others_publish_less(tmp_path: Path) -> None:
    """Two ranks of one node in one process, with a broker that never answers."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    broker = Broker(BrokerUrl("127.0.0.1", listener.getsockname()[1]))
    agg = Aggregation(slots_dir=tmp_path)
    ids = [Identity(run="run-1", attempt=1, rank=r, local_rank=r - 4, world_size=8, node="n2",
                    local_world_size=2) for r in (4, 5)]
    first, second = (Telemetry(i, broker, heartbeat_interval_s=0.05, aggregation=agg) for i in ids)
    try:
        first.start()
        second.start()
        assert first.aggregated and second.aggregated
        second.set_phase(Phase.TRAIN, 0)
        for step in (1, 2):
            second.step_completed(step=step, loss=1.0, grad_norm=1.0, lr=1e-3, step_time_s=0.2,
                                  tokens_per_s=1.0, busy_s=0.15)
        first.restored(1)
        report = first.node_report()
        assert (report.rank, report.node, report.ranks, report.steps) == (4, "n2", (4, 5), (1, 2))
        assert report.phases == (Phase.INIT, Phase.TRAIN)
        assert math.isnan(report.step_times[0]) and report.step_times[1] == 0.2 and report.busy[1] == 0.15
        assert all(0 <= age < 5 for age in report.ages)
        time.sleep(0.3)  # the sender thread rewrites the slot every heartbeat interval
        assert max(first.node_report().ages) < 0.3
        # A rank other than global rank 0 queues no step metrics and no phase changes.
        assert second.stats()["dropped_queue_full"] == 0 and second._queue.qsize() == 0
        p = tmp_path / "tsup-run-1-1-n2.slots"
        assert p.exists()
    finally:
        second.close(exit_code=0, final_step=2, reason="finished", timeout_s=0.5)
        first.close(exit_code=0, final_step=2, reason="finished", timeout_s=0.5)
        listener.close()
    assert not p.exists(), "local rank 0 removed the slot file"


def test_global_rank_zero_still_sends_step_metrics_when_aggregated(tmp_path: Path) -> None:
    ident = Identity(run="run-1", attempt=1, rank=0, local_rank=0, world_size=2, node="n1",
                     local_world_size=2)
    telemetry = Telemetry(ident, Broker(BrokerUrl("127.0.0.1", 9)), heartbeat_interval_s=10,
                          aggregation=Aggregation(slots_dir=tmp_path))
    telemetry.start()
    try:
        telemetry.set_phase(Phase.TRAIN, 0)
        telemetry.step_completed(step=1, loss=1.0, grad_norm=1.0, lr=1e-3, step_time_s=0.2, tokens_per_s=1.0)
        queued = [telemetry._queue.get_nowait() for _ in range(telemetry._queue.qsize())]
        assert [type(m).__name__ for m in queued] == ["StepMetrics"]
    finally:
        telemetry.close(exit_code=0, final_step=1, reason="finished", timeout_s=0.5)


def test_an_unusable_slot_directory_falls_back_to_per_rank_messages(tmp_path: Path) -> None:
    (tmp_path / "a-file").write_text("")
    agg = Aggregation(slots_dir=tmp_path / "a-file")
    telemetry = Telemetry(IDENTITY, Broker(BrokerUrl("127.0.0.1", 9)), heartbeat_interval_s=10, aggregation=agg)
    telemetry.start()
    try:
        assert not telemetry.aggregated
        queued = [telemetry._queue.get_nowait() for _ in range(telemetry._queue.qsize())]
        assert [type(m).__name__ for m in queued] == ["PhaseChange"]
    finally:
        telemetry.close(exit_code=0, final_step=0, reason="finished", timeout_s=0.5)

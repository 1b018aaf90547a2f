"""The reference trainer end to end: 2 real ranks on gloo, a real broker, real SIGKILLs.

One module-scoped scenario runs the expensive processes once and the tests check its
parts:

1. fault-free: 30 steps, a checkpoint every 10, keep 2;
2. killed: the same config in another directory, hung after step 25 (TSUP_FAULT) and
   SIGKILLed, as a supervisor would after a hang;
3. resumed: attempt 2 of run 2, from the killed run's step-20 checkpoint to step 30.

Ranks are spawned the way a launcher does (torchrun's environment variables, a free
MASTER_PORT). Telemetry goes to an embedded amqtt broker on a free port.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import blake3
import paho.mqtt.client as mqtt
import pytest
from amqtt.broker import Broker
from paho.mqtt.enums import CallbackAPIVersion

import wire as protocol
from supervisor.ports import free_port
from trainer.checkpoint_layout import complete_checkpoints, is_complete

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
WORLD = 2
PROCESS_TIMEOUT_S = 120  # generous: 2 ranks importing torch on 2 busy cores


def wait_for(condition: Callable[[], Any], what: str, timeout_s: float = 60) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")


class EmbeddedBroker:
    """amqtt in its own event-loop thread, anonymous, on a free local port."""

    def __init__(self) -> None:
        self.port = free_port()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()
        self._broker: Broker | None = None

    def start(self) -> None:
        async def start() -> None:
            self._broker = Broker({
                "listeners": {"default": {"type": "tcp", "bind": f"127.0.0.1:{self.port}"}},
                "plugins": {"amqtt.plugins.authentication.AnonymousAuthPlugin":
                            {"allow_anonymous": True}},
            })
            await self._broker.start()

        asyncio.run_coroutine_threadsafe(start(), self._loop).result(timeout=30)

    def stop(self) -> None:
        if self._broker is not None:
            asyncio.run_coroutine_threadsafe(self._broker.shutdown(), self._loop).result(30)
            self._broker = None

    def close(self) -> None:
        self.stop()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)


class Subscriber:
    """Collects every decoded telemetry message the broker delivers."""

    def __init__(self, port: int) -> None:
        self.messages: list[protocol.Message] = []
        self._lock = threading.Lock()
        self._subscribed = threading.Event()
        self._client = mqtt.Client(CallbackAPIVersion.VERSION2, client_id="test-subscriber")
        self._client.on_connect = self._on_connect
        self._client.on_subscribe = lambda *_: self._subscribed.set()
        self._client.on_message = self._on_message
        self._client.connect("127.0.0.1", port)
        self._client.loop_start()
        assert self._subscribed.wait(30), "subscription not acknowledged"

    def _on_connect(self, client: mqtt.Client, *_: Any) -> None:
        client.subscribe(protocol.topic_filter())

    def _on_message(self, _client: mqtt.Client, _userdata: Any, msg: mqtt.MQTTMessage) -> None:
        decoded = protocol.decode(bytes(msg.payload), topic=msg.topic)  # must follow the protocol
        with self._lock:
            self.messages.append(decoded)

    def of(self, run: str, kind: type | None = None, rank: int | None = None) -> list[Any]:
        with self._lock:
            return [m for m in self.messages if m.run == run
                    and (kind is None or isinstance(m, kind))
                    and (rank is None or m.rank == rank)]

    def close(self) -> None:
        self._client.disconnect()
        self._client.loop_stop()


@dataclass
class Attempt:
    procs: list[subprocess.Popen[str]]
    logs: list[Path]
    codes: list[int] = field(default_factory=list)

    def wait(self) -> list[int]:
        """Every rank's exit code; a rank still running after PROCESS_TIMEOUT_S fails the
        test with every rank's log, the ranks killed."""
        deadline = time.monotonic() + PROCESS_TIMEOUT_S
        try:
            self.codes = [p.wait(timeout=max(0.0, deadline - time.monotonic())) for p in self.procs]
        except subprocess.TimeoutExpired:
            for p in self.procs:
                if p.poll() is None:
                    os.kill(p.pid, signal.SIGKILL)
                    p.wait()
            logs = "\n".join(f"--- rank {rank} (exit {p.returncode}) ---\n{self.log(rank)[-4000:]}"
                             for rank, p in enumerate(self.procs))
            pytest.fail(f"ranks still running after {PROCESS_TIMEOUT_S} s:\n{logs}")
        return self.codes

    def log(self, rank: int = 0) -> str:
        return self.logs[rank].read_text()

    def kill(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                os.kill(p.pid, signal.SIGKILL)
        self.wait()


def write_config(directory: Path) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "config.toml"
    path.write_text(
        "steps = 30\nglobal_batch_size = 8\nheartbeat_interval_s = 0.2\n"
        f'output_dir = "{directory / "out"}"\n'
        f'[checkpoint]\ndir = "{directory / "ckpt"}"\nevery_steps = 10\nkeep = 2\n')
    return path


def launch(config: Path, *, world: int, broker_port: int, run: str, attempt: int = 1,
           resume: str = "auto", fault: str = "") -> Attempt:
    port = free_port()
    procs, logs = [], []
    for rank in range(world):
        env = {k: v for k, v in os.environ.items()
               if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT",
                            "OMP_NUM_THREADS") and not k.startswith("TSUP_")}
        env.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                   LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port), PYTHONPATH=str(REPO),
                   TSUP_MQTT_URL=f"mqtt://127.0.0.1:{broker_port}", TSUP_RUN_ID=run,
                   TSUP_ATTEMPT=str(attempt), TSUP_NODE=f"node{rank}")
        if world == 1:  # a lone process: no launcher variables at all
            for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
                         "MASTER_ADDR", "MASTER_PORT"):
                env.pop(name)
        if fault:
            env["TSUP_FAULT"] = fault
        log = config.parent / f"{run}-attempt{attempt}-rank{rank}.log"
        with open(log, "w") as out:
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "trainer", "--config", str(config), "--resume", resume],
                env=env, cwd=config.parent, stdout=out, stderr=subprocess.STDOUT, text=True))
        logs.append(log)
    return Attempt(procs, logs)


def result_of(directory: Path) -> dict[str, Any]:
    result: dict[str, Any] = json.loads((directory / "out" / "result.json").read_text())
    return result


@dataclass
class Scenario:
    fault_free_dir: Path
    killed_dir: Path
    fault_free: Attempt
    killed: Attempt
    resumed: Attempt
    subscriber: Subscriber
    broker_port: int
    after_kill: list[str]  # entries of the killed run's checkpoint dir right after the kill
    result_after_kill: bool  # whether result.json existed then


@pytest.fixture(scope="module")
def scenario(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Scenario]:
    broker = EmbeddedBroker()
    broker.start()
    subscriber = Subscriber(broker.port)
    try:
        # 1. Fault-free, with debris from "earlier crashes" that the first commit removes.
        fault_free_dir = tmp_path_factory.mktemp("fault-free")
        config = write_config(fault_free_dir)
        (fault_free_dir / "ckpt" / ".tmp-step_00000005").mkdir(parents=True)
        (fault_free_dir / "ckpt" / ".tmp-step_00000005" / "__0_0.distcp").write_bytes(b"x")
        fault_free = launch(config, world=WORLD, broker_port=broker.port, run="fault-free")
        fault_free.wait()

        # 2. Killed: hang after step 25 on every rank, then SIGKILL, as for a hang.
        killed_dir = tmp_path_factory.mktemp("killed")
        config = write_config(killed_dir)
        killed = launch(config, world=WORLD, broker_port=broker.port, run="killed",
                        fault="hang@25")
        # Hung = heartbeats keep coming but the step stays at 25.
        wait_for(lambda: {m.rank for m in subscriber.of("killed", protocol.Heartbeat)
                          if m.step == 25} == {0, 1}, "heartbeats at step 25 from both ranks",
                 timeout_s=PROCESS_TIMEOUT_S)
        killed.kill()
        after_kill = sorted(p.name for p in (killed_dir / "ckpt").iterdir())
        result_after_kill = (killed_dir / "out" / "result.json").exists()

        # 3. Resumed: a new attempt of the same run from the step-20 checkpoint.
        resumed = launch(config, world=WORLD, broker_port=broker.port, run="killed",
                         attempt=2, resume=str(killed_dir / "ckpt" / "step_00000020"))
        resumed.wait()
        yield Scenario(fault_free_dir, killed_dir, fault_free, killed, resumed, subscriber,
                       broker.port, after_kill, result_after_kill)
    finally:
        subscriber.close()
        broker.close()


def test_fault_free_run_succeeds(scenario: Scenario) -> None:
    assert scenario.fault_free.codes == [0, 0], scenario.fault_free.log()
    result = result_of(scenario.fault_free_dir)
    assert result["final_step"] == 30
    assert result["steps_run_this_attempt"] == 30
    assert result["resumed_from"] is None
    assert result["world_size"] == WORLD
    assert len(result["model_digest"]) == 64
    assert result["final_loss"] < 5.0  # started near ln(256) = 5.55 and learned
    log = scenario.fault_free.log()
    assert "step 30/30 loss" in log and "grad_norm" in log and "step_time_s" in log


def test_checkpoints_are_complete_and_only_the_newest_two_are_kept(scenario: Scenario) -> None:
    root = scenario.fault_free_dir / "ckpt"
    assert [step for step, _ in complete_checkpoints(root)] == [20, 30]
    assert sorted(p.name for p in root.iterdir()) == ["step_00000020", "step_00000030"]
    step30 = root / "step_00000030"
    assert is_complete(step30)
    assert {p.name for p in step30.iterdir()} >= {".metadata", "trainer_meta.json", "manifest.json",
                                                   "__0_0.distcp", "__1_0.distcp"}
    # The manifest: every other file's size and BLAKE3, hashed as written, as read back here.
    manifest = json.loads((step30 / "manifest.json").read_text())
    assert manifest["format"] == 2
    covered = {p.name for p in step30.iterdir()} - {"manifest.json", "trainer_meta.json"}
    assert set(manifest["files"]) == covered
    for name, entry in manifest["files"].items():
        data = (step30 / name).read_bytes()
        assert entry == {"size": len(data), "blake3": blake3.blake3(data).hexdigest()}, name
    meta = json.loads((step30 / "trainer_meta.json").read_text())
    assert (meta["step"], meta["consumed_samples"], meta["world_size"], meta["model"]) == (
        30, 30 * 8, WORLD, "tiny")


def test_killed_run_left_complete_checkpoints_and_no_result(scenario: Scenario) -> None:
    assert all(code == -signal.SIGKILL for code in scenario.killed.codes)
    assert scenario.after_kill == ["step_00000010", "step_00000020"]
    assert not scenario.result_after_kill
    assert "step 25/30" in scenario.killed.log()
    assert "step 26/30" not in scenario.killed.log()


def test_resume_is_bit_exact(scenario: Scenario) -> None:
    assert scenario.resumed.codes == [0, 0], scenario.resumed.log()
    fault_free, resumed = result_of(scenario.fault_free_dir), result_of(scenario.killed_dir)
    assert resumed["model_digest"] == fault_free["model_digest"]
    assert resumed["final_loss"] == fault_free["final_loss"]
    assert resumed["final_step"] == 30
    assert resumed["steps_run_this_attempt"] == 10
    assert resumed["resumed_from"] == str(scenario.killed_dir / "ckpt" / "step_00000020")
    assert resumed["attempt"] == 2
    # The resumed attempt re-committed 30 and pruned down to two checkpoints.
    assert [s for s, _ in complete_checkpoints(scenario.killed_dir / "ckpt")] == [20, 30]


def test_telemetry_of_a_successful_run(scenario: Scenario) -> None:
    sub, run = scenario.subscriber, "fault-free"
    registers = sub.of(run, protocol.Register)
    assert {(m.rank, m.node, m.world_size) for m in registers} == {
        (0, "node0", WORLD), (1, "node1", WORLD)}
    for rank in range(WORLD):
        steps = [m for m in sub.of(run, protocol.StepMetrics, rank)]
        assert [m.step for m in steps] == list(range(1, 31))
        phases = [m.phase for m in sub.of(run, protocol.PhaseChange, rank)]
        assert phases[0] == protocol.Phase.INIT and phases[-1] == protocol.Phase.DONE
        assert phases.count(protocol.Phase.CHECKPOINT) == 3
        assert sub.of(run, protocol.Heartbeat, rank), "no heartbeat"
    # Every rank reports the same global loss.
    by_step: dict[int, set[float]] = {}
    for m in sub.of(run, protocol.StepMetrics):
        by_step.setdefault(m.step, set()).add(m.loss)
    assert all(len(losses) == 1 for losses in by_step.values())
    commits = sub.of(run, protocol.CheckpointCommitted)
    assert [(m.rank, m.step) for m in commits] == [(0, 10), (0, 20), (0, 30)]
    assert commits[-1].path == str(scenario.fault_free_dir / "ckpt" / "step_00000030")
    exits = wait_for(lambda: sub.of(run, protocol.Exit) if len(sub.of(run, protocol.Exit))
                     == WORLD else None, "both Exit messages", timeout_s=10)
    assert {(m.rank, m.exit_code, m.final_step) for m in exits} == {(0, 0, 30), (1, 0, 30)}
    assert sub.of(run, protocol.Lost) == []  # a clean disconnect discards the will


def test_sigkill_publishes_the_last_will(scenario: Scenario) -> None:
    sub = scenario.subscriber
    lost = wait_for(lambda: sub.of("killed", protocol.Lost)
                    if len(sub.of("killed", protocol.Lost)) == WORLD else None,
                    "a Lost message from each killed rank", timeout_s=30)
    assert {(m.rank, m.attempt) for m in lost} == {(0, 1), (1, 1)}
    assert not [m for m in sub.of("killed", protocol.Exit) if m.attempt == 1]
    # While hung, heartbeats went on reporting step 25.
    assert any(m.step == 25 and m.phase == protocol.Phase.TRAIN
               for m in sub.of("killed", protocol.Heartbeat) if m.attempt == 1)
    # The resumed attempt registered again and exited cleanly.
    assert {m.rank for m in sub.of("killed", protocol.Register) if m.attempt == 2} == {0, 1}
    phases = [m.phase for m in sub.of("killed", protocol.PhaseChange, 0) if m.attempt == 2]
    assert protocol.Phase.RESTORE in phases


def test_resume_on_another_world_size_reshards_and_keeps_the_trajectory(scenario: Scenario,
                                                                          tmp_path: Path) -> None:
    """The 2-rank step-20 checkpoint resumed by 1 rank (the global batch of 8 now one
    rank's): DCP reshards on load, the data order is the same, and the run ends where the
    2-rank run did, up to float rounding of sums taken in another order."""
    config = write_config(tmp_path / "one-rank")
    attempt = launch(config, world=1, broker_port=scenario.broker_port, run="resharded",
                     resume=str(scenario.killed_dir / "ckpt" / "step_00000020"))
    assert attempt.wait() == [0], attempt.log()
    assert "resharding step_00000020 from 2 to 1 ranks" in attempt.log()
    resharded, fault_free = result_of(tmp_path / "one-rank"), result_of(scenario.fault_free_dir)
    assert (resharded["final_step"], resharded["world_size"], resharded["consumed_samples"]) == (30, 1, 240)
    assert resharded["final_loss"] == pytest.approx(fault_free["final_loss"], rel=1e-4)


def test_resume_from_a_truncated_shard_exits_3_checkpoint_unreadable(scenario: Scenario, tmp_path: Path) -> None:
    """A checkpoint complete by its marker whose shard was cut short (a disk that lied, a
    half-copied directory): the trainer says so with exit code 3, so that the supervisor
    resumes from an older checkpoint instead of retrying this one."""
    import shutil
    broken = tmp_path / "step_00000020"
    shutil.copytree(scenario.killed_dir / "ckpt" / "step_00000020", broken)
    assert is_complete(broken)
    for shard in broken.glob("*.distcp"):
        shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    attempt = launch(scenario.killed_dir / "config.toml", world=WORLD, broker_port=scenario.broker_port,
                     run="truncated", resume=str(broken))
    codes = attempt.wait()
    assert codes == [3, 3], attempt.log()
    assert "CheckpointUnreadable" in attempt.log() and str(broken) in attempt.log()
    exits = wait_for(lambda: scenario.subscriber.of("truncated", protocol.Exit), "the Exit message", timeout_s=10)
    assert {e.exit_code for e in exits} == {3}


def test_a_shard_changed_in_place_is_caught_by_the_manifest_before_the_load(scenario: Scenario,
                                                                            tmp_path: Path) -> None:
    """Bytes flipped inside a shard, its size unchanged (silent corruption on storage):
    DCP itself loads it without a word; the manifest's hashes make it exit code 3."""
    import shutil
    broken = tmp_path / "step_00000020"
    shutil.copytree(scenario.killed_dir / "ckpt" / "step_00000020", broken)
    shard = max(broken.glob("*.distcp"), key=lambda p: p.stat().st_size)
    data = bytearray(shard.read_bytes())
    middle = len(data) // 2
    data[middle:middle + 16] = bytes(b ^ 0xFF for b in data[middle:middle + 16])
    shard.write_bytes(bytes(data))
    attempt = launch(scenario.killed_dir / "config.toml", world=WORLD, broker_port=scenario.broker_port,
                     run="flipped", resume=str(broken))
    assert attempt.wait() == [3, 3], attempt.log()
    assert f"not what was written: {shard.name}'s BLAKE3 is" in attempt.log()

    (broken / "manifest.json").unlink()  # as a checkpoint written before manifests
    attempt = launch(scenario.killed_dir / "config.toml", world=WORLD, broker_port=scenario.broker_port,
                     run="flipped-unchecked", resume=str(broken))
    assert attempt.wait() == [0, 0], "without the manifest, nothing notices"


class CuttableProxy:
    """A TCP forwarder to the broker whose connections the test can cut, like a network
    fault: the broker sees the connection die (and publishes the will) while the test's
    own subscriber, connected directly, misses nothing."""

    def __init__(self, target_port: int) -> None:
        self._target_port = target_port
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = int(self._listener.getsockname()[1])
        self._lock = threading.Lock()
        self._open: list[socket.socket] = []
        self.refusing = False
        threading.Thread(target=self._accept_loop, daemon=True).start()

    def _accept_loop(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return  # closed
            if self.refusing:
                client.close()
                continue
            upstream = socket.create_connection(("127.0.0.1", self._target_port))
            with self._lock:
                self._open += [client, upstream]
            for src, dst in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(src, dst), daemon=True).start()

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        for sock in (src, dst):
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    def cut(self, *, refuse: bool) -> None:
        """Drop every forwarded connection; with refuse, also turn new ones away."""
        self.refusing = refuse
        with self._lock:
            doomed, self._open = self._open, []
        for sock in doomed:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()

    def close(self) -> None:
        self._listener.close()
        self.cut(refuse=True)


def test_publisher_survives_a_network_cut() -> None:
    """The will fires when the connection dies; the publisher reconnects, registers again,
    and delivers what was published during the outage; close() ends without a will."""
    from trainer.telemetry import Telemetry
    from trainer.telemetry_env import Broker as BrokerAddress
    from trainer.telemetry_env import Identity

    broker = EmbeddedBroker()
    broker.start()
    subscriber = Subscriber(broker.port)
    proxy = CuttableProxy(broker.port)
    identity = Identity(run="cut", attempt=1, rank=0, local_rank=0, world_size=1, node="n0")
    telemetry = Telemetry(identity, BrokerAddress(protocol.BrokerUrl("127.0.0.1", proxy.port)),
                          heartbeat_interval_s=0.1)
    try:
        telemetry.start()
        wait_for(lambda: subscriber.of("cut", protocol.Register), "the first Register")
        proxy.cut(refuse=True)
        wait_for(lambda: subscriber.of("cut", protocol.Lost), "the will after the cut")
        wait_for(lambda: not telemetry.connected, "the publisher to notice the outage")
        telemetry.step_completed(step=5, loss=2.0, grad_norm=0.5, lr=1e-3, step_time_s=0.1,
                                 tokens_per_s=10.0)
        proxy.refusing = False  # the network is back; paho retries with backoff
        wait_for(lambda: len(subscriber.of("cut", protocol.Register)) == 2,
                 "a second Register after the reconnect", timeout_s=30)
        wait_for(lambda: [m for m in subscriber.of("cut", protocol.StepMetrics) if m.step == 5],
                 "the StepMetrics published during the outage")
        telemetry.close(exit_code=0, final_step=5, reason="finished")
        exits = wait_for(lambda: subscriber.of("cut", protocol.Exit), "the Exit message")
        assert exits[0].exit_code == 0
        # Only the cut connection's will; the clean disconnect discarded the second one.
        assert len(subscriber.of("cut", protocol.Lost)) == 1
    finally:
        proxy.close()
        subscriber.close()
        broker.close()

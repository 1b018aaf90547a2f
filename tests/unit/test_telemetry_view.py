"""TelemetryView: what the reconciler learns from the ranks' messages."""

from __future__ import annotations

from supervisor.chaos import ChaosAction, parse_chaos
from supervisor.errors import SpecError
from supervisor.telemetry import TelemetryView
from trainer import protocol as p

H = {"run": "run-1", "attempt": 1, "ts": 0.0}


def feed(view: TelemetryView, msg: p.Message, now: float) -> None:
    topic, payload = p.encode(msg)
    view.ingest(topic, payload, now)


def test_progress_exit_and_last_will_per_rank() -> None:
    v = TelemetryView()
    feed(v, p.Register(**H, rank=1, local_rank=1, world_size=2, node="n1", pid=9, hostname="h"), 1.0)
    feed(v, p.Heartbeat(**H, rank=1, step=3, phase=p.Phase.TRAIN), 2.0)
    feed(v, p.Heartbeat(**H, rank=1, step=3, phase=p.Phase.TRAIN), 5.0)
    r = v.ranks("run-1", 1)[1]
    assert (r.node, r.pid, r.last_step, r.phase, r.progress_at, r.last_seen_at) == ("n1", 9, 3, "train", 2.0, 5.0)
    feed(v, p.Lost(**H, rank=1), 6.0)
    assert r.lost and r.lost_at == 6.0 and r.last_seen_at == 5.0
    feed(v, p.Exit(**H, rank=0, exit_code=1, final_step=3, reason="boom"), 7.0)
    r0 = v.ranks("run-1", 1)[0]
    assert (r0.exit_code, r0.exit_reason, r0.exit_at) == (1, "boom", 7.0)
    assert v.max_step("run-1", 1) == 3
    v.forget("run-1", 1)
    assert v.ranks("run-1", 1) == {}


def test_only_rank_zero_metrics_and_checkpoints_are_queued_for_the_store() -> None:
    v = TelemetryView()
    for rank in (0, 1):
        feed(v, p.StepMetrics(**H, rank=rank, step=1, loss=2.0, grad_norm=1.0, lr=0.1, step_time_s=0.1,
                              tokens_per_s=1.0), 1.0)
    feed(v, p.CheckpointCommitted(**H, rank=0, step=20, path="/c", duration_s=0.1), 2.0)
    items = v.peek_durable()
    assert [(type(i.msg).__name__, i.msg.rank, i.at) for i in items] == [
        ("StepMetrics", 0, 1.0), ("CheckpointCommitted", 0, 2.0)]
    assert v.peek_durable() == items, "kept until the reconciler says they are stored"
    v.drop_durable(1)
    assert [type(i.msg).__name__ for i in v.peek_durable()] == ["CheckpointCommitted"]


def test_a_message_after_the_last_will_means_the_rank_is_back() -> None:
    v = TelemetryView()
    feed(v, p.Lost(**H, rank=0), 1.0)
    assert v.ranks("run-1", 1)[0].lost
    feed(v, p.Heartbeat(**H, rank=0, step=1, phase=p.Phase.TRAIN), 2.0)
    assert not v.ranks("run-1", 1)[0].lost


def test_malformed_messages_are_counted_and_ignored() -> None:
    v = TelemetryView()
    v.ingest("tsup/v1/telemetry/run-1/1/0/step", b"{oops", 1.0)
    v.ingest("tsup/v1/telemetry/run-1/1/0/step", b'{"v": 1, "kind": "step"}', 1.0)
    assert v.counts["malformed"] == 2 and v.counts["received"] == 0
    assert v.ranks("run-1", 1) == {}


def test_chaos_syntax() -> None:
    assert parse_chaos("kill-rank@50") == ChaosAction(kind="kill-rank", step=50)
    assert parse_chaos("kill-node@90:1") == ChaosAction(kind="kill-node", step=90, target=1)
    assert parse_chaos("corrupt-ckpt@50") == ChaosAction(kind="corrupt-ckpt", step=50)
    assert parse_chaos("kill-in-save@40:3") == ChaosAction(kind="kill-in-save", step=40, target=3)
    for bad in ("kill-rank", "kill-rank@x", "explode@5", "kill-node@0"):
        try:
            parse_chaos(bad)
        except SpecError as e:
            assert "--chaos" in str(e)
        else:
            raise AssertionError(f"{bad!r} was accepted")

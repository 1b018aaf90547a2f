"""The telemetry wire protocol (trainer/protocol.py)."""

from __future__ import annotations

import json
import math

import pytest

from trainer import protocol as p

H = {"run": "run-4", "attempt": 2, "rank": 3, "ts": 1700000000.5}

SAMPLES: list[p.Message] = [
    p.Register(**H, local_rank=1, world_size=4, node="local-2", pid=1234, hostname="box"),
    p.Heartbeat(**H, step=17, phase=p.Phase.TRAIN),
    p.StepMetrics(**H, step=17, loss=2.5, grad_norm=0.75, lr=3e-4, step_time_s=0.1, tokens_per_s=8000.0),
    p.PhaseChange(**H, phase=p.Phase.CHECKPOINT, step=20),
    p.CheckpointCommitted(**H, step=20, path="/ck/step_00000020", duration_s=0.12),
    p.Exit(**H, exit_code=1, final_step=17, reason="RuntimeError: boom"),
    # a detail as long as the trainer sends (500): one longer than an id's 64 must pass
    p.FaultInjected(**H, action="device@50:3", step=50, detail="injected: CUDA error: " + "x" * 478),
    p.NodeReport(**H, node="local-2", ranks=(2, 3), steps=(17, 16), phases=(p.Phase.TRAIN, p.Phase.CHECKPOINT),
                 ages=(0.25, 0.0), step_times=(0.1, math.nan), busy=(0.08, math.nan)),
    p.Lost(**H),
]


def test_every_kind_has_a_sample() -> None:
    assert {m.kind for m in SAMPLES} == p.KINDS


@pytest.mark.parametrize("msg", SAMPLES, ids=lambda m: m.kind)
def test_every_kind_round_trips_on_its_own_topic(msg: p.Message) -> None:
    topic, payload = p.encode(msg)
    assert topic == f"tsup/v1/telemetry/run-4/2/3/{msg.kind}"
    assert _same(p.decode(payload, topic), msg)
    body = json.loads(payload)
    assert body["v"] == p.VERSION and body["kind"] == msg.kind


def _same(a: p.Message, b: p.Message) -> bool:
    """Equal, with NaN equal to NaN (inside a NodeReport's lists too)."""
    return json.loads(p.encode(a)[1]) == json.loads(p.encode(b)[1]) and type(a) is type(b)


def test_non_finite_floats_travel_as_strings_and_come_back() -> None:
    msg = p.StepMetrics(**H, step=1, loss=math.nan, grad_norm=math.inf, lr=0.1, step_time_s=0.1,
                        tokens_per_s=-math.inf)
    topic, payload = p.encode(msg)
    body = json.loads(payload)  # strict JSON: no NaN literal
    assert (body["loss"], body["grad_norm"], body["tokens_per_s"]) == ("nan", "inf", "-inf")
    back = p.decode(payload, topic)
    assert isinstance(back, p.StepMetrics)
    assert math.isnan(back.loss) and back.grad_norm == math.inf and back.tokens_per_s == -math.inf


def _payload(**changes: object) -> bytes:
    body = json.loads(p.encode(SAMPLES[1])[1])
    body.update(changes)
    for k, v in list(body.items()):
        if v is None:
            del body[k]
    return json.dumps(body).encode()


@pytest.mark.parametrize(
    ("payload", "complaint"),
    [
        (b"not json", "not JSON"),
        (b"\xff\xfe", "not JSON"),
        (b"[1, 2]", "not a JSON object"),
        (_payload(v=99), "unsupported protocol version 99"),
        (_payload(v=None), "unsupported protocol version None"),
        (_payload(kind="gossip"), "unknown message kind 'gossip'"),
        (_payload(step=None), "missing field 'step'"),
        (_payload(step="7"), "heartbeat.step: expected an integer"),
        (_payload(step=True), "heartbeat.step: expected an integer"),
        (_payload(step=-1), "must not be negative"),
        (_payload(phase="nap"), "unknown phase 'nap'"),
        (_payload(extra=1), "unknown field(s) ['extra']"),
        (_payload(run="run/4/#"), "not a valid run id"),
        (_payload(run="x" * 65), "longer than 64"),
        (_payload(step=2**63), "heartbeat.step: out of range"),
        (b"[" * 100_000, "not JSON"),
    ],
)
def test_malformed_messages_are_rejected_with_a_reason(payload: bytes, complaint: str) -> None:
    with pytest.raises(p.ProtocolError, match=None) as e:
        p.decode(payload)
    assert complaint in str(e.value)


def test_a_message_on_another_ranks_topic_is_rejected() -> None:
    topic, payload = p.encode(SAMPLES[1])
    with pytest.raises(p.ProtocolError, match="does not match"):
        p.decode(payload, topic.replace("/3/", "/0/"))


def _node_payload(**changes: object) -> bytes:
    body = json.loads(p.encode(next(m for m in SAMPLES if isinstance(m, p.NodeReport)))[1])
    body.update(changes)
    return json.dumps(body).encode()


def test_a_node_report_carries_nan_as_a_string_and_tuples_back() -> None:
    msg = next(m for m in SAMPLES if isinstance(m, p.NodeReport))
    topic, payload = p.encode(msg)
    body = json.loads(payload)
    assert body["step_times"] == [0.1, "nan"] and body["phases"] == ["train", "checkpoint"]
    back = p.decode(payload, topic)
    assert isinstance(back, p.NodeReport)
    assert back.ranks == (2, 3) and back.phases == (p.Phase.TRAIN, p.Phase.CHECKPOINT)
    assert math.isnan(back.busy[1]) and back.ages == (0.25, 0.0)


@pytest.mark.parametrize(
    ("payload", "complaint"),
    [
        (_node_payload(ranks=5), "node.ranks: expected a list"),
        (_node_payload(ranks=[2, -3]), "node.ranks: must not be negative"),
        (_node_payload(ranks=[2, 3.5]), "node.ranks: expected an integer"),
        (_node_payload(steps=[1]), "node.steps: 1 entries for 2 ranks"),
        (_node_payload(phases=["train", "nap"]), "unknown phase 'nap'"),
        (_node_payload(ages=[0.1, "nan"]), "node.ages: expected finite numbers >= 0"),
        (_node_payload(ages=[0.1, -1.0]), "node.ages: expected finite numbers >= 0"),
        (_node_payload(busy=[0.1, "slow"]), "node.busy: expected a number"),
        (_node_payload(ranks=[3, 3]), "a rank is listed twice"),
        (_node_payload(node="x" * 65), "node.node: longer than 64"),
        (_node_payload(**{k: list(range(p.MAX_NODE_RANKS + 1)) for k in ("ranks", "steps")}),
         "longer than 1024 entries"),
        (_node_payload(node=None), "node: expected a string"),
    ],
)
def test_malformed_node_reports_are_rejected(payload: bytes, complaint: str) -> None:
    with pytest.raises(p.ProtocolError) as e:
        p.decode(payload)
    assert complaint in str(e.value)


def test_a_full_node_report_is_accepted() -> None:
    n = p.MAX_NODE_RANKS
    msg = p.NodeReport(**H, node="big", ranks=tuple(range(n)), steps=(5,) * n, phases=(p.Phase.TRAIN,) * n,
                       ages=(0.5,) * n, step_times=(1.0,) * n, busy=(0.9,) * n)
    assert p.decode(p.encode(msg)[1]) == msg

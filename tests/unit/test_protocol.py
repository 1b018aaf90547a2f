"""The telemetry wire protocol (wire/)."""

from __future__ import annotations

import json
import math

import pytest

import wire as p

H = {"run": "run-4", "attempt": 2, "rank": 3, "ts": 1700000000.5}

SAMPLES: list[p.Message] = [
    p.Register(**H, local_rank=1, world_size=4, node="local-2", pid=1234, hostname="box"),
    p.Heartbeat(**H, step=17, phase=p.Phase.TRAIN),
    p.StepMetrics(**H, step=17, loss=2.5, grad_norm=0.75, lr=3e-4, step_time_s=0.1, tokens_per_s=8000.0),
    p.PhaseChange(**H, phase=p.Phase.CHECKPOINT, step=20, bytes=18_000_000_000),
    p.CheckpointCommitted(**H, step=20, path="/ck/step_00000020", duration_s=0.12, total_s=4.5,
                          bytes=18_000_000_000),
    p.CheckpointRestored(**H, step=20, path="memory:1:20", tier="memory", duration_s=2.5, bytes=18_000_000_000),
    p.Exit(**H, exit_code=1, final_step=17, reason="RuntimeError: boom"),
    # a detail as long as the trainer sends (500): one longer than an id's 64 must pass
    p.FaultInjected(**H, action="device@50:3", step=50, detail="injected: CUDA error: " + "x" * 478),
    p.NodeReport(**H, node="local-2", ranks=(2, 3), steps=(17, 16), phases=(p.Phase.TRAIN, p.Phase.CHECKPOINT),
                 ages=(0.25, 0.0), step_times=(0.1, math.nan), busy=(0.08, math.nan)),
    p.Lost(**H),
]
# A node agent's (node/agent.py): the node's index stands where a rank's number does.
AH = {"run": "run-4", "attempt": 2, "index": 3, "ts": 1700000000.5}
AGENT_SAMPLES: list[p.Message] = [
    p.AgentReport(**AH, node="node4", pid=77, hostname="node4", ranks=(6, 7), steps=(17, 17),
                  phases=(p.Phase.TRAIN, p.Phase.TRAIN), ages=(0.1, 0.2), step_times=(0.1, 0.1),
                  busy=(math.nan, 0.05)),
    p.AgentReport(**AH, node="node4", pid=77, hostname="node4"),  # a trainer without slots: no lists
    p.AgentLost(**AH),
]


def test_every_kind_has_a_sample() -> None:
    assert {m.kind for m in [*SAMPLES, *AGENT_SAMPLES]} == p.KINDS
    assert {m.kind for m in AGENT_SAMPLES} == p.AGENT_KINDS


@pytest.mark.parametrize("msg", SAMPLES + AGENT_SAMPLES, ids=lambda m: m.kind)
def test_every_kind_round_trips_on_its_own_topic(msg: p.Message) -> None:
    topic, payload = p.encode(msg)
    sender = "n3" if msg.kind in p.AGENT_KINDS else "3"
    assert topic == f"tsup/v1/default/telemetry/run-4/2/{sender}/{msg.kind}"
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
        # What the one-pass check of a list (_fast_list) must leave to the entry-by-entry one:
        (_node_payload(ranks=[2, True]), "node.ranks: expected an integer"),
        (_node_payload(steps=[1, "7"]), "node.steps: expected an integer"),
        (_node_payload(steps=[1, 2**63]), "node.steps: out of range"),
        (_node_payload(step_times=[0.1, False]), "node.step_times: expected a number"),
        (_node_payload(step_times=[0.1, None]), "node.step_times: expected a number"),
        (_node_payload(phases=["train", 3]), "unknown phase 3"),
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


# --- seals -------------------------------------------------------------------------

KEY = p.attempt_key(b"supervisor-secret", "c1", "run-4", 2)


def test_a_sealed_message_carries_its_connection_sequence_and_a_mac_over_topic_and_payload() -> None:
    topic, payload = p.encode(SAMPLES[2], cluster="c1", seal=p.Seal(key=KEY, conn="0123456789abcdef", seq=7))
    sealed = p.decode_sealed(payload, topic, cluster="c1")
    assert _same(sealed.msg, SAMPLES[2]) and (sealed.conn, sealed.seq) == ("0123456789abcdef", 7)
    assert sealed.mac == p.mac_of(KEY, topic, sealed.signed)
    assert payload.endswith(b'"mac":"' + sealed.mac.encode() + b'"}')
    # Any change to a signed byte, or the same bytes on another rank's topic, breaks the mac.
    tampered = p.decode_sealed(payload.replace(b'"loss":2.5', b'"loss":"nan"'), topic, cluster="c1")
    assert tampered.mac != p.mac_of(KEY, topic, tampered.signed)
    assert p.mac_of(KEY, topic.replace("/3/", "/0/"), sealed.signed) != sealed.mac


def test_keys_differ_per_attempt_run_cluster_and_secret() -> None:
    keys = {p.attempt_key(b"s", "c1", "run-4", 2), p.attempt_key(b"s", "c1", "run-4", 3),
            p.attempt_key(b"s", "c1", "run-5", 2), p.attempt_key(b"s", "c2", "run-4", 2),
            p.attempt_key(b"t", "c1", "run-4", 2)}
    assert len(keys) == 5 and all(len(k) == 32 for k in keys)


@pytest.mark.parametrize("change", [
    lambda b: b.replace(b'"mac":"', b'"mac":"x'),  # not 64 hex digits
    lambda b: b[:-2] + b'",' + b'"x":1}',  # mac not the last field
    lambda b: b.replace(b'"conn":"0123456789abcdef"', b'"conn":"short"'),
    lambda b: b.replace(b'"seq":7', b'"seq":-1'),
    lambda b: b.replace(b'"seq":7', b'"seq":true'),
])
def test_malformed_seals_are_protocol_errors(change: object) -> None:
    _, payload = p.encode(SAMPLES[1], seal=p.Seal(key=KEY, conn="0123456789abcdef", seq=7))
    with pytest.raises(p.ProtocolError):
        p.decode_sealed(change(payload))  # type: ignore[operator]


def test_topics_carry_the_cluster_and_a_topic_of_another_cluster_is_refused() -> None:
    topic, payload = p.encode(SAMPLES[1], cluster="west")
    assert topic.startswith("tsup/v1/west/telemetry/") and p.topic_filter("west") == "tsup/v1/west/telemetry/#"
    with pytest.raises(p.ProtocolError, match="does not match"):
        p.decode(payload, topic, cluster="east")


@pytest.mark.parametrize(("url", "parts"), [
    ("mqtt://h", ("h", 1883, False, None, None)),
    ("mqtts://h", ("h", 8883, True, None, None)),
    ("mqtts://u:p%40ss@h:9", ("h", 9, True, "u", "p%40ss")),
])
def test_broker_urls(url: str, parts: tuple[object, ...]) -> None:
    b = p.parse_broker_url(url)
    assert (b.host, b.port, b.tls, b.username, b.password) == parts
    assert "ss" not in str(b).split("@")[0].split(":")[-1] or b.password is None  # the password is not shown


@pytest.mark.parametrize("url", ["http://h", "mqtt://", "mqtt://h:x", "mqtt://h/path", "mqtt://h?q=1"])
def test_bad_broker_urls_name_the_problem(url: str) -> None:
    with pytest.raises(ValueError, match="mqtt"):
        p.parse_broker_url(url)


def _checkpoint_payload(**changes: object) -> bytes:
    msg = next(m for m in SAMPLES if isinstance(m, p.CheckpointCommitted))
    body = json.loads(p.encode(msg)[1])
    body.update(changes)
    return json.dumps({k: v for k, v in body.items() if v is not None}).encode()


def test_a_checkpoint_names_its_tier_and_an_older_sender_means_persistent() -> None:
    assert p.decode(_checkpoint_payload(tier="memory")).tier == p.TIER_MEMORY  # type: ignore[attr-defined]
    assert p.decode(_checkpoint_payload(tier=None)).tier == p.TIER_PERSISTENT  # type: ignore[attr-defined]
    with pytest.raises(p.ProtocolError, match=r"checkpoint\.tier: expected 'persistent' or 'memory', got 'disk'"):
        p.decode(_checkpoint_payload(tier="disk"))


def test_a_restore_names_a_known_tier() -> None:
    body = json.loads(p.encode(p.CheckpointRestored(**H, step=20, path="/c", tier="memory", duration_s=1.0,
                                                     bytes=1))[1])
    body["tier"] = "tape"
    with pytest.raises(p.ProtocolError, match=r"restored\.tier: expected .persistent. or .memory."):
        p.decode(json.dumps(body))


def test_an_older_senders_phase_and_commit_decode_with_nothing_said_of_sizes() -> None:
    for kind, extra in (("phase", {"phase": "checkpoint", "step": 3}),
                        ("checkpoint", {"step": 3, "path": "/c", "duration_s": 0.5})):
        msg = p.decode(json.dumps({"v": 1, "kind": kind, **H, **extra}))
        assert getattr(msg, "bytes") == 0
    commit = p.decode(json.dumps({"v": 1, "kind": "checkpoint", **H, "step": 3, "path": "/c", "duration_s": 0.5}))
    assert isinstance(commit, p.CheckpointCommitted) and math.isnan(commit.total_s)


def test_an_agent_message_on_a_ranks_topic_and_a_ranks_on_an_agents_are_refused() -> None:
    _, agent_payload = p.encode(AGENT_SAMPLES[0])
    with pytest.raises(p.ProtocolError, match="does not match"):
        p.decode(agent_payload, "tsup/v1/default/telemetry/run-4/2/3/agent")
    _, rank_payload = p.encode(SAMPLES[1])
    with pytest.raises(p.ProtocolError, match="does not match"):
        p.decode(rank_payload, "tsup/v1/default/telemetry/run-4/2/n3/heartbeat")


def test_an_agent_report_with_uneven_lists_is_refused() -> None:
    body = json.loads(p.encode(AGENT_SAMPLES[0])[1])
    body["steps"] = [17]
    with pytest.raises(p.ProtocolError, match=r"agent\.steps: 1 entries for 2 ranks"):
        p.decode(json.dumps(body).encode())


@pytest.mark.parametrize(("value", "attempt"), [
    ("tsup-run-4-2-3-999", ("run-4", 2)),
    ("tsup-run-4-2-n3-999", ("run-4", 2)),  # a node agent's
    ("tsup-run-4-2-x3-999", None),
    ("tsup-run-4-2-n-999", None),
])
def test_client_ids_of_ranks_and_agents_name_their_attempt(value: str, attempt: object) -> None:
    assert p.attempt_of_client_id(value) == attempt

"""A process without the attempt's key that tries to make the supervisor act.

    python -m tests.fake_tools.forger HOST PORT RUN_ID ATTEMPT RANKS NODE...

It knows only the public protocol (wire/) and the broker's address, and
where the broker takes logins only (the embedded one), what a ranks' neighbour on the
network could learn: the attempt's broker login (``FORGER_LOGIN=USER:PASSWORD``; an
mqtt:// broker's passwords cross the network in the clear, the attempt's key never
does), and a dashboard's (``FORGER_READER``, the API's read-only token). It
learns the supervisor's cluster id from the topics it sees, captures one genuine step
message of the attempt, then publishes one forgery of every kind the protocol has, on
the real ranks' topics: exits with codes 2, 3 and 4, last wills of every rank (unsealed,
and with the connection id the genuine message carried), a NaN step, a node report
that says every rank is stale, a chaos fault report, a committed checkpoint; then
the same with a MAC made with a guessed key; then it replays the genuine message it
captured. It prints one JSON line: how many messages it published, by what.
"""

from __future__ import annotations

import json
import math
import os
import secrets
import sys
import threading
import time
from typing import Any

import paho.mqtt.client as mqtt
from paho.mqtt.enums import CallbackAPIVersion

import wire as p


def forgeries(run: str, attempt: int, ranks: int, nodes: list[str]) -> list[p.Message]:
    h: dict[str, Any] = {"run": run, "attempt": attempt, "ts": time.time()}
    last = ranks - 1
    out: list[p.Message] = [
        p.Exit(**h, rank=last, exit_code=2, final_step=1, reason="forged: bad configuration"),
        p.Exit(**h, rank=last, exit_code=3, final_step=1, reason="forged: checkpoint unreadable"),
        p.Exit(**h, rank=0, exit_code=4, final_step=1, reason="forged: device fault"),
        p.StepMetrics(**h, rank=0, step=10_000, loss=math.nan, grad_norm=math.inf, lr=0.1, step_time_s=0.1,
                      tokens_per_s=1.0),
        p.FaultInjected(**h, rank=0, action="nan@1", step=1, detail="forged fault report"),
        p.CheckpointCommitted(**h, rank=0, step=10_000, path="/tmp/forged-checkpoint", duration_s=0.1),
    ]
    per_node = max(1, ranks // max(1, len(nodes)))
    for i, node in enumerate(nodes):
        members = tuple(range(i * per_node, min(ranks, (i + 1) * per_node)))
        out.append(p.NodeReport(**h, rank=members[0], node=node, ranks=members, steps=(0,) * len(members),
                                phases=(p.Phase.TRAIN,) * len(members), ages=(3600.0,) * len(members),
                                step_times=(math.nan,) * len(members), busy=(math.nan,) * len(members)))
    out += [p.Lost(**h, rank=r) for r in range(ranks)]
    return out


def main(argv: list[str]) -> int:
    host, port, run, attempt, ranks = argv[0], int(argv[1]), argv[2], int(argv[3]), int(argv[4])
    nodes = argv[5:]
    seen: dict[str, Any] = {}
    got = threading.Event()

    def on_message(_c: mqtt.Client, _u: Any, m: mqtt.MQTTMessage) -> None:
        parts = m.topic.split("/")  # tsup/v1/<cluster>/telemetry/<run>/<attempt>/<rank>/<kind>
        if len(parts) == 8 and parts[3] == "telemetry" and parts[4:6] == [run, str(attempt)] and \
                parts[7] == "step" and "genuine" not in seen:
            seen.update(cluster=parts[2], genuine=(m.topic, bytes(m.payload)))
            got.set()

    reader = client = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=f"forger-{secrets.token_hex(4)}")
    login, reader_password = os.environ.get("FORGER_LOGIN"), os.environ.get("FORGER_READER")
    if login:  # the attempt's login publishes; the dashboard's reads
        username, _, password = login.partition(":")
        client = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=p.client_id(run, attempt, 0, os.getpid()))
        client.username_pw_set(username, password)
        client.connect(host, port)
        client.loop_start()
    if reader_password:
        reader.username_pw_set("reader", reader_password)
    reader.on_message = on_message
    # A dashboard may read its own cluster's topics only: the login's username names it.
    wanted = f"tsup/v1/{login.partition('/')[0]}/telemetry/#" if login and reader_password else "tsup/v1/#"
    reader.on_connect = lambda c, _u, _f, _r, _p: c.subscribe(wanted)
    reader.connect(host, port)
    reader.loop_start()
    if not got.wait(60):
        print(json.dumps({"error": "no genuine step message seen in 60 s"}))
        return 1
    cluster: str = seen["cluster"]
    genuine_topic, genuine = seen["genuine"]
    conn = json.loads(genuine).get("conn") or "0" * 16
    published: dict[str, int] = {}

    def send(topic: str, payload: bytes, what: str) -> None:
        client.publish(topic, payload, qos=1).wait_for_publish(10)
        published[what] = published.get(what, 0) + 1

    for msg in forgeries(run, attempt, ranks, nodes):
        send(*p.encode(msg, cluster=cluster), f"unsigned {msg.kind}")
        guessed = p.Seal(key=secrets.token_bytes(32), conn=conn, seq=p.WILL_SEQ if isinstance(msg, p.Lost) else 10**9)
        send(*p.encode(msg, cluster=cluster, seal=guessed), f"guessed-key {msg.kind}")
    time.sleep(3)  # the genuine rank has sent newer messages since
    send(genuine_topic, genuine, "replayed step")
    for c in {client, reader}:
        c.loop_stop()
        c.disconnect()
    print(json.dumps({"cluster": cluster, "published": published, "total": sum(published.values())}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

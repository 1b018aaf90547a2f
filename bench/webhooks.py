"""How long a notice takes from the event log to a webhook's receiver, and what a receiver
that is down for a while costs it.

    python bench/webhooks.py [--events 200] [--outage-s 5]

A real store (SQLite, WAL, as the daemon opens it), the daemon's ``Webhooks`` on an event
loop of its own, and a receiver (http.server, a thread of this process) answering 200.
``--events`` notices (``run.failed`` state changes) are recorded one every 10 ms, as a
tick records them, and each one's latency is its receipt minus its record. Then the
receiver stops for ``--outage-s`` while as many more are recorded, starts again, and the
bench says how long after its return the backlog was delivered, and whether any notice
was lost or came twice. One JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import http.server
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from supervisor.domain.events import EventKind  # noqa: E402
from supervisor.ports import free_port  # noqa: E402
from supervisor.store import SqlStore  # noqa: E402
from supervisor.webhooks import Webhook, Webhooks  # noqa: E402


class Receiver:
    """An HTTP receiver on ``port`` that keeps (event id, when) for each notice."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.got: list[tuple[int, float]] = []
        self.server: http.server.ThreadingHTTPServer | None = None

    def start(self) -> None:
        got = self.got

        class Hook(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                got.append((int(body["id"]), time.time()))
                self.send_response(200)
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", self.port), Hook)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def stop(self) -> None:
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()
            self.server = None


def record(store: SqlStore, n: int) -> dict[int, float]:
    """``n`` run.failed notices, one every 10 ms: each event's id and when it was recorded."""
    at: dict[int, float] = {}
    for _ in range(n):
        now = time.time()
        with store.tx() as tx:
            event_id = tx.add_event(None, EventKind.RUN_STATE, "RUNNING -> FAILED: bench",
                                    {"to": "FAILED"}, now)
        at[event_id] = now
        time.sleep(0.01)
    return at


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--events", type=int, default=200)
    parser.add_argument("--outage-s", type=float, default=5.0)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="tsup-bench-webhooks-") as tmp:
        store = SqlStore(Path(tmp) / "supervisor.db")
        store.open()
        receiver = Receiver(free_port())
        receiver.start()
        hooks = Webhooks(store, [Webhook(name="bench", url=f"http://127.0.0.1:{receiver.port}/")], "bench")
        hooks.start()
        loop = asyncio.new_event_loop()
        task = loop.create_task(hooks.deliver_forever())
        threading.Thread(target=loop.run_forever, daemon=True).start()
        try:
            first = record(store, args.events)
            _wait(lambda: len(receiver.got) >= len(first), 60)
            latencies = [(when - first[i]) * 1000 for i, when in receiver.got if i in first]
            receiver.stop()
            second = record(store, args.events)
            time.sleep(max(0.0, args.outage_s - args.events * 0.01))
            back = time.time()
            receiver.start()
            _wait(lambda: len(receiver.got) >= len(first) + len(second), 120)
            drained_s = max(when for i, when in receiver.got if i in second) - back
        finally:
            loop.call_soon_threadsafe(task.cancel)
            receiver.stop()
            store.close()
    ids = [i for i, _ in receiver.got]
    print(json.dumps({
        "events": args.events, "outage_s": args.outage_s,
        "latency_ms": {"p50": round(statistics.median(latencies), 1),
                       "p99": round(sorted(latencies)[int(0.99 * (len(latencies) - 1))], 1),
                       "max": round(max(latencies), 1)},
        "backlog_delivered_s_after_return": round(drained_s, 2),
        "lost": len((set(first) | set(second)) - set(ids)), "twice": len(ids) - len(set(ids)),
    }))


def _wait(done: Any, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not done():
        if time.monotonic() > deadline:
            raise SystemExit(f"webhooks bench: not delivered in {timeout_s} s")
        time.sleep(0.02)


if __name__ == "__main__":
    main()

"""Webhooks (supervisor/webhooks.py) from a real daemon (`serve --config` with
``[[notify]]``) to a real HTTP receiver, a second process the test starts, kills, hangs
and starts again: a FAILED run and a drained node arrive within 5 s, nothing is lost
while the receiver is down, nothing arrives twice, and the daemon's tick goes on while
the receiver hangs."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from supervisor.ports import free_port
from tests.conftest import REPO, port_open, wait_for
from tests.e2e.conftest import Serve, command_spec

# Each POST as one JSON line in argv[2] (the time it came, its key, its body), answered
# 200; or, with argv[3] == "hang", read and never answered.
RECEIVER = r"""
import http.server, json, sys, time
port, out, mode = int(sys.argv[1]), sys.argv[2], sys.argv[3]

class Hook(http.server.BaseHTTPRequestHandler):
    def do_POST(self):
        body = self.rfile.read(int(self.headers["Content-Length"]))
        if mode == "hang":
            time.sleep(3600)
        with open(out, "a") as f:
            f.write(json.dumps({"at": time.time(), "path": self.path, "key": self.headers["Idempotency-Key"],
                                "body": json.loads(body)}) + "\n")
        self.send_response(200)
        self.end_headers()

    def log_message(self, *args):
        pass

http.server.ThreadingHTTPServer(("127.0.0.1", port), Hook).serve_forever()
"""


class Receiver:
    def __init__(self, port: int, out: Path) -> None:
        self.port, self.out = port, out
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, mode: str = "answer") -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", RECEIVER, str(self.port), str(self.out), mode])
        wait_for(lambda: port_open(self.port), 10, "the receiver to listen")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)

    def got(self, path: str) -> list[dict[str, Any]]:
        lines = self.out.read_text().splitlines() if self.out.exists() else []
        return [g for g in map(json.loads, lines) if g["path"] == path]


def failing_run(daemon: Serve, tmp_path: Path, name: str) -> str:
    spec = command_spec(tmp_path / f"{name}.toml", name, ["sh", "-c", "exit 3"],
                        resources={"launcher": "local", "nodes": 1, "ranks_per_node": 1},
                        policy={"backoff_base_s": 0.1, "backoff_max_s": 0.1, "crash_loop_attempts": 2})
    run_id = str(daemon.ctl_json("submit", str(spec))["run_id"])
    wait_for(lambda: daemon.read("status", run_id)["state"] == "FAILED", 60, f"{run_id} to fail", interval_s=0.3)
    return run_id


@pytest.fixture
def receiver(tmp_path: Path) -> Any:
    r = Receiver(free_port(), tmp_path / "received.jsonl")
    r.start()
    yield r
    r.stop()


def test_a_failed_run_and_a_drained_node_reach_the_webhooks_once_through_a_receivers_restart_and_hang(
        receiver: Receiver, tmp_path: Path) -> None:
    state, port = tmp_path / "state", free_port()
    url = f"http://127.0.0.1:{receiver.port}"
    (tmp_path / "slack-url").write_text(f"{url}/slack\n")
    config = tmp_path / "config.toml"
    config.write_text(f'state_dir = "{state}"\napi_bind = "127.0.0.1:{port}"\ntick_s = 0.25\nsweep_every_s = 0\n'
                      f'[[notify]]\nname = "ops"\nurl = "{url}/ops"\nkinds = ["run.failed", "node.drained"]\n'
                      f'[[notify]]\nname = "chat"\nurl_file = "{tmp_path / "slack-url"}"\nformat = "slack"\n'
                      'kinds = ["run.failed"]\n')
    daemon = Serve(state, port, config=config)
    try:
        first = failing_run(daemon, tmp_path, "first")
        [failed] = wait_for(lambda: receiver.got("/ops"), 5, "the FAILED run at the JSON webhook")
        body = failed["body"]
        assert body["notice"] == "run.failed" and body["run_id"] == first and body["kind"] == "run.state"
        assert failed["at"] - body["ts"] < 5, "within 5 s of the event"
        assert failed["key"] == f"{body['cluster']}-{body['id']}"
        [chat] = wait_for(lambda: receiver.got("/slack"), 5, "the FAILED run at the Slack webhook")
        assert set(chat["body"]) == {"text"} and f"{first}: run.failed: " in chat["body"]["text"]

        [node] = daemon.read("status", first)["attempt_history"][-1]["nodes"]
        assert daemon.ctl("drain", node, "--reason", "fan failure").returncode == 0
        drained = wait_for(lambda: [g for g in receiver.got("/ops") if g["body"]["notice"] == "node.drained"],
                           5, "the drained node")
        assert drained[0]["at"] - drained[0]["body"]["ts"] < 5 and "fan failure" in drained[0]["body"]["message"]

        # The receiver killed: a run fails meanwhile, and is delivered once it is back.
        receiver.stop()
        second = failing_run(daemon, tmp_path, "second")
        time.sleep(2)
        # Then it hangs (reads each POST, never answers): the daemon ticks on, and a run
        # submitted now still fails on time.
        receiver.start("hang")
        third = failing_run(daemon, tmp_path, "third")
        assert daemon.get_json("/healthz")["last_tick_age_s"] < 2, "the tick never waits for a webhook"
        receiver.stop()
        receiver.start()
        wait_for(lambda: {g["body"]["run_id"] for g in receiver.got("/ops")} >= {first, second, third}, 60,
                 "every FAILED run, once the receiver is back")
        wait_for(lambda: len(receiver.got("/slack")) == 3, 30, "the Slack webhook's three")
        time.sleep(2)  # anything that would come twice, come
        for path, expected in (("/ops", 4), ("/slack", 3)):
            keys = [g["key"] for g in receiver.got(path)]
            assert len(keys) == expected and len(set(keys)) == expected, (path, keys)
        log = daemon.log_path.read_text()
        assert "notify ops: event" in log and "trying again until it is" in log
        assert url not in log, "the webhooks' URLs are never logged"
    finally:
        daemon.kill(signal.SIGTERM)


def test_a_webhook_config_that_names_its_url_badly_is_refused_without_repeating_it(tmp_path: Path) -> None:
    config = tmp_path / "config.toml"
    config.write_text(f'state_dir = "{tmp_path / "state"}"\napi_bind = "127.0.0.1:{free_port()}"\n'
                      '[[notify]]\nname = "ops"\nurl = "ftp://hooks.example/T0/B0/secret-part"\n')
    done = subprocess.run([sys.executable, "-m", "cli.daemon", "serve", "--config", str(config)], cwd=REPO,
                          capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 2 and "the webhook URL must be http:// or https://" in done.stderr, done.stderr
    assert "secret-part" not in done.stderr
    config.write_text(config.read_text().replace('url = "ftp://hooks.example/T0/B0/secret-part"',
                                                 f'url_file = "{tmp_path / "absent"}"'))
    done = subprocess.run([sys.executable, "-m", "cli.daemon", "serve", "--config", str(config)], cwd=REPO,
                          capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode != 0 and f"cannot read url_file {tmp_path / 'absent'}" in done.stderr, done.stderr

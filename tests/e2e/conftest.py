"""End-to-end helpers: the real CLIs in subprocesses, real training, real signals."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import sqlite3
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

import httpx
import psutil
import pytest

from slurmbox.box import Box
from supervisor.users import RunAs, login_env, popen_ids
from tests.conftest import REPO, own_wait, port_open, wait_for

EXAMPLE = REPO / "examples" / "tiny-llama.toml"


def env() -> dict[str, str]:
    # The suite runs as root (it starts Slurm and network namespaces), and so do the runs
    # its daemons start, unless a test says otherwise (tests/e2e/test_least_privilege.py).
    return {**os.environ, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1", "TSUP_ALLOW_ROOT_RUNS": "true"}


def tsup(*args: str | Path, timeout_s: float = 400) -> subprocess.CompletedProcess[str]:
    """`training-supervisor ARGS` (with a Slurm box's chaos hooks: slurmbox/tsup.py), waited
    for. One that outlives ``timeout_s`` gets SIGABRT (PYTHONFAULTHANDLER: every thread's
    stack on its stderr), and the failure shows where it was stuck."""
    own_wait(timeout_s)
    proc = subprocess.Popen([sys.executable, "-m", "slurmbox.tsup", *map(str, args)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**env(), "PYTHONFAULTHANDLER": "1"},
                            cwd=REPO)
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        children = psutil.Process(proc.pid).children(recursive=True)  # its trainers: gone with it
        proc.send_signal(signal.SIGABRT)
        try:
            out, err = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
        for child in children:
            with contextlib.suppress(psutil.Error):
                child.kill()
        raise AssertionError(f"training-supervisor {' '.join(map(str, args))} did not end in {timeout_s:.0f} s; "
                             f"its stderr, with every thread's stack:\n{err[-12000:]}") from None
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def ctl(url: str, *args: str, timeout_s: float = 60,
        extra_env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """`supervisorctl --url URL ARGS`, waited for. No token unless ``extra_env`` names one
    (and none from the user's own config: $TSUP_CTL_CONFIG points nowhere)."""
    environ = {**env(), "TSUP_CTL_CONFIG": os.devnull, **(extra_env or {})}
    return subprocess.run([sys.executable, "-m", "cli.ctl", "--url", url, *args], capture_output=True,
                          text=True, timeout=timeout_s, env=environ, cwd=REPO, check=False)


def slurm(box: Box, *argv: str) -> str:
    """A Slurm command against ``box``, its stdout (it must succeed)."""
    out = subprocess.run(list(argv), env=box.env, capture_output=True, text=True, timeout=30, check=True)
    return out.stdout


def serve_config(path: Path, state: Path, port: int, **keys: Any) -> Path:
    """A daemon config at ``path``: ``state``, the API on 127.0.0.1:``port``, a fast tick,
    no sweep, and ``keys`` (written as JSON, which is TOML for strings and lists)."""
    settings = {"state_dir": str(state), "api_bind": f"127.0.0.1:{port}", "tick_s": 0.25, "sweep_every_s": 0,
                **keys}
    path.write_text("".join(f"{k} = {json.dumps(v)}\n" for k, v in settings.items()))
    return path


def command_spec(path: Path, name: str, argv: list[str], *, resources: dict[str, Any] | None = None,
                 policy: dict[str, Any] | None = None, **command: Any) -> Path:
    """A spec for a trainer the supervisor did not write, at ``path``: ``[command]`` with
    ``argv``, a checkpoint directory in the run directory unless given, and ``command``'s
    other keys. Values are written as JSON, which is TOML for strings, numbers and lists;
    tables as TOML's inline tables."""
    def value(v: Any) -> str:
        if isinstance(v, dict):
            return "{" + ", ".join(f"{json.dumps(k)} = {value(x)}" for k, x in v.items()) + "}"
        return json.dumps(v)

    def table(title: str, keys: dict[str, Any]) -> list[str]:
        return [f"[{title}]", *(f"{k} = {value(v)}" for k, v in keys.items())]

    lines = [f"name = {json.dumps(name)}", *table("resources", resources or {}),
             *table("command", {"argv": argv, "checkpoint_dir": "{run_dir}/checkpoints", **command}),
             *(table("policy", policy) if policy else [])]
    path.write_text("\n".join(lines) + "\n")
    return path


def spec_for_slurm(tmp_path: Path, **resources: Any) -> Path:
    """The example spec on the Slurm launcher, with extra ``[resources]`` keys."""
    text = EXAMPLE.read_text().replace('launcher = "local"', 'launcher = "slurm"')
    extra = "".join(f"{k} = {json.dumps(v)}\n" for k, v in resources.items())
    text = text.replace("[resources]\n", "[resources]\n" + extra)
    path = tmp_path / "spec.toml"
    path.write_text(text)
    return path


def assert_same_weights(path: Path, expected: dict[str, Any]) -> None:
    """The weights torch.save wrote at ``path`` are bitwise ``expected``."""
    import torch

    final = torch.load(path)
    assert final.keys() == expected.keys()
    for name, tensor in final.items():
        assert torch.equal(tensor, expected[name]), f"{name} differs from the run that never failed"


def summary_of(proc: subprocess.CompletedProcess[str]) -> dict[str, Any]:
    assert proc.stdout.strip(), f"no summary; exit {proc.returncode}; stderr:\n{proc.stderr[-3000:]}"
    data: dict[str, Any] = json.loads(proc.stdout)
    return data


def db_rows(state_dir: Path, query: str) -> list[tuple[Any, ...]]:
    conn = sqlite3.connect(state_dir / "supervisor.db")
    try:
        return conn.execute(query).fetchall()
    finally:
        conn.close()


def trainer_processes(marker: Path) -> list[psutil.Process]:
    """Live processes of the runs under ``marker`` (a state directory): every process an
    attempt started, whatever its trainer (``python -m trainer``, torchrun and its workers,
    a user's train.sh and what it runs), found by the attempt's TSUP_MARKER in its
    environment, and the reference trainer's warm standbys, found by their command line.
    Not counted: the nodes' own processes (the node agents, on Slurm a step of their own;
    ``node_processes``) and the srun clients on the controller, which end after their
    step's tasks."""
    found = []
    for p in psutil.process_iter(["cmdline", "status", "name"]):
        try:
            if p.info["status"] == psutil.STATUS_ZOMBIE:
                continue
            cmdline = p.info["cmdline"] or []
            if cmdline[1:3] == ["-m", "trainer"] and any(str(marker) in a for a in cmdline):
                found.append(p)
                continue
            if p.info["name"] == "srun" or "node.agent" in cmdline:
                continue
            env = p.environ()
            if str(marker) in env.get("TSUP_MARKER", "") and not env.get("TSUP_NODE_PROCESS"):
                found.append(p)
        except psutil.Error:
            continue
    return found


def attempt_of(env: dict[str, str]) -> str | None:
    """The attempt a process of ``trainer_processes`` belongs to, from its environment: its
    TSUP_ATTEMPT (the reference trainer's), else the attempt directory its TSUP_MARKER names.
    None when the environment names neither: read again after ``trainer_processes`` found
    the process, it can be empty (a process exiting or in exec has no memory to read it
    from) or another program's (a child that was forked, then exec'd with an environment of
    its own): that process is no longer the attempt's."""
    if "TSUP_ATTEMPT" in env:
        return env["TSUP_ATTEMPT"]
    found = re.search(r"/attempts/(\d+)/", env.get("TSUP_MARKER", ""))
    return found.group(1) if found else None


def node_processes(marker: Path) -> list[psutil.Process]:
    """The local launcher's nodes' own processes (supervisor/launchers/local.py: a node
    agent, or a ``sleep`` where the attempt has no telemetry) of attempts whose marker is
    under ``marker`` (a state directory)."""
    found = []
    for p in psutil.process_iter():
        try:
            env = p.environ()
            if env.get("TSUP_NODE_PROCESS") and str(marker) in env.get("TSUP_MARKER", ""):
                found.append(p)
        except psutil.Error:
            continue
    return found


@pytest.fixture
def state(tmp_path: Path) -> Iterator[Path]:
    """A state directory for one test; no trainer of it outlives the test, whatever failed."""
    d = tmp_path / "state"
    yield d
    for p in [*trainer_processes(d), *node_processes(d)]:
        p.kill()


class Serve:
    """One `training-supervisor serve` process on a state directory: with --state-dir and
    --api-bind flags, or, given ``config``, only --config (which must name both)."""

    def __init__(self, state: Path, port: int, *args: str, config: Path | None = None, scheme: str = "http",
                 extra_env: dict[str, str] | None = None, user: RunAs | None = None) -> None:
        self.state, self.port = state, port
        self.url = f"{scheme}://127.0.0.1:{port}"
        self.log_path = state.parent / f"serve-{port}.log"
        self.log = open(self.log_path, "ab")  # noqa: SIM115
        where = ["--config", str(config)] if config else ["--state-dir", str(state), "--api-bind", f"127.0.0.1:{port}"]
        uid, gid, groups = popen_ids(user)  # ``user``: the daemon runs as that user, not root
        self.proc = subprocess.Popen([sys.executable, "-m", "cli.daemon", "serve", *where, *args],
                                     stdout=self.log, stderr=subprocess.STDOUT,
                                     env={**env(), **login_env(user), **(extra_env or {})}, cwd=REPO,
                                     user=uid, group=gid, extra_groups=groups)
        wait_for(lambda: port_open(port) or self.proc.poll() is not None, 30, "the API to listen")
        assert self.proc.poll() is None, self.log_path.read_text()

    def kill(self, sig: int) -> int:
        os.kill(self.proc.pid, sig)
        return self.proc.wait(30)

    @property
    def token_file(self) -> Path:
        return self.state / "api-token"

    @property
    def read_token_file(self) -> Path:
        return self.state / "api-read-token"

    def get(self, path: str) -> httpx.Response:
        """GET ``path`` with the read-only token, as a watcher (or Prometheus) would."""
        r = httpx.get(self.url + path, headers={"Authorization": f"Bearer {self.read_token_file.read_text().strip()}"})
        r.raise_for_status()
        return r

    def get_json(self, path: str) -> Any:
        return self.get(path).json()

    def metrics(self) -> str:
        return self.get("/metrics").text

    # What `supervisorctl --json COMMAND` prints for these read commands is the API's GET of
    # the same path (cli/ctl.py: _show). ``read`` makes that GET in this process: a test's
    # polling loop, which would otherwise start a CLI process (half a second of CPU) a poll.
    READS: ClassVar[dict[str, str]] = {"status": "/v1/runs/{}", "checkpoints": "/v1/runs/{}/checkpoints",
                                       "nodes": "/v1/nodes", "runs": "/v1/runs"}

    def read(self, command: str, *args: str) -> Any:
        """``ctl_json(command, *args)`` for a read command, without a CLI process."""
        if not self.url.startswith("http://"):
            return self.ctl_json(command, *args)
        return self.get_json(self.READS[command].format(*args))

    def ctl(self, *args: str, token: bool = True) -> subprocess.CompletedProcess[str]:
        """`supervisorctl` against this daemon, with its API token unless ``token=False``."""
        return ctl(self.url, *args, extra_env={"TSUP_API_TOKEN_FILE": str(self.token_file)} if token else None)

    def ctl_json(self, *args: str) -> Any:
        proc = self.ctl("--json", *args)
        assert proc.returncode == 0, proc.stderr
        return json.loads(proc.stdout)


def slurm_serve(state: Path, port: int, box: Box) -> Serve:
    """`training-supervisor serve` with the Slurm launcher on ``box``."""
    return Serve(state, port, "--launcher", "slurm", extra_env={"SLURM_CONF": str(box.conf)})


class FakeSystemd:
    """The notify socket systemd gives a Type=notify service: every datagram the daemon
    sends, read as it comes (a receiver that stopped reading would drop messages)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.messages: list[bytes] = []
        self.stamped: list[tuple[float, bytes]] = []  # (when received, the datagram)
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(str(path))
        self.sock.settimeout(0.2)
        self._stop = threading.Event()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        while not self._stop.is_set():
            try:
                message = self.sock.recv(4096)
                self.stamped.append((time.time(), message))
                self.messages.append(message)
            except TimeoutError:
                continue

    def close(self) -> None:
        self._stop.set()
        self._reader.join()
        self.sock.close()

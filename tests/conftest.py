"""Shared fixtures: free ports, a real mosquitto broker, and the rule for missing parts.

A test that needs a real component (mosquitto, Slurm) starts it here and stops it by
pid. When the component is not installed the test is skipped on a developer machine
but FAILS under CI (CI=true), where `make test` has installed it.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from health.host import SHARED_HOST_ENV
from supervisor.ports import free_port  # the tests' ports: tests.conftest.free_port

REPO = Path(__file__).resolve().parents[1]
IN_CI = os.environ.get("CI", "").lower() == "true"
# pytest-timeout's limit for one test (pyproject.toml). A wait of a test's own must end
# well inside it, through the test's own abort (stacks shown, children killed): ``own_wait``.
TEST_TIMEOUT_S = float(tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]
                       ["timeout"])
ABORT_GRACE_S = 60.0  # what a test's own abort takes: stacks dumped, processes killed, the report


def own_wait(timeout_s: float) -> float:
    """``timeout_s``, checked to end (with its abort) inside pytest-timeout's limit: a wait
    that outlived it would be cut off by pytest-timeout, which kills no child and shows no
    stack of the process waited for."""
    if timeout_s + ABORT_GRACE_S > TEST_TIMEOUT_S:
        raise ValueError(f"a wait of {timeout_s:g} s and its abort do not fit in pytest's {TEST_TIMEOUT_S:g} s "
                         f"per test: at most {TEST_TIMEOUT_S - ABORT_GRACE_S:g}")
    return timeout_s


def require(what: str, available: bool, *, missing: str = "is not installed (make test installs it as root)",
            ) -> None:
    """Skip the test where ``what`` is not available here, and fail it under CI, where
    everything a test needs is (a skipped test is not a passing one)."""
    if available:
        return
    message = f"{what} {missing}"
    if IN_CI:
        pytest.fail(f"CI: {message}")
    pytest.skip(message)


def require_root(what: str) -> None:
    """Root, for what only root can do here (start another user's process, chown, create a
    user): missing, the test skips, and fails under CI (which runs as root)."""
    require(what, os.geteuid() == 0, missing="needs root (CI runs the suite as root)")


def require_module(name: str, what: str) -> Any:
    """The module ``name``, imported, for a test module that needs it (``what``: where it
    comes from); missing, the module's tests skip, and under CI its collection fails."""
    try:
        return importlib.import_module(name)
    except ImportError:
        message = f"{name} ({what}) is not installed"
        if IN_CI:
            pytest.fail(f"CI: {message}", pytrace=False)
        pytest.skip(message, allow_module_level=True)


def wait_for(predicate, timeout_s: float, what: str, interval_s: float = 0.05):  # type: ignore[no-untyped-def]
    """Poll until predicate() is truthy; return its value, or fail naming what was awaited."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(interval_s)


def port_open(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.settimeout(0.2)
        return s.connect_ex((host, port)) == 0


@dataclass(frozen=True)
class Broker:
    host: str
    port: int
    pid: int

    @property
    def url(self) -> str:
        return f"mqtt://{self.host}:{self.port}"


def _mosquitto_binary() -> str | None:
    return shutil.which("mosquitto") or ("/usr/sbin/mosquitto" if os.path.exists("/usr/sbin/mosquitto")
                                          else None)


def start_mosquitto(workdir: Path, port: int | None = None, settings: str = "allow_anonymous true\n",
                    host: str = "127.0.0.1") -> tuple[Broker, subprocess.Popen[bytes]]:
    """mosquitto on ``host``: one listener with ``settings`` (mosquitto.conf lines)."""
    binary = _mosquitto_binary()
    require("mosquitto", binary is not None)
    assert binary is not None
    port = port or free_port()
    conf = workdir / f"mosquitto-{port}.conf"
    # `user root`: started as root, mosquitto would read the files below as user mosquitto
    conf.write_text(f"user root\nlistener {port} {host}\n{settings}persistence false\n")
    log = open(workdir / f"mosquitto-{port}.log", "wb")  # noqa: SIM115
    proc = subprocess.Popen([binary, "-c", str(conf)], stdout=log, stderr=subprocess.STDOUT)
    wait_for(lambda: port_open(port, host) or proc.poll() is not None, 10, "mosquitto to listen")
    assert proc.poll() is None, (workdir / f"mosquitto-{port}.log").read_text()
    return Broker(host, port, proc.pid), proc


@dataclass(frozen=True)
class SecuredBroker:
    """A mosquitto as a site runs one: TLS, a password file and an ACL (see secure_mosquitto)."""

    broker: Broker
    ca_file: Path
    proc: subprocess.Popen[bytes]

    def url(self, user: str, password: str | None = None) -> str:
        """The mqtts:// URL for one of SECURED_USERS (its own password unless given)."""
        return f"mqtts://{user}:{password or SECURED_USERS[user]}@127.0.0.1:{self.broker.port}"


# The site's accounts: the supervisor reads telemetry and writes events and its presence;
# ranks write telemetry and read the supervisor's presence, nothing else (no rank can
# read another's messages).
SECURED_USERS = {"supervisor": "sup-pass", "rank": "rank-pass"}
SECURED_ACL = """user supervisor
topic read tsup/+/+/telemetry/#
topic write tsup/+/+/events/#
topic write tsup/+/+/supervisor
user rank
topic write tsup/+/+/telemetry/#
topic read tsup/+/+/supervisor
"""


def secure_mosquitto(workdir: Path, port: int | None = None) -> SecuredBroker:
    """A mosquitto with a TLS listener (a CA made here; the server certificate names
    127.0.0.1), a password file (mosquitto_passwd) and SECURED_ACL."""
    openssl = shutil.which("openssl")
    require("openssl", openssl is not None)
    require("mosquitto_passwd", shutil.which("mosquitto_passwd") is not None)
    d = workdir / "mqtt-tls"
    d.mkdir(exist_ok=True)

    def run(*argv: str) -> None:
        subprocess.run(argv, check=True, capture_output=True, cwd=d)

    run("openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", "/CN=tsup test CA",
        "-keyout", "ca.key", "-out", "ca.crt")
    run("openssl", "req", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=127.0.0.1", "-keyout", "server.key",
        "-out", "server.csr")
    (d / "san.ext").write_text("subjectAltName=IP:127.0.0.1\n")
    run("openssl", "x509", "-req", "-in", "server.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
        "-days", "2", "-extfile", "san.ext", "-out", "server.crt")
    (d / "passwd").touch()
    for user, password in SECURED_USERS.items():
        run("mosquitto_passwd", "-b", "passwd", user, password)
    (d / "acl").write_text(SECURED_ACL)
    broker, proc = start_mosquitto(workdir, port, settings=(
        f"certfile {d / 'server.crt'}\nkeyfile {d / 'server.key'}\nallow_anonymous false\n"
        f"password_file {d / 'passwd'}\nacl_file {d / 'acl'}\n"))
    return SecuredBroker(broker, d / "ca.crt", proc)


def stop_by_pid(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        os.kill(proc.pid, signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()


@pytest.fixture
def mosquitto(tmp_path: Path) -> Iterator[Broker]:
    broker, proc = start_mosquitto(tmp_path)
    try:
        yield broker
    finally:
        stop_by_pid(proc)


@pytest.fixture(scope="session")
def mosquitto_session(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Broker]:
    broker, proc = start_mosquitto(tmp_path_factory.mktemp("mosquitto"))
    try:
        yield broker
    finally:
        stop_by_pid(proc)


# --- Slurm ---------------------------------------------------------------------------


@contextlib.contextmanager
def once_per_run(tmp_path_factory: pytest.TempPathFactory, name: str) -> Iterator[Path]:
    """A directory every worker of this pytest run shares (pytest-xdist gives each worker
    a session of its own, and a session fixture would be made once per worker), held by
    one worker at a time: the first to hold it makes what a session fixture needs there,
    the others find it made."""
    from slurmbox.box import file_lock

    base = tmp_path_factory.getbasetemp()
    root = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    with file_lock(root / f"{name}.lock"):
        (root / name).mkdir(exist_ok=True)
        yield root / name


@pytest.fixture(scope="session")
def fault_free(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The example run with no fault: the reference every faulty run must match (run
    once for all workers)."""
    from tests.e2e.conftest import EXAMPLE, summary_of, tsup

    with once_per_run(tmp_path_factory, "fault-free") as shared:
        summary = shared / "summary.json"
        if not summary.exists():
            proc = tsup("run", EXAMPLE, "--state-dir", shared / "state", "--json")
            assert proc.returncode == 0, proc.stderr[-3000:]
            summary.write_text(json.dumps(summary_of(proc)))
        found: dict[str, Any] = json.loads(summary.read_text())
        return found


FSDP_TEST_CASE = REPO / "tests" / "standins" / "fsdp_test_case.py"
FSDP_STEPS = 60
# Its training arguments, the same supervised or not: 60 steps, a checkpoint every 10.
FSDP_TRAIN = ("--max_steps", str(FSDP_STEPS), "--checkpoint_freq", "10", "--step_sleep", "0.1")


@pytest.fixture(scope="session")
def fsdp_never_failed(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The final weights of the FSDP test case's stand-in run by hand (two torchruns of
    two ranks, no supervisor, no fault): what every supervised run of it must end with.

    It is the reference, not the thing under test: a run whose rendezvous fails (once in
    a CI run both torchruns exited 1 here, their output then thrown away) is tried once
    more on another port, and its output is kept and shown if that fails too. Run once
    for all workers."""
    import torch

    with once_per_run(tmp_path_factory, "fsdp-by-hand") as shared:
        if not (shared / "final.pt").exists():
            _fsdp_by_hand(shared)
        return dict(torch.load(shared / "final.pt"))


def _fsdp_by_hand(shared: Path) -> None:
    for attempt in (1, 2):
        work = shared / f"try-{attempt}"
        work.mkdir(exist_ok=True)  # another worker's failed try: tried again here
        torchrun = [str(Path(sys.executable).parent / "torchrun"), "--nnodes=2", "--nproc_per_node=2",
                    "--rdzv_id=by-hand", f"--rdzv_endpoint=127.0.0.1:{free_port()}", "--rdzv_backend=c10d"]
        args = [str(FSDP_TEST_CASE), *FSDP_TRAIN, "--checkpoint_dir", str(work / "checkpoints"),
                "--out", str(work / "final.pt")]
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        logs = [work / f"torchrun-{i}.log" for i in range(2)]
        nodes = []
        for log in logs:
            with open(log, "w") as out:
                nodes.append(subprocess.Popen([*torchrun, *args], cwd=work, env=env, stdout=out,
                                              stderr=subprocess.STDOUT))
        codes = [p.wait(timeout=300) for p in nodes]
        if codes == [0, 0]:
            shutil.copy(work / "final.pt", shared / "final.pt")
            return
        said = "\n".join(f"--- {log.name}:\n{log.read_text(errors='replace')[-3000:]}" for log in logs)
        print(f"fsdp_never_failed: try {attempt} exited {codes}:\n{said}", file=sys.stderr)
    raise AssertionError(f"the FSDP stand-in run by hand exited {codes} twice:\n{said}")


def slurm_installed() -> bool:
    return all(os.path.exists(f"/usr/sbin/{b}") for b in ("munged", "slurmctld", "slurmd")) and bool(
        shutil.which("sinfo") and shutil.which("srun"))


def a_slurm_box(nodes: int, keep_logs: Path) -> Iterator[Any]:
    """A real Slurm cluster of ``nodes`` nodes on this host (scripts/slurm-box), stopped by
    pid.

    A fresh box per test: tests kill nodes and drain them. Its directory is short (unix
    socket paths are limited to 108 bytes) and removed afterwards, its logs (slurmctld's,
    each slurmd's, munge's) copied to ``keep_logs`` first: what Slurm did in a failed
    scenario stays beside the test's own files. While it is up, the
    probes a daemon of the test runs on its nodes are told that they share this host
    (health/host.py: the host's load and trainers are not one node's).
    """
    require("Slurm (slurmctld, slurmd, munge, slurm-client)", slurm_installed())
    from slurmbox import box as slurm_box_mod

    directory = Path(tempfile.mkdtemp(prefix="tsup-box-"))
    try:
        box = slurm_box_mod.up(directory, nodes)
    except BaseException:
        slurm_box_mod.down(directory)
        raise
    try:
        with pytest.MonkeyPatch.context() as env:
            env.setenv(SHARED_HOST_ENV, "1")  # the box's nodes share this host: srun hands it to every probe
            yield box
    finally:
        slurm_box_mod.down(directory)
        if (directory / "log").is_dir():
            shutil.copytree(directory / "log", keep_logs, dirs_exist_ok=True)
        shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture
def slurm_box(tmp_path: Path) -> Iterator[Any]:
    """A box of three nodes; its logs kept in the test's ``slurm-box-logs``."""
    yield from a_slurm_box(3, tmp_path / "slurm-box-logs")


@pytest.fixture
def slurm_box4(tmp_path: Path) -> Iterator[Any]:
    """A box of four nodes: a run of two and its spare, and a node to spare for a requeue."""
    yield from a_slurm_box(4, tmp_path / "slurm-box-logs")


# --- the chaos suite: a rotating subset in `make test`, every scenario in `make chaos` ---

CHAOS_SUBSET = 3  # scenarios `make test` runs out of tests/chaos
# Always in the subset: the daemon SIGKILLed at random points (nothing may be lost when the
# supervisor itself dies); one scenario on the Slurm box is drawn besides.
CHAOS_ALWAYS = ("test_sigkill_of_the_supervisor_at_random_points_loses_nothing",)


def commit_seed() -> int:
    """The seed a commit gets: its hash, so that each commit runs another subset, and the
    same commit always the same one (0 outside a git checkout)."""
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True, timeout=10,
                             check=True)
        return int(out.stdout.strip()[:8], 16)
    except (OSError, subprocess.SubprocessError, ValueError):
        return 0


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("chaos", "chaos scenarios (tests/chaos)")
    group.addoption("--chaos-all", action="store_true",
                    help="run every chaos scenario (make chaos); without it, a seeded subset of "
                         f"{CHAOS_SUBSET} when more are collected")
    group.addoption("--seed", type=int, default=None,
                    help="seed of the chaos subset and of the mixed-fault scenario "
                         "(default $TSUP_CHAOS_SEED, else drawn from the commit's hash)")


# Each test's kind is its folder's: `pytest -m unit` (seconds, nothing started), `-m
# integration` (real mosquitto, Slurm, torch), `-m e2e`, `-m contract`, `-m chaos`.
KIND_OF_FOLDER = {"unit": "unit", "integration": "integration", "e2e": "e2e", "contract": "contract",
                  "chaos": "chaos"}


# The suite runs on several workers (`make test`: `pytest -n 3 --dist loadgroup`). What
# this host holds one of is used by one test at a time, whichever worker runs it:
# - "box": the Slurm boxes and their network namespaces (a test that asks for one, every
#   e2e and chaos test_slurm*.py, the launcher contract, the install on the multi-host box);
# - "users": the host's accounts the install, privilege, hostile-user and user-tree tests
#   make and delete (and `open_dir`, where their homes are).
# Such a test takes each one's file lock (box before users: no two tests wait on each
# other) before its first fixture and gives it back after its last, and goes in the xdist
# group of the first it needs, so that one worker runs a resource's tests one after
# another while the rest run beside them. Another test that needs one says so with
# ``@pytest.mark.box`` or ``@pytest.mark.users``. A test may count as its own only what
# its state directory names.
SHARED_RESOURCES = ("box", "users")  # in the order their locks are taken
RESOURCE_LOCK = {name: Path(tempfile.gettempdir()) / f"tsup-tests-{name}.lock" for name in SHARED_RESOURCES}
RESOURCE_FIXTURES = {"box": {"slurm_box", "slurm_box4"}, "users": {"open_dir"}}
RESOURCE_FILES = {"box": {"test_install.py", "test_launcher_contract.py"},
                  "users": {"test_install.py", "test_least_privilege.py", "test_hostile_user.py",
                            "test_user_tree.py"}}


def resources_of(item: pytest.Item) -> list[str]:
    """The host's one-of-a-kind things ``item`` uses, in lock order."""
    fixtures = set(getattr(item, "fixturenames", ()))
    on_box_file = item.path.name.startswith("test_slurm") and item.path.parent.name in ("e2e", "chaos")
    return [name for name in SHARED_RESOURCES
            if item.get_closest_marker(name) is not None or item.path.name in RESOURCE_FILES[name]
            or bool(RESOURCE_FIXTURES[name] & fixtures) or (name == "box" and on_box_file)]


@pytest.fixture(autouse=True)
def _host_turn(request: pytest.FixtureRequest) -> Iterator[None]:
    """The turn of each shared resource the test uses (autouse: set up before the test's
    other fixtures of its scope, torn down after them)."""
    from slurmbox.box import file_lock

    with contextlib.ExitStack() as held:
        for name in SHARED_RESOURCES:
            if request.node.get_closest_marker(name) is not None:  # set at collection
                held.enter_context(file_lock(RESOURCE_LOCK[name]))
        yield


def pytest_itemcollected(item: pytest.Item) -> None:
    """Mark a test with its folder's kind, before -m chooses (a file needs no pytestmark),
    and a test of the host's one-of-a-kind things with each one's marker and the xdist
    group of the first."""
    parts = item.path.relative_to(REPO / "tests").parts
    kind = KIND_OF_FOLDER.get(parts[0]) if len(parts) > 1 else None
    if kind is not None and item.get_closest_marker(kind) is None:
        item.add_marker(kind)
    uses = resources_of(item)
    for name in uses:
        if item.get_closest_marker(name) is None:
            item.add_marker(name)
    if uses:
        item.add_marker(pytest.mark.xdist_group(uses[0]))


def pytest_configure(config: pytest.Config) -> None:
    if config.getoption("--seed", None) is None:
        env_seed = os.environ.get("TSUP_CHAOS_SEED")
        config.option.seed = int(env_seed) if env_seed else commit_seed()


def choose_chaos(chaos: list[str], seed: int, size: int = CHAOS_SUBSET) -> list[str]:
    """The subset of scenario node ids to run: the ones always run, one Slurm scenario, and
    the rest drawn at random by ``seed`` from the local ones (a Slurm scenario starts a box
    of its own and takes minutes: one a run keeps `make test` within its time)."""
    import random

    def on_slurm(node_id: str) -> bool:  # tests/chaos/test_slurm*.py
        return "/test_slurm" in node_id

    rng = random.Random(seed)
    chosen = [c for c in chaos if scenario_name(c) in CHAOS_ALWAYS]  # each parametrization of one
    slurm = sorted(c for c in chaos if on_slurm(c) and c not in chosen)
    if slurm and not any(on_slurm(c) for c in chosen):
        chosen.append(rng.choice(slurm))
    rest = sorted(c for c in chaos if c not in chosen and not on_slurm(c))
    return chosen + rng.sample(rest, max(0, min(len(rest), size - len(chosen))))


def scenario_name(node_id: str) -> str:
    """A scenario's function name, without its file or its parameters."""
    return node_id.rsplit("::", maxsplit=1)[-1].split("[", maxsplit=1)[0]


def missing_always(chaos: list[str]) -> list[str]:
    """The scenarios of CHAOS_ALWAYS that none of the node ids ``chaos`` names."""
    return [name for name in CHAOS_ALWAYS if not any(scenario_name(c) == name for c in chaos)]


@pytest.hookimpl(trylast=True)  # after -k and -m have chosen: a scenario named that way runs
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Keep a seeded subset of the chaos scenarios (deselected, not skipped: `make chaos`
    runs the rest), unless --chaos-all or only a few were collected (one named on the
    command line always runs)."""
    chaos = sorted((i for i in items if i.get_closest_marker("chaos")), key=lambda i: i.nodeid)
    if config.getoption("--chaos-all") or len(chaos) <= CHAOS_SUBSET:
        return
    missing = missing_always([i.nodeid for i in chaos])
    if missing:  # renamed or removed: the subset would quietly run without it
        raise pytest.UsageError(f"chaos: {', '.join(missing)} (tests/conftest.py CHAOS_ALWAYS) is not among "
                                f"the {len(chaos)} scenarios collected")
    seed = config.getoption("--seed")
    chosen_ids = set(choose_chaos([i.nodeid for i in chaos], seed))
    dropped = [i for i in chaos if i.nodeid not in chosen_ids]
    items[:] = [i for i in items if i not in dropped]
    config.hook.pytest_deselected(items=dropped)
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        names = ", ".join(i.name for i in chaos if i.nodeid in chosen_ids)
        reporter.write_line(f"chaos: seed {seed} (TSUP_CHAOS_SEED={seed} repeats it), {len(chosen_ids)} of "
                            f"{len(chaos)} scenarios ({names}); `make chaos` runs them all")

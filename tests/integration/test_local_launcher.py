"""The local launcher with real processes and real signals."""

from __future__ import annotations

import json
import os
import signal
import sys
from dataclasses import replace
from pathlib import Path

import psutil
import pytest

from supervisor.domain import ProcState
from supervisor.errors import LaunchError
from supervisor.launchers.base import AllocationRequest, LaunchSpec
from supervisor.launchers.local import LocalLauncher
from tests.conftest import wait_for

# Each rank writes its torchrun environment to a file (whole, by a rename), then sleeps (or exits with $CODE).
RANK_SCRIPT = """
import json, os, sys, time
out = sys.argv[1]
keys = ["RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_PORT", "TSUP_NODE", "X",
        "NOTIFY_SOCKET", "CREDENTIALS_DIRECTORY", "AWS_SECRET_ACCESS_KEY", "SSH_AUTH_SOCK", "NCCL_DEBUG", "LC_ALL"]
path = os.path.join(out, "env-" + os.environ["RANK"] + ".json")
with open(path + ".tmp", "w") as f:
    json.dump({k: os.environ.get(k) for k in keys}, f)
os.rename(path + ".tmp", path)  # whole when it appears: the test reads it once it does
time.sleep(float(os.environ.get("SLEEP", "60")))
sys.exit(int(os.environ.get("CODE", "0")))
"""


def spec(tmp_path: Path, **env: str) -> LaunchSpec:
    marker = str(tmp_path / "marker-config.json")
    return LaunchSpec(run_id="run-1", attempt=1, nodes=("local-1", "local-2"), ranks_per_node=2,
                      argv=(sys.executable, "-c", RANK_SCRIPT, str(tmp_path), marker),
                      env={"X": "y", **env}, log_dir=tmp_path / "logs", marker=marker)


@pytest.fixture
def launcher() -> LocalLauncher:
    return LocalLauncher()


def started(launcher: LocalLauncher, tmp_path: Path, **env: str) -> str:
    info = launcher.start(spec(tmp_path, **env))
    wait_for(lambda: len(list(tmp_path.glob("env-*.json"))) == 4, 20, "every rank to start")
    return info


def states(launcher: LocalLauncher, info: str) -> dict[int, tuple[ProcState, int | None]]:
    return {r.rank: (r.proc, r.exit_code) for r in launcher.observe(info)}


def test_a_job_gets_an_allow_listed_part_of_the_daemons_environment_and_nothing_else(
        launcher: LocalLauncher, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 37, item 7: a job got the daemon's whole environment (a systemd unit's
    NOTIFY_SOCKET and CREDENTIALS_DIRECTORY, an operator's cloud keys and SSH agent)."""
    daemon_only = {"NOTIFY_SOCKET": "/run/systemd/notify", "CREDENTIALS_DIRECTORY": "/run/credentials/x",
                   "AWS_SECRET_ACCESS_KEY": "operator's", "SSH_AUTH_SOCK": "/tmp/ssh-x/agent.1"}
    for k, v in {**daemon_only, "NCCL_DEBUG": "WARN", "LC_ALL": "C.UTF-8"}.items():
        monkeypatch.setenv(k, v)
    info = started(launcher, tmp_path)
    try:
        env = json.loads((tmp_path / "env-0.json").read_text())
        assert {k: env[k] for k in daemon_only} == dict.fromkeys(daemon_only)
        assert (env["NCCL_DEBUG"], env["LC_ALL"], env["X"]) == ("WARN", "C.UTF-8", "y")
    finally:
        launcher.stop(info, force=True)


def test_ranks_get_the_torchrun_environment_and_a_process_group_per_node(
        launcher: LocalLauncher, tmp_path: Path) -> None:
    info = started(launcher, tmp_path)
    try:
        envs = [json.loads((tmp_path / f"env-{r}.json").read_text()) for r in range(4)]
        assert [(e["RANK"], e["LOCAL_RANK"], e["GROUP_RANK"], e["TSUP_NODE"]) for e in envs] == [
            ("0", "0", "0", "local-1"), ("1", "1", "0", "local-1"),
            ("2", "0", "1", "local-2"), ("3", "1", "1", "local-2")]
        assert {e["WORLD_SIZE"] for e in envs} == {"4"} and {e["X"] for e in envs} == {"y"}
        assert len({e["MASTER_PORT"] for e in envs}) == 1
        ranks = json.loads(info)["ranks"]
        groups = {r["node"]: {x["pgid"] for x in ranks if x["node"] == r["node"]} for r in ranks}
        assert all(len(g) == 1 for g in groups.values()) and groups["local-1"] != groups["local-2"]
        assert all(os.getpgid(r["pid"]) == r["pgid"] for r in ranks)
        assert all(s == (ProcState.RUNNING, None) for s in states(launcher, info).values())
    finally:
        launcher.stop(info, force=True)


def node_up(launcher: LocalLauncher, info: str) -> dict[str, bool | None]:
    return {r.node: r.node_up for r in launcher.observe(info)}


def test_kill_rank_kills_exactly_one_process(launcher: LocalLauncher, tmp_path: Path) -> None:
    info = started(launcher, tmp_path)
    try:
        assert "rank 2" in launcher.kill_rank(info, 2)
        wait_for(lambda: states(launcher, info)[2][0] is ProcState.EXITED, 10, "rank 2 to die")
        s = states(launcher, info)
        assert s[2] == (ProcState.EXITED, -signal.SIGKILL)
        assert s[0][0] is s[1][0] is s[3][0] is ProcState.RUNNING
        assert node_up(launcher, info) == {"local-1": True, "local-2": True}, "its node's own process lives on"
        with pytest.raises(LaunchError, match="not running"):
            launcher.kill_rank(info, 2)
    finally:
        launcher.stop(info, force=True)


def test_kill_node_kills_every_process_of_that_node_only(launcher: LocalLauncher, tmp_path: Path) -> None:
    info = started(launcher, tmp_path)
    try:
        launcher.kill_node(info, "local-2")
        wait_for(lambda: all(states(launcher, info)[r][0] is ProcState.EXITED for r in (2, 3)), 10, "node death")
        s = states(launcher, info)
        assert s[2] == s[3] == (ProcState.EXITED, -signal.SIGKILL)
        assert s[0][0] is s[1][0] is ProcState.RUNNING
        assert node_up(launcher, info) == {"local-1": True, "local-2": False}, "the node's own process with them"
    finally:
        launcher.stop(info, force=True)


def test_a_nodes_own_process_leads_its_group_and_ends_with_the_attempt(launcher: LocalLauncher,
                                                                     tmp_path: Path) -> None:
    info = started(launcher, tmp_path, SLEEP="0")
    own = {n["node"]: n["pid"] for n in json.loads(info)["nodes"]}
    ranks = json.loads(info)["ranks"]
    assert {r["node"]: r["pgid"] for r in ranks} == own, "a node's ranks join its own process's group"
    wait_for(lambda: all(p == ProcState.EXITED for p, _ in states(launcher, info).values()), 10, "ranks to exit")
    assert node_up(launcher, info) == {"local-1": True, "local-2": True}, "the nodes outlive their ranks"
    launcher.forget(info)
    assert not any(psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
                   for pid in own.values()), "nothing of an ended attempt is left"


def test_a_restarted_daemons_launcher_ends_the_nodes_own_processes_of_an_ended_attempt(
        launcher: LocalLauncher, tmp_path: Path) -> None:
    info = started(launcher, tmp_path, SLEEP="0")
    own = {n["node"]: n["pid"] for n in json.loads(info)["nodes"]}
    wait_for(lambda: all(p == ProcState.EXITED for p, _ in states(launcher, info).values()), 10, "ranks to exit")
    LocalLauncher().forget(info)  # the daemon that started them died before letting go of them
    left = [pid for pid in own.values() if psutil.pid_exists(pid)
            and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE]
    assert not left, "an ended attempt's node processes outlive the daemon that started them"


def test_stop_terminates_every_rank_and_is_idempotent(launcher: LocalLauncher, tmp_path: Path) -> None:
    info = started(launcher, tmp_path)
    launcher.stop(info, force=False)
    wait_for(lambda: all(p == ProcState.EXITED for p, _ in states(launcher, info).values()), 10, "stop")
    assert {c for _, c in states(launcher, info).values()} == {-signal.SIGTERM}
    launcher.stop(info, force=True)  # nothing left: no error, no stray signal


def test_exit_codes_are_collected(launcher: LocalLauncher, tmp_path: Path) -> None:
    info = started(launcher, tmp_path, SLEEP="0", CODE="3")
    wait_for(lambda: all(p == ProcState.EXITED for p, _ in states(launcher, info).values()), 10, "exits")
    assert {c for _, c in states(launcher, info).values()} == {3}
    launcher.forget(info)


def test_a_new_launcher_finds_and_adopts_processes_by_marker(launcher: LocalLauncher, tmp_path: Path) -> None:
    info = started(launcher, tmp_path)
    try:
        fresh = LocalLauncher()  # a restarted daemon: no children of its own
        found = fresh.find(spec(tmp_path))
        assert found is not None
        assert sorted((r["rank"], r["pid"], r["node"]) for r in json.loads(found)["ranks"]) == sorted(
            (r["rank"], r["pid"], r["node"]) for r in json.loads(info)["ranks"])
        assert all(p is ProcState.RUNNING for p, _ in states(fresh, found).values())
        fresh.kill_node(found, "local-1")
        wait_for(lambda: all(states(fresh, found)[r][0] is ProcState.VANISHED for r in (0, 1)), 10,
                 "local-1's adopted ranks to vanish")
        assert states(fresh, found)[1] == (ProcState.VANISHED, None)  # not our child: no exit code
        assert fresh.find(replace(spec(tmp_path), marker=str(tmp_path / "nobody"))) is None
    finally:
        launcher.stop(info, force=True)


def test_a_missing_program_is_a_launch_error(launcher: LocalLauncher, tmp_path: Path) -> None:
    bad = LaunchSpec(run_id="run-1", attempt=1, nodes=("local-1",), ranks_per_node=2,
                     argv=(str(tmp_path / "no-such-trainer"),), env={}, log_dir=tmp_path, marker="m")
    with pytest.raises(LaunchError, match="cannot start"):
        launcher.start(bad)


def test_allocation_reuses_idle_nodes_then_names_new_ones_up_to_the_cap() -> None:
    launcher = LocalLauncher(max_nodes=4)

    def ask(count: int, held: tuple[str, ...], idle: tuple[str, ...], known: set[str]) -> tuple[str, ...]:
        return launcher.allocate(AllocationRequest(run_id="run-1", count=count, minimum=1, held=held,
                                                   drained=frozenset(), idle=idle, known=frozenset(known),
                                                   info=None)).nodes

    assert ask(3, (), ("local-2",), {"local-1", "local-2"}) == ("local-2", "local-3", "local-4")
    assert ask(4, ("local-1", "local-2", "local-3"), (), {"local-1", "local-2", "local-3"}) == (
        "local-1", "local-2", "local-3", "local-4")
    short = launcher.allocate(AllocationRequest(run_id="run-1", count=3, minimum=1, held=(), drained=frozenset(),
                                                idle=(), known=frozenset({"a", "b", "c"}), info=None))
    assert short.nodes == ("local-1",) and "at most 4 local nodes" in short.note


# A node's own launcher: torchrun, spawning its node's ranks under a c10d rendezvous.
WORKER = """
import json, os, sys, time
import torch.distributed as dist
dist.init_process_group("gloo")
path = os.path.join(sys.argv[1], "env-" + os.environ["RANK"] + ".json")
with open(path + ".tmp", "w") as f:
    json.dump({"rank": dist.get_rank(), "world": dist.get_world_size(), "group": os.environ["GROUP_RANK"]}, f)
os.rename(path + ".tmp", path)
time.sleep(60)
"""


def test_one_torchrun_per_node_spawns_the_ranks_and_a_rank_is_killed_under_it(
        launcher: LocalLauncher, tmp_path: Path) -> None:
    from supervisor.domain.step import DEFERRED

    (tmp_path / "worker.py").write_text(WORKER)
    torchrun = str(Path(sys.executable).parent / "torchrun")
    argv = (torchrun, "--nnodes={nnodes}".format(**DEFERRED), "--nproc_per_node={nproc_per_node}".format(**DEFERRED),
            "--rdzv_id={rdzv_id}".format(**DEFERRED), "--rdzv_backend=c10d",
            "--rdzv_endpoint={master_addr}:{master_port}".format(**DEFERRED), str(tmp_path / "worker.py"),
            str(tmp_path))
    node_spec = replace(spec(tmp_path), argv=argv, launch="node")
    info = launcher.start(node_spec)
    try:
        wait_for(lambda: len(list(tmp_path.glob("env-*.json"))) == 4, 60, "every rank of both nodes")
        envs = sorted(json.loads(p.read_text())["rank"] for p in tmp_path.glob("env-*.json"))
        assert envs == [0, 1, 2, 3] and {json.loads(p.read_text())["world"] for p in tmp_path.glob("env-*.json")} == {4}
        ranks = json.loads(info)["ranks"]
        assert [(r["rank"], r["node"]) for r in ranks] == [(0, "local-1"), (1, "local-1"), (2, "local-2"),
                                                          (3, "local-2")]
        assert len({r["pid"] for r in ranks}) == 2, "one process per node"
        assert sorted(p.name for p in (tmp_path / "logs").iterdir()) == ["node-0000.local-1.log",
                                                                        "node-0001.local-2.log"]

        # A new launcher (a restarted daemon) adopts the two torchruns, not their workers.
        found = LocalLauncher().find(node_spec)
        assert found is not None
        assert [(r["rank"], r["pid"]) for r in json.loads(found)["ranks"]] == [(r["rank"], r["pid"]) for r in ranks]

        # Node 1's two workers, alive now (torchrun may end them itself once node 2 fails).
        workers = [p for p in psutil.Process(ranks[0]["pid"]).children() if p.is_running()]
        assert len(workers) == 2, workers
        assert all(os.getpgid(p.pid) != ranks[0]["pgid"] for p in workers), "sessions of their own"
        # kill-rank reaches the worker of that rank, under its node's torchrun.
        said = launcher.kill_rank(info, 3)
        assert "rank 3" in said and str(ranks[3]["pid"]) not in said.split("(pid ")[1]
        # torchrun sees its worker die, stops the node's other worker, and fails.
        wait_for(lambda: states(launcher, info)[3][0] is ProcState.EXITED, 60, "node 2's torchrun to exit")
        assert states(launcher, info)[2] == states(launcher, info)[3] and states(launcher, info)[3][1] != 0

        # torchrun puts its workers in sessions of their own: SIGKILL of node 1's torchrun
        # alone would leave them training. A forced stop reaches them too, unless node 1's
        # torchrun ended them itself, seeing node 2 leave the rendezvous; either way none
        # is left.
        launcher.stop(info, force=True)
        wait_for(lambda: not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in workers), 20,
                 "node 1's workers to die with their torchrun")
        wait_for(lambda: all(s[0] is ProcState.EXITED for s in states(launcher, info).values()), 20,
                 "every rank to end")
    finally:
        launcher.stop(info, force=True)


def test_a_nodes_workers_outliving_its_killed_torchrun_still_run_until_stopped(
        launcher: LocalLauncher, tmp_path: Path) -> None:
    """torchrun starts its workers in sessions of their own: with their torchrun SIGKILLed
    they train on. The node's ranks are running until they are gone, and a forced stop
    reaches them."""
    from supervisor.domain.step import DEFERRED

    (tmp_path / "worker.py").write_text(WORKER)
    argv = (str(Path(sys.executable).parent / "torchrun"), "--nnodes=1", "--nproc_per_node=2",
            "--rdzv_backend=c10d", "--rdzv_endpoint={master_addr}:{master_port}".format(**DEFERRED),
            str(tmp_path / "worker.py"), str(tmp_path))
    node_spec = replace(spec(tmp_path), nodes=("local-1",), argv=argv, launch="node")
    info = launcher.start(node_spec)
    try:
        wait_for(lambda: len(list(tmp_path.glob("env-*.json"))) == 2, 60, "both workers")
        agent = json.loads(info)["ranks"][0]["pid"]
        workers = psutil.Process(agent).children()
        assert len(workers) == 2
        os.kill(agent, signal.SIGKILL)
        wait_for(lambda: launcher._children[agent].poll() is not None, 10, "torchrun to die")
        assert all(w.is_running() for w in workers), "its workers train on"
        assert {s for s, _ in states(launcher, info).values()} == {ProcState.RUNNING}
        launcher.stop(info, force=True)
        wait_for(lambda: not any(w.is_running() and w.status() != psutil.STATUS_ZOMBIE for w in workers), 20,
                 "the workers to be killed")
        assert {s for s, _ in states(launcher, info).values()} == {ProcState.EXITED}
    finally:
        launcher.stop(info, force=True)

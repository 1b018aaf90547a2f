"""One suite of cluster behaviour, run against the local launcher, the Slurm adapters on a
real box, and the scripted cluster the reconciler's tests use (tests/fakes.py).

Every cluster must: hand out nodes; report exit codes (or, where it cannot see a process,
UNKNOWN and never a death); stop every rank; be observable from its launch_info by a
fresh instance (a restarted daemon); find an unrecorded attempt by its marker, and only
that one; kill one node's ranks, all of them and only those; drain a node until it
shows drained and return it. The clusters that run real processes must also give each
rank the torchrun environment with the rank-to-node map they report.
"""

from __future__ import annotations

import contextlib
import json
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import psutil
import pytest

from slurmbox.chaos import BoxChaos
from supervisor import node_health
from supervisor.domain import ProcState
from supervisor.launchers.base import AllocationRequest, ChaosHooks, Launcher, LaunchSpec, NodeAdmin, RankProc
from supervisor.launchers.local import LocalLauncher
from supervisor.slurm.cluster import slurm_cluster
from supervisor.slurm.launcher import SlurmLauncher
from tests.conftest import wait_for
from tests.fakes import ScriptedLauncher

pytestmark = pytest.mark.contract

# Each rank records its environment and pid, then exits with EXIT_<RANK> if set, or sleeps.
PROGRAM = """
import json, os, sys, time
rank = os.environ["RANK"]
keys = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "TSUP_NODE", "MASTER_ADDR", "MASTER_PORT")
with open(os.path.join(sys.argv[1], f"env-{rank}.json"), "w") as f:
    json.dump({**{k: os.environ.get(k) for k in keys}, "PID": os.getpid()}, f)
code = os.environ.get(f"EXIT_{rank}")
if code is not None:
    time.sleep(0.5)
    sys.exit(int(code))
time.sleep(600)
"""

GONE = (ProcState.EXITED, ProcState.VANISHED)
ALIVE = (ProcState.RUNNING, ProcState.UNKNOWN)


@dataclass
class Cluster:
    kind: str  # local, slurm, fake
    launcher: Launcher
    admin: NodeAdmin
    chaos: ChaosHooks
    make: Any  # () -> a fresh launcher on the same cluster: a restarted daemon's
    nodes: tuple[str, ...]
    allocation_info: str | None

    @property
    def real(self) -> bool:
        """Runs the ranks as processes of this host (the program above really runs)."""
        return self.kind != "fake"


def _request(count: int) -> AllocationRequest:
    return AllocationRequest(run_id="run-1", count=count, minimum=count, held=(), drained=frozenset(), idle=(),
                             known=frozenset(), info=None)


@pytest.fixture(params=["local", "slurm", "fake"])
def cluster(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Cluster]:
    if request.param in ("local", "fake"):
        launcher: Any = LocalLauncher(max_nodes=4) if request.param == "local" else ScriptedLauncher()
        grant = launcher.allocate(_request(2))
        make = (lambda: LocalLauncher(max_nodes=4)) if request.param == "local" else launcher.fresh
        yield Cluster(request.param, launcher, launcher, launcher, make, grant.nodes, None)
        return
    box = request.getfixturevalue("slurm_box")
    state = tmp_path / "state"

    def make() -> SlurmLauncher:
        return slurm_cluster(slurm_conf=str(box.conf), state_dir=state, poll_interval_s=0.0).launcher

    adapters = slurm_cluster(slurm_conf=str(box.conf), state_dir=state, poll_interval_s=0.0)
    slurm = adapters.launcher
    info = slurm.allocate(_request(2)).info
    held = wait_for(lambda: (g := slurm.held("run-1", info)) is not None and len(g.nodes) == 2 and g, 30,
                    "the allocation to start")
    try:
        yield Cluster("slurm", slurm, adapters.nodes, BoxChaos(str(box.conf)), make, held.nodes, info)
    finally:
        slurm.release("run-1", info)


def spec(c: Cluster, tmp_path: Path, attempt: int = 1, env: dict[str, str] | None = None) -> LaunchSpec:
    out = tmp_path / f"out-{attempt}"
    out.mkdir(exist_ok=True)
    return LaunchSpec(run_id="run-1", attempt=attempt, nodes=c.nodes, ranks_per_node=2,
                      argv=(sys.executable, "-c", PROGRAM, str(out)), env=env or {},
                      log_dir=tmp_path / f"logs-{attempt}", marker=f"{tmp_path}/marker-{attempt}",
                      allocation_info=c.allocation_info)


def observe(launcher: Launcher, info: str) -> dict[int, RankProc]:
    return {r.rank: r for r in launcher.observe(info)}


def all_gone(launcher: Launcher, info: str) -> dict[int, RankProc] | None:
    ranks = observe(launcher, info)
    return ranks if ranks and all(r.proc in GONE for r in ranks.values()) else None


def envs(tmp_path: Path, attempt: int = 1) -> dict[int, dict[str, Any]]:
    """The environments the ranks wrote; one still being written is not there yet."""
    out = {}
    for p in (tmp_path / f"out-{attempt}").glob("env-*.json"):
        with contextlib.suppress(ValueError):
            out[int(p.stem.removeprefix("env-"))] = json.loads(p.read_text())
    return out


def started(c: Cluster, tmp_path: Path, info: str) -> None:
    """Every rank is up: it wrote its environment (a real cluster), or is RUNNING (the fake)."""
    if c.real:
        wait_for(lambda: len(envs(tmp_path)) == 4, 60, "every rank to start")
    assert sorted(observe(c.launcher, info)) == [0, 1, 2, 3], "every rank is observed"


@pytest.mark.parametrize("cluster", ["local", "slurm"], indirect=True)  # the scripted one runs no program
def test_ranks_get_the_torchrun_environment_and_the_reported_node_map(cluster: Cluster, tmp_path: Path) -> None:
    s = spec(cluster, tmp_path, env={f"EXIT_{r}": "0" for r in range(4)})
    info = cluster.launcher.start(s)
    ranks = wait_for(lambda: all_gone(cluster.launcher, info), 60, "every rank to exit")
    assert sorted(ranks) == [0, 1, 2, 3]
    assert {r.exit_code for r in ranks.values()} == {0}
    got = envs(tmp_path)
    for r, e in got.items():
        assert e["RANK"] == str(r) and e["WORLD_SIZE"] == "4" and e["LOCAL_RANK"] == str(r % 2)
        assert e["TSUP_NODE"] == ranks[r].node, "the launcher's rank-to-node map is where the rank ran"
        assert e["MASTER_PORT"] == got[0]["MASTER_PORT"]
    assert {ranks[r].node for r in range(4)} == set(cluster.nodes)
    cluster.launcher.forget(info)


def test_a_failed_rank_is_reported_with_its_exit_code(cluster: Cluster, tmp_path: Path) -> None:
    info = cluster.launcher.start(spec(cluster, tmp_path, env={"EXIT_3": "7", "EXIT_0": "0", "EXIT_1": "0",
                                                                "EXIT_2": "0"}))
    ranks = wait_for(lambda: all_gone(cluster.launcher, info), 60, "every rank to exit")
    assert ranks[3].proc is ProcState.EXITED and ranks[3].exit_code == 7
    assert [ranks[r].exit_code for r in (0, 1, 2)] == [0, 0, 0]
    cluster.launcher.forget(info)


def test_running_ranks_are_never_reported_dead_and_stop_ends_them(cluster: Cluster, tmp_path: Path) -> None:
    info = cluster.launcher.start(spec(cluster, tmp_path))
    started(cluster, tmp_path, info)
    for _ in range(3):
        assert all(r.proc in ALIVE for r in cluster.launcher.observe(info))
        time.sleep(0.3)
    cluster.launcher.stop(info, force=False)
    wait_for(lambda: all_gone(cluster.launcher, info), 60, "SIGTERM to end every rank")
    cluster.launcher.stop(info, force=True)  # idempotent
    cluster.launcher.forget(info)


def test_a_restarted_daemon_observes_and_finds_what_was_launched(cluster: Cluster, tmp_path: Path) -> None:
    s = spec(cluster, tmp_path)
    info = cluster.launcher.start(s)
    started(cluster, tmp_path, info)
    fresh = cluster.make()
    assert sorted(observe(fresh, info)) == [0, 1, 2, 3]
    assert all(r.proc in ALIVE for r in fresh.observe(info))
    found = wait_for(lambda: fresh.find(s), 30, "the unrecorded attempt to be found")
    assert {r.rank for r in fresh.observe(found)} == {0, 1, 2, 3}
    assert fresh.find(replace(s, attempt=9, marker=f"{tmp_path}/marker-9")) is None, "no false match"
    fresh.stop(found, force=True)
    wait_for(lambda: all_gone(fresh, found), 60, "SIGKILL to end every rank")
    cluster.launcher.stop(info, force=True)


def test_kill_node_kills_all_of_that_nodes_ranks_and_only_those(cluster: Cluster, tmp_path: Path) -> None:
    info = cluster.launcher.start(spec(cluster, tmp_path))
    started(cluster, tmp_path, info)
    by_rank = observe(cluster.launcher, info)
    victim = by_rank[3].node
    doomed = sorted(r for r, p in by_rank.items() if p.node == victim)
    survivors = sorted(r for r, p in by_rank.items() if p.node != victim)
    assert doomed and survivors, by_rank
    cluster.chaos.kill_node(info, victim)
    if cluster.real:  # the processes themselves are gone, whatever the launcher can see of them
        pids = [envs(tmp_path)[r]["PID"] for r in doomed]
        wait_for(lambda: not any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE
                                 for p in pids), 30, f"the ranks of {victim} to die")
    else:
        assert all(observe(cluster.launcher, info)[r].proc in GONE for r in doomed)
    time.sleep(1.0)
    ranks = observe(cluster.launcher, info)
    assert sorted(ranks) == [0, 1, 2, 3]
    assert all(ranks[r].proc in ALIVE for r in survivors), ranks
    cluster.launcher.stop(info, force=True)


def test_a_drain_shows_until_the_node_is_returned(cluster: Cluster) -> None:
    node = cluster.nodes[0]
    assert cluster.admin.drained(node) is False
    cluster.admin.drain(node, "training-supervisor: contract")
    cluster.admin.drain(node, "training-supervisor: contract")  # idempotent
    assert wait_for(lambda: cluster.admin.drained(node), 30, "the drain to show")
    cluster.admin.undrain(node)
    wait_for(lambda: cluster.admin.drained(node) is False, 30, "the return to show")


@pytest.mark.parametrize("cluster", ["local", "slurm"], indirect=True)  # the scripted one runs no probe
def test_a_probe_answers_for_each_node_which_knows_that_it_shares_this_host(cluster: Cluster,
                                                                            tmp_path: Path) -> None:
    """Every node of either launcher answers the probe under its own name, with the host
    checks run; the host's load and trainer processes are reported, not judged as the
    node's: the local launcher's nodes and a Slurm box's share this one host."""
    answers = cluster.admin.probe(list(cluster.nodes), node_health.probe_argv(["--min-free-gib", "0"]),
                                  allocation_info=cluster.allocation_info, timeout_s=60)
    assert sorted(answers) == sorted(cluster.nodes), answers
    for node in cluster.nodes:
        record = node_health.record(node, answers[node], "manual", None, 0.0)
        found = {f["probe"]: f for f in record.findings}
        assert {"disk", "load", "leftover_trainers"} <= set(found), record
        assert all("not judged" in found[p]["evidence"] for p in ("load", "leftover_trainers")), record

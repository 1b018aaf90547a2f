"""A run's jobs on Slurm (supervisor/slurm/allocation.py), against a scripted Slurm: the
growth job a run that went on with fewer nodes grows back through, and an attempt on the
nodes of two jobs started as a step in each (supervisor/slurm/launcher.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from supervisor.launchers.base import AllocationRequest, LaunchSpec
from supervisor.slurm import parse
from supervisor.slurm.launcher import SlurmLauncher
from supervisor.slurm.requests import RANK_WRAPPER, split_env
from supervisor.slurm.standby import Generation
from tests.unit.test_slurm_security import ME, launcher_on, slurm_of, squeue

# The scripted node table: node1 is down, node2 up, node3 drained; node4 is in no table (usable).
FIRST = {"job_id": 5, "name": "first", "user_id": ME, "nodes": "node[1-2]"}
INFO = json.dumps({"job": "5", "seq": 1, "uid": ME})


def shrunk(info: str = INFO, keep: int | None = 1, count: int = 2) -> AllocationRequest:
    """A run of 2 nodes, no spare, holding one usable node, that may go on with one."""
    return AllocationRequest(run_id="run-1", count=count, minimum=2, keep=keep, held=("node2",),
                             drained=frozenset({"node1"}), idle=(), known=frozenset(), info=info)


def sbatches(slurm: Any) -> list[list[str]]:
    return [a for a in slurm.ran if a[0] == "sbatch"]


def test_a_run_that_may_go_on_with_fewer_nodes_asks_for_the_missing_ones_in_a_growth_job(tmp_path: Path) -> None:
    launcher = launcher_on(slurm := slurm_of(squeue(FIRST)), tmp_path)
    slurm.answers[("sbatch",)] = "67\n"
    grant = launcher.allocate(shrunk())
    assert grant.nodes == ("node2",) and grant.note == "growth job 67 submitted for 1 more node(s)"
    [argv] = sbatches(slurm)
    assert f"--job-name={launcher.prefix}.run-1.1g1" in argv and "--nodes=1" in argv
    assert "--exclude=node1" in argv and "--exclusive" in argv
    assert json.loads(grant.info or "") == {"job": "5", "seq": 1, "uid": ME, "grow": ["67"], "grown": 1}

    # Queued: it is waited for, not submitted again.
    growth = {"job_id": 67, "name": f"{launcher.prefix}.run-1.1g1", "user_id": ME}
    slurm.answers[("squeue", "--json")] = squeue(FIRST, {**growth, "job_state": "PENDING", "nodes": "",
                                                         "state_reason": "Resources"})
    waiting = launcher.allocate(shrunk(grant.info))
    assert waiting.nodes == ("node2",) and waiting.note == "growth job 67 pending: Resources"
    assert len(sbatches(slurm)) == 1

    # Running on node4: its node is the run's, beside the first job's.
    slurm.answers[("squeue", "--json")] = squeue(FIRST, {**growth, "nodes": "node4"})
    assert launcher.allocate(shrunk(grant.info)).nodes == ("node2", "node4")
    held = launcher.held("run-1", grant.info)
    assert held is not None and held.nodes == ("node2", "node4")
    assert launcher.allocations.node_jobs(grant.info) == [("node2", "5"), ("node4", "67")]

    # The run ends: both jobs are given back, as the run's user.
    slurm.answers[("scancel",)] = ""
    assert launcher.release("run-1", grant.info)
    assert sorted(slurm.scancels()) == [["scancel", f"--user={ME}", "5"], ["scancel", f"--user={ME}", "67"]]


def test_a_run_that_may_not_shrink_asks_for_no_growth_job(tmp_path: Path) -> None:
    launcher = launcher_on(slurm := slurm_of(squeue({**FIRST, "nodes": "node2,node4"})), tmp_path)
    grant = launcher.allocate(shrunk(keep=None, count=3))  # a spare lost, the run whole
    assert grant.nodes == ("node2", "node4") and sbatches(slurm) == []
    assert json.loads(grant.info or "") == json.loads(INFO), "recorded as before growth jobs existed"


def test_a_growth_job_left_with_no_usable_node_is_given_back_and_another_asked_for(tmp_path: Path) -> None:
    info = json.dumps({"job": "5", "seq": 1, "uid": ME, "grow": ["67"], "grown": 1})
    launcher = launcher_on(slurm := slurm_of(squeue(FIRST, {"job_id": 67, "name": "g", "user_id": ME,
                                                            "nodes": "node1"})), tmp_path)
    slurm.answers[("sbatch",)] = "70\n"
    grant = launcher.allocate(shrunk(info))
    assert ["scancel", f"--user={ME}", "67"] in slurm.scancels(), "node1, all it holds, is down"
    assert f"--job-name={launcher.prefix}.run-1.1g2" in sbatches(slurm)[0]
    assert json.loads(grant.info or "")["grow"] == ["70"]


def test_a_new_first_job_gives_the_growth_jobs_back(tmp_path: Path) -> None:
    info = json.dumps({"job": "5", "seq": 1, "uid": ME, "grow": ["67"], "grown": 1})
    launcher = launcher_on(slurm := slurm_of(squeue({**FIRST, "nodes": "node1"},
                                                    {"job_id": 67, "name": "g", "user_id": ME, "nodes": "node4"})),
                           tmp_path)
    slurm.answers[("sbatch",)] = "71\n"
    # The first job holds nothing usable, and Slurm will not requeue it (the scripted Slurm
    # refuses requeuehold, as for a job submitted with --no-requeue): replaced.
    grant = launcher.allocate(shrunk(info))
    assert ["scancel", f"--user={ME}", "5"] in slurm.scancels()
    assert ["scancel", f"--user={ME}", "67"] in slurm.scancels()
    assert f"--job-name={launcher.prefix}.run-1.2" in sbatches(slurm)[0]
    assert json.loads(grant.info or "") == {"job": "71", "seq": 2, "uid": ME}


def test_a_growth_job_submitted_by_a_daemon_that_died_before_recording_it_is_adopted(tmp_path: Path) -> None:
    launcher = launcher_on(slurm := slurm_of(), tmp_path)
    name = f"{launcher.prefix}.run-1.1g1"
    slurm.answers[("squeue", "--json")] = squeue(FIRST, {"job_id": 68, "name": name, "user_id": ME,
                                                         "job_state": "PENDING", "nodes": ""})
    grant = launcher.allocate(shrunk())
    assert sbatches(slurm) == [] and json.loads(grant.info or "")["grow"] == ["68"]


# --- an attempt on the nodes of two jobs --------------------------------------------------


class _Commands:
    def __init__(self) -> None:
        self.started: list[tuple[list[str], dict[str, str], Path]] = []

    def start_step(self, argv: list[str], *, env: dict[str, str], log_path: Path, user: object,
                   log_base: Path | None = None, input_pipe: bool = False) -> Any:
        self.started.append((list(argv), dict(env), log_path))
        return subprocess.Popen([sys.executable, "-c", "pass"])


class _TwoJobs:
    def nodes(self) -> dict[str, Any]:
        return {}

    def jobs(self) -> dict[str, parse.JobInfo]:
        return {j: parse.JobInfo(job_id=j, name=j, state="RUNNING", phase=parse.JobPhase.HOLDING, nodes=n,
                                 reason="None", user_id=ME) for j, n in (("5", ("node1",)), ("67", ("node3",)))}

    def steps(self) -> list[parse.StepInfo]:
        return []

    def refresh(self) -> None:
        pass


def test_an_attempt_on_two_jobs_nodes_is_a_step_in_each_placed_in_one_world(tmp_path: Path) -> None:
    commands = _Commands()
    launcher = SlurmLauncher(commands, _TwoJobs(), state_dir=tmp_path)  # type: ignore[arg-type]
    info = json.dumps({"job": "5", "seq": 1, "uid": ME, "grow": ["67"], "grown": 1})
    log_dir = tmp_path / "attempts" / "3"
    launched = json.loads(launcher.start(LaunchSpec(
        run_id="run-1", attempt=3, nodes=("node3", "node1"), ranks_per_node=2, argv=("python3", "-m", "trainer"),
        env={}, log_dir=log_dir, marker="m", allocation_info=info)))
    [(first, first_env, first_log), (growth, growth_env, growth_log)] = commands.started
    assert {"--jobid=5", "--nodelist=node1", "--ntasks=2", "--output=/dev/null"} <= set(first)
    assert {"--jobid=67", "--nodelist=node3", "--ntasks=2", "--output=/dev/null"} <= set(growth)
    assert (first_env["TSUP_RANK_BASE"], growth_env["TSUP_RANK_BASE"]) == ("0", "2")
    assert first_env["TSUP_STEP_NODES"] == growth_env["TSUP_STEP_NODES"] == "node1,node3"
    assert first_env["MASTER_ADDR"] == growth_env["MASTER_ADDR"] == "node1", "one rendezvous for both"
    assert (first_log.name, growth_log.name) == ("srun.log", "srun-67.log")
    assert launched["ranks"] == [[0, "node1"], [1, "node1"], [2, "node3"], [3, "node3"]]
    assert [(p["job"], p["tasks"]) for p in launched["parts"]] == [("5", {"0": 0, "1": 1}),
                                                                   ("67", {"2": 0, "3": 1})]

    # The growth job's step said its task 1 was killed: that is rank 3, not rank 1.
    growth_log.write_text("srun: error: node3: task 1: Killed\n")
    for proc in launcher._children.values():
        proc.wait()
    first_log.write_text("")
    states = {r.rank: (r.proc.value, r.exit_code) for r in launcher.observe(json.dumps(launched))}
    assert states[3] == ("EXITED", -9) and states[1] == ("EXITED", 0), states


def test_the_rank_wrapper_places_a_parts_tasks_in_the_attempt_and_logs_them_under_their_rank(
        tmp_path: Path) -> None:
    probe = "import os; print(*(os.environ[k] for k in ('RANK', 'WORLD_SIZE', 'GROUP_RANK', 'SLURM_JOB_NODELIST')))"
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "SLURM_PROCID": "1", "SLURM_LOCALID": "1",
           "SLURM_NODEID": "0", "SLURM_NTASKS": "2", "SLURMD_NODENAME": "node3", "SLURM_STEP_NODELIST": "node3",
           **split_env(["node1", "node3"], 1, 2, tmp_path)}
    subprocess.run(["/bin/sh", "-c", RANK_WRAPPER, "tsup-rank", sys.executable, "-c", probe], env=env,
                   timeout=60, check=True)
    assert (tmp_path / "rank-3.log").read_text().split() == ["3", "4", "1", "node1,node3"]
    whole = {k: v for k, v in env.items() if not k.startswith("TSUP_")}
    done = subprocess.run(["/bin/sh", "-c", RANK_WRAPPER, "tsup-rank", sys.executable, "-c", probe], env=whole,
                          capture_output=True, text=True, timeout=60, check=True)
    assert done.stdout.split() == ["1", "2", "0", "node3"], "a whole step is as before"


def test_an_attempt_made_of_standbys_is_written_down_before_they_hear_of_it_and_found_after_a_restart(
        tmp_path: Path) -> None:
    """Its steps are the standbys' (``s<N>``), not named for the attempt: a daemon killed
    after handing it over but before the store recorded it finds it in its own directory."""
    launcher = SlurmLauncher(_Commands(), _TwoJobs(), state_dir=tmp_path / "state")  # type: ignore[arg-type]
    standbys = {}
    for node, job in (("node1", "5"), ("node3", "67")):
        (tmp_path / f"srun-{node}.log").touch()
        srun = subprocess.Popen(["cat"], stdin=subprocess.PIPE, stdout=subprocess.DEVNULL)
        standbys[node] = Generation(run_id="run-1", name=f"tsup-x.run-1.s-{node}", job=job, node=node,
                                    ranks_per_node=2, proc=srun, log=tmp_path / f"srun-{node}.log", uid=ME)
    launcher.standbys._waiting["run-1"] = dict(standbys)
    spec = LaunchSpec(run_id="run-1", attempt=3, nodes=("node1", "node3"), ranks_per_node=2,
                      argv=(sys.executable, "-m", "trainer", "--config", "c.json", "--resume", "auto"), env={},
                      log_dir=tmp_path / "attempts" / "3", marker="m", standby_nodes=("node1", "node3"),
                      allocation_info=json.dumps({"job": "5", "seq": 1, "uid": ME, "grow": ["67"], "grown": 1}))
    launched = launcher.start(spec)
    info = json.loads(launched)
    assert info["warm"] and [(p["job"], p["step"]) for p in info["parts"]] == [
        ("5", "tsup-x.run-1.s-node1"), ("67", "tsup-x.run-1.s-node3")], "each node's standbys in its own job"
    for g in standbys.values():
        assert g.proc.wait(10) == 0, "handed its line, and the end of its input"

    restarted = SlurmLauncher(_Commands(), _TwoJobs(), state_dir=tmp_path / "state")  # type: ignore[arg-type]
    assert restarted.find(spec) == launched
    restarted.forget(launched)
    assert restarted.find(spec) is None, "forgotten with the attempt"

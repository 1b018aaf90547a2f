"""Chaos on a real Slurm cluster (three slurmd posing as nodes on this host).

A run of 2 nodes + 1 spare holds one allocation of 3 nodes and trains as a job step on
two of them. A killed node (its slurmd and every process it started, as a power loss
would) is drained with a readable reason and the run resumes on the spare in a new step
of the same allocation; with no spare left, or with its allocation ended by Slurm, the
job is requeued, its id kept; a daemon killed mid-run adopts its job and step again;
slurmctld's own crash and restart costs nothing.
"""

from __future__ import annotations

import http.client
import json
import os
import re
import signal
import sqlite3
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from slurmbox import box as slurm_box_mod
from slurmbox.box import Box
from supervisor.slurm import parse
from supervisor.slurm.launcher import AGENT_SUFFIX
from tests.chaos.conftest import Watch, assert_records
from tests.conftest import FSDP_STEPS, FSDP_TEST_CASE, FSDP_TRAIN, REPO, free_port, wait_for
from tests.e2e.conftest import (
    EXAMPLE,
    FakeSystemd,
    Serve,
    assert_same_weights,
    command_spec,
    db_rows,
    env,
    slurm,
    slurm_serve,
    spec_for_slurm,
    summary_of,
    trainer_processes,
    tsup,
)

pytestmark = [pytest.mark.e2e, pytest.mark.chaos]

# How the drain of a node killed as by a power loss (the box's kill-node) begins: missed by
# its silence while its peers are heard, or lost on Slurm's word that it is DOWN.
POWER_LOST = ("training-supervisor: node silent, no heartbeat from its agent or any rank for ",
              "training-supervisor: node lost, all its ranks vanished at once, and the cluster says the node is down")
# The fault's own words for such a loss: its silence, Slurm's DOWN, or Slurm taking the node
# out of the job (a --no-kill job's failed node), whichever the daemon heard first.
POWER_LOST_SAID = ("silent for ", "the cluster says the node is down", "the cluster took it out of the allocation")


def test_kill_node_drains_it_and_resumes_on_the_spare_in_the_same_allocation(
        slurm_box: Box, fault_free: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SLURM_CONF", str(slurm_box.conf))
    state = tmp_path / "state"
    proc = tsup("run", EXAMPLE, "--launcher", "slurm", "--state-dir", state, "--json",
                "--chaos", "kill-node@50")
    s = summary_of(proc)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert s["state"] == "SUCCEEDED" and s["final_step"] == 80
    assert s["model_digest"] == fault_free["model_digest"], "the node loss changed the math"

    assert [(f["kind"], f["nodes"]) for f in s["faults"]] == [("node-lost", ["node2"])]
    assert s["drained_nodes"] == ["node2"], "exactly the killed node is drained"
    history = s["attempt_history"]
    assert [a["nodes"] for a in history] == [["node1", "node2"], ["node1", "node3"]], "the spare steps in"
    assert [a["resume_step"] for a in history] == [0, 40]

    # Both attempts were steps of one allocation: no second trip through the queue.
    infos = [json.loads(i) for (i,) in db_rows(state, "SELECT launch_info FROM attempts ORDER BY number")]
    assert infos[0]["job"] == infos[1]["job"]
    submitted = [m for (m,) in db_rows(state, "SELECT message FROM events WHERE kind = 'nodes.short'")]
    assert len(submitted) == 1 and "submitted" in submitted[0]

    # Slurm itself says why the node is out of service. A node that lost its power sends
    # no last will: it is missed by its silence while node1 is heard, or by Slurm's DOWN.
    node2 = parse.parse_nodes(slurm(slurm_box, "scontrol", "-o", "show", "node", "node2"))["node2"]
    assert "DRAIN" in node2.flags
    assert node2.reason.startswith(POWER_LOST), node2.reason

    # The run is over: its allocation is given back and nothing is left running.
    wait_for(lambda: parse.parse_squeue_text(
        slurm(slurm_box, "squeue", "-h", "-o", parse.SQUEUE_FORMAT)) == {}, 30, "the allocation to end")
    assert trainer_processes(state) == []

    # The number for the note: from the kill to the first step of the resumed attempt.
    times = dict(db_rows(state, "SELECT kind, ts FROM events WHERE kind IN "
                                "('chaos.injected', 'fault.detected', 'run.recovered') ORDER BY id"))
    print(json.dumps({"kill_to_detect_s": round(times["fault.detected"] - times["chaos.injected"], 2),
                      "kill_to_first_resumed_step_s": round(times["run.recovered"] - times["chaos.injected"], 2)}))
    assert_records(state, s, injected=1)


def test_a_frozen_node_is_found_by_its_silence_drained_and_replaced_by_the_spare(
        slurm_box: Box, fault_free: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """SIGSTOP of node2's slurmd and every process it started: no exit, no last will, no
    answer to Slurm; only silence says so. Drained and replaced by the spare."""
    state = tmp_path / "state"
    try:
        s = succeeds_on_the_box(slurm_box, state, fault_free, "freeze-node@50", monkeypatch)
        [fault] = s["faults"]
        assert fault["kind"] == "node-lost" and fault["nodes"] == ["node2"] and "silent" in fault["summary"], fault
        assert s["drained_nodes"] == ["node2"]
        assert [a["nodes"] for a in s["attempt_history"]] == [["node1", "node2"], ["node1", "node3"]]
        # The frozen ranks could not be reached (stopped, they run nothing). Once the
        # node is back, Slurm ends the step it no longer has, and they are gone.
        slurm_box_mod.signal_node(slurm_box, "node2", signal.SIGCONT)
        wait_for(lambda: trainer_processes(state) == [], 60, "the thawed node's stale ranks to end")
        assert_records(state, s, injected=1)
    finally:  # a frozen slurmd would hold the box's clean-up
        slurm_box_mod.signal_node(slurm_box, "node2", signal.SIGCONT)


def test_without_spares_a_lost_node_requeues_the_job_its_id_kept_onto_a_healthy_node(
        slurm_box: Box, fault_free: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No spare: the job holds one healthy node of the two it needs, so it is requeued (its
    id kept, as a user's scripts that name their logs by job id expect) and Slurm starts it
    again on node1 and node3, never on the drained node2."""
    monkeypatch.setenv("SLURM_CONF", str(slurm_box.conf))
    spec = spec_for_slurm(tmp_path)
    spec.write_text(spec.read_text().replace("spares = 1", "spares = 0"))
    state = tmp_path / "state"
    proc = tsup("run", spec, "--state-dir", state, "--json", "--chaos", "kill-node@50")
    s = summary_of(proc)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert s["state"] == "SUCCEEDED" and s["model_digest"] == fault_free["model_digest"]
    assert s["drained_nodes"] == ["node2"]
    assert [a["nodes"] for a in s["attempt_history"]] == [["node1", "node2"], ["node1", "node3"]]
    jobs = [json.loads(i)["job"] for (i,) in db_rows(state, "SELECT launch_info FROM attempts ORDER BY number")]
    assert jobs[0] == jobs[1], "one job throughout"
    job = parse.parse_key_values(slurm(slurm_box, "scontrol", "-o", "show", "job", jobs[0]))
    assert job["Restarts"] == "1", "requeued once"
    assert job["NodeList"] == "node[1,3]", "started again without the drained node"
    assert_records(state, s, injected=1)


def test_a_node_lost_with_no_node_to_get_on_the_box_continues_on_fewer_ranks(
        slurm_box: Box, fault_free: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No spare, and the box's third node drained by its operator: after kill-node@47 the
    supervisor asks Slurm for a node, none comes within shrink_after_s, and attempt 2 goes on
    with node1's 2 ranks alone, a step of the same allocation, from the 4-rank checkpoint of
    step 40 resharded. It ends with the loss of the fault-free run, up to rounding."""
    monkeypatch.setenv("SLURM_CONF", str(slurm_box.conf))
    slurm(slurm_box, "scontrol", "update", "NodeName=node3", "State=DRAIN", "Reason=operator: memory upgrade")
    spec = spec_for_slurm(tmp_path)
    spec.write_text(spec.read_text().replace("spares = 1", "spares = 0")
                    .replace("[policy]", "[policy]\nshrink_after_s = 2"))
    state = tmp_path / "state"
    proc = tsup("run", spec, "--state-dir", state, "--json", "--chaos", "kill-node@47")
    s = summary_of(proc)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert s["state"] == "SUCCEEDED" and s["final_step"] == 80, s
    assert [(f["kind"], f["nodes"]) for f in s["faults"]] == [("node-lost", ["node2"])], what_happened(
        s, state / "runs" / "run-1")
    first, second = s["attempt_history"]
    assert first["nodes"] == ["node1", "node2"] and second["nodes"] == ["node1"], s["attempt_history"]
    assert second["resume_step"] == 40
    jobs = [json.loads(i)["job"] for (i,) in db_rows(state, "SELECT launch_info FROM attempts ORDER BY number")]
    assert jobs[0] == jobs[1], "the same allocation, one node fewer"
    [shrunk] = db_rows(state, "SELECT message FROM events WHERE kind = 'run.shrunk'")
    assert "continuing on 1 of 2 nodes" in shrunk[0]
    log = (state / "runs" / "run-1" / "attempts" / "2" / "rank-0.log").read_text()
    assert "resharding step_00000040 from 4 to 2 ranks" in log
    assert s["loss"] == pytest.approx(fault_free["loss"], rel=1e-3)

def test_a_run_shrunk_on_the_box_grows_back_through_a_second_allocation(
        slurm_box: Box, fault_free: dict[str, Any], tmp_path: Path) -> None:
    """No spare, node3 drained by its operator: kill-node@27 leaves node1 alone; a growth job
    for one node waits in the queue, and after shrink_after_s attempt 2 goes on on node1
    from step 20. The operator returns node3 as soon as the growth job is asked for (Slurm
    takes seconds to start a job, far more than shrink_after_s): the growth job gets it,
    and once attempt 2 has committed a checkpoint of its own the run grows back. Attempt 3 runs on
    node1 (the first job) and node3 (the growth job), a step in each, from that checkpoint
    resharded from 2 to 4 ranks, and ends with the fault-free loss up to rounding; both jobs
    are given back.

    The growth has until attempt 2's last save before step 80: saves every 10 steps, and
    node1 computing at half speed from step 28 (``slow@28:0``, which changes no number),
    widen that window, which a loaded host's Slurm took whole to start the growth job."""
    slurm(slurm_box, "scontrol", "update", "NodeName=node3", "State=DRAIN", "Reason=operator: memory upgrade")
    spec = spec_for_slurm(tmp_path)
    spec.write_text(spec.read_text().replace("spares = 1", "spares = 0").replace("every_steps = 20", "every_steps = 10")
                    .replace("[policy]", "[policy]\nshrink_after_s = 0.5"))
    state = tmp_path / "state"

    def growth_asked() -> bool:
        return bool(db_rows_soon(state, "SELECT id FROM events WHERE kind = 'nodes.short' "
                                        "AND message LIKE '%growth job%'"))

    def return_node3() -> None:
        wait_for(growth_asked, 240, "a growth job")
        slurm(slurm_box, "scontrol", "update", "NodeName=node3", "State=RESUME")

    s, text = run_acting_meanwhile(slurm_box, tmp_path, ["-v", "run", str(spec), "--state-dir", str(state),
                                                         "--json", "--chaos", "kill-node@27", "--chaos",
                                                         "slow@28:0"], return_node3)
    assert s["state"] == "SUCCEEDED" and s["final_step"] == 80, text[-3000:]
    assert [(f["kind"], f["nodes"]) for f in s["faults"]] == [("node-lost", ["node2"])], what_happened(
        s, state / "runs" / "run-1")
    assert [a["nodes"] for a in s["attempt_history"]] == [["node1", "node2"], ["node1"], ["node1", "node3"]]
    grown_from = s["attempt_history"][2]["resume_step"]
    assert grown_from in (30, 40, 50, 60, 70), "from a checkpoint the shrunk attempt committed"
    [grow] = db_rows(state, "SELECT message FROM events WHERE kind = 'run.grow'")
    assert "growing back to 2 nodes: node3 joined the 1 of attempt 2" in grow[0]
    infos = [json.loads(i) for (i,) in db_rows(state, "SELECT launch_info FROM attempts ORDER BY number")]
    first_job = infos[0]["job"]
    assert infos[1]["job"] == first_job and "parts" not in infos[1], "shrunk: one step of the first job"
    [in_first, in_growth] = infos[2]["parts"]
    assert in_first["job"] == first_job and in_growth["job"] != first_job, "a step in each job"
    assert (in_first["tasks"], in_growth["tasks"]) == ({"0": 0, "1": 1}, {"2": 0, "3": 1})
    growth = parse.parse_key_values(slurm(slurm_box, "scontrol", "-o", "show", "job", in_growth["job"]))
    assert growth["NodeList"] == "node3" and growth["JobName"].endswith(".run-1.1g1"), growth
    run_dir = state / "runs" / "run-1" / "attempts" / "3"
    log = (run_dir / "rank-0.log").read_text()
    assert f"resharding step_{grown_from:08d} from 2 to 4 ranks" in log, log[-2000:]
    assert sorted(p.name for p in run_dir.glob("rank-*.log")) == [f"rank-{r}.log" for r in range(4)], \
        "each task's log under its rank in the attempt, not its task in its job's step"
    assert s["loss"] == pytest.approx(fault_free["loss"], rel=1e-3)
    # The numbers for the note: from the growth job's submission to its node held, and
    # from the decision to grow to the grown attempt's first step.
    times = dict(db_rows(state, "SELECT kind, ts FROM events WHERE kind IN ('nodes.allocated', 'run.grow') "
                                "ORDER BY id"))  # the last of each
    asked = db_rows(state, "SELECT ts FROM events WHERE message LIKE '%growth job%' ORDER BY id")[0][0]
    first = db_rows(state, "SELECT min(received_at) FROM metrics WHERE attempt = 3")[0][0]
    print(json.dumps({"growth_asked_to_node_held_s": round(times["nodes.allocated"] - asked, 2),
                      "grow_to_first_grown_step_s": round(first - times["run.grow"], 2) if first else None}))
    # Both jobs given back; nothing of the run is left running.
    wait_for(lambda: parse.parse_squeue_text(
        slurm(slurm_box, "squeue", "-h", "-o", parse.SQUEUE_FORMAT)) == {}, 30, "both jobs to end")
    assert trainer_processes(state) == []


def test_an_allocation_ended_by_slurm_is_replaced_and_the_run_resumes(
        slurm_box: Box, fault_free: dict[str, Any], tmp_path: Path) -> None:
    """Preemption, a time limit, or an operator's scancel: the allocation is gone. While
    Slurm still knows the job, the supervisor requeues it (its id kept, as the users'
    trainers that key their checkpoints on $SLURM_JOB_ID need) and resumes from the newest
    checkpoint."""
    state = tmp_path / "state"
    cancelled: list[str] = []

    def scancel_at_step_45() -> None:
        wait_for(lambda: int((db_rows_soon(state, "SELECT coalesce(max(step), 0) FROM metrics")
                              or [(0,)])[0][0]) >= 45, 180, "step 45")
        [job] = parse.parse_squeue_text(slurm(slurm_box, "squeue", "-h", "-o", parse.SQUEUE_FORMAT))
        slurm(slurm_box, "scancel", job)
        cancelled.append(job)

    s, _ = run_acting_meanwhile(slurm_box, tmp_path, ["run", str(EXAMPLE), "--launcher", "slurm", "--state-dir",
                                                      str(state), "--json"], scancel_at_step_45)
    [job] = cancelled
    assert s["state"] == "SUCCEEDED" and s["model_digest"] == fault_free["model_digest"]
    # From the newest checkpoint the first attempt committed: step 40 as a rule, 60 where a
    # loaded host let it train past step 60 before the scancel landed (seen in `make chaos`).
    [(newest,)] = db_rows(state, "SELECT max(step) FROM checkpoints WHERE attempt = 1 AND complete")
    assert s["attempts"] == 2 and newest >= 40 and s["attempt_history"][1]["resume_step"] == newest, (newest, s)
    infos = [json.loads(i) for (i,) in db_rows(state, "SELECT launch_info FROM attempts ORDER BY number")]
    assert infos[0]["job"] == job and infos[1]["job"] == job, "the same job for the second attempt"
    again = parse.parse_key_values(slurm(slurm_box, "scontrol", "-o", "show", "job", job))
    assert again["Restarts"] == "1", "requeued once"
    released = db_rows(state, "SELECT message FROM events WHERE kind = 'nodes.released'")
    assert released, "the supervisor noticed the allocation was gone"
    assert s["drained_nodes"] == [], "an ended allocation is no node's fault"


def test_sigkill_of_the_daemon_readopts_the_slurm_job_and_step(
        slurm_box: Box, fault_free: dict[str, Any], tmp_path: Path) -> None:
    state = tmp_path / "state"
    port = free_port()
    daemon = slurm_serve(state, port, slurm_box)
    seen_steps: list[set[str]] = []
    seen_agents: list[set[str]] = []  # the node agents' step (node/agent.py), beside the trainer's
    seen_jobs: list[set[str]] = []

    def look() -> None:
        steps = parse.parse_steps_text(slurm(slurm_box, "squeue", "--steps", "-h", "-o", parse.STEPS_FORMAT))
        numbered = [s for s in steps if s.step_id.isdigit()]
        seen_steps.append({f"{s.job_id}.{s.step_id}" for s in numbered if not s.name.endswith(AGENT_SUFFIX)})
        seen_agents.append({f"{s.job_id}.{s.step_id}" for s in numbered if s.name.endswith(AGENT_SUFFIX)})
        seen_jobs.append(set(parse.parse_squeue_text(
            slurm(slurm_box, "squeue", "-h", "-o", parse.SQUEUE_FORMAT))))

    try:
        run_id = daemon.ctl_json("submit", str(spec_for_slurm(tmp_path)))["run_id"]
        wait_for(lambda: (look(), (daemon.read("status", run_id)["step"] or 0) >= 30)[1], 180, "step 30")
        trainers = trainer_processes(state)
        assert len(trainers) == 4
        assert daemon.kill(signal.SIGKILL) == -signal.SIGKILL
        time.sleep(1)
        assert all(p.is_running() for p in trainers), "the step outlives the daemon"
        look()

        daemon = slurm_serve(state, port, slurm_box)
        final = wait_for(
            lambda: (look(), (d := daemon.read("status", run_id))["state"] == "SUCCEEDED" and d)[1],
            240, "the run to succeed under the restarted daemon")
    finally:
        daemon.kill(signal.SIGTERM)
        for p in trainer_processes(state):
            p.kill()
    assert final["attempts"] == 1 and final["faults"] == [], "the step was adopted, not relaunched"
    assert final["model_digest"] == fault_free["model_digest"]
    assert max(len(s) for s in seen_steps) == 1, f"never two trainer steps at once: {seen_steps}"
    assert max(len(s) for s in seen_agents) == 1, f"the node agents' step adopted too, not doubled: {seen_agents}"
    assert max(len(j) for j in seen_jobs) == 1, f"never a second allocation: {seen_jobs}"
    assert db_rows(state, "SELECT count(*) FROM attempts")[0][0] == 1
    starts = db_rows(state, "SELECT message FROM events WHERE kind = 'daemon.started' ORDER BY id")
    assert len(starts) == 2 and f"{run_id}#1" in starts[1][0]
    # What the first daemon recorded survived its SIGKILL. (The steps trained while no
    # daemon ran are not in metrics: the broker keeps no session for a subscriber that is
    # gone, and on a busy host the trainer may finish before the second daemon is up.)
    recorded = {step for (step,) in db_rows(state, "SELECT DISTINCT step FROM metrics")}
    assert set(range(1, 21)) <= recorded, sorted(recorded)


def test_a_slurmctld_crash_and_restart_mid_run_costs_no_restart(
        slurm_box: Box, fault_free: dict[str, Any], tmp_path: Path, state: Path) -> None:
    """slurmctld is SIGKILLed at step 40 and started again 15 s later from its saved
    state. The job step trains on meanwhile (slurmstepd does not need the controller)
    and finishes while the controller is still down; squeue fails for those seconds
    (or, with --json, answers "no jobs" and an error), which is no evidence against the
    run: one attempt, no fault, no drain, the fault-free model. Giving the allocation
    back has to wait for the controller, and must not be forgotten meanwhile."""
    daemon = slurm_serve(state, free_port(), slurm_box)
    try:
        run_id = daemon.ctl_json("submit", str(spec_for_slurm(tmp_path)))["run_id"]
        wait_for(lambda: (daemon.read("status", run_id)["step"] or 0) >= 40, 180, "step 40")
        os.kill(slurm_box.ctld_pid, signal.SIGKILL)
        down_at = time.time()
        time.sleep(15)
        slurm_box_mod.start_ctld(slurm_box)
        final = wait_for(lambda: (d := daemon.read("status", run_id))["state"] in ("SUCCEEDED", "FAILED")
                         and d, 240, "the run to end")
        wait_for(lambda: parse.parse_squeue_text(
            slurm(slurm_box, "squeue", "-h", "-o", parse.SQUEUE_FORMAT)) == {}, 60, "the allocation to end")
    finally:
        daemon.kill(signal.SIGTERM)
    assert final["state"] == "SUCCEEDED", final
    assert (final["attempts"], final["faults"], final["drained_nodes"]) == (1, [], []), final
    assert final["model_digest"] == fault_free["model_digest"]
    late = db_rows(state, f"SELECT max(step) FROM metrics WHERE received_at > {down_at}")[0][0]
    assert late == 80, "training went on while the controller was down"
    assert db_rows(state, "SELECT allocation_info FROM runs")[0][0] is None


def test_a_hung_slurmctld_for_60_s_stalls_neither_api_nor_telemetry_nor_watchdog_and_drains_nothing(
        slurm_box: Box, tmp_path: Path, state: Path) -> None:
    """slurmctld SIGSTOPped for 60 s: every Slurm command hangs until its timeout. Slurm
    is polled off the reconciler's path and the tick off the event loop, so the API keeps
    answering, telemetry keeps flowing, the watchdog keeps being fed; and while Slurm does
    not answer nothing that needs it is decided: no fault, no drain. Once it answers again
    the run carries on. Sized by steps after the outage, not by wall time: a long run,
    cancelled once it made 100 steps after slurmctld came back."""
    systemd = FakeSystemd(tmp_path / "notify")
    port = free_port()
    daemon = Serve(state, port, "--launcher", "slurm", extra_env={
        "SLURM_CONF": str(slurm_box.conf), "NOTIFY_SOCKET": str(systemd.path), "WATCHDOG_USEC": "4000000"})
    spec = tmp_path / "long.toml"
    spec.write_text(spec_for_slurm(tmp_path).read_text().replace("steps = 80", "steps = 100000"))
    token = daemon.token_file.read_text().strip()
    latencies: list[float] = []
    try:
        run_id = daemon.ctl_json("submit", str(spec))["run_id"]
        wait_for(lambda: (daemon.read("status", run_id)["step"] or 0) >= 30, 180, "step 30")
        api = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        os.kill(slurm_box.ctld_pid, signal.SIGSTOP)
        stopped_at = time.time()
        try:
            while time.time() < stopped_at + 60:
                began = time.perf_counter()
                api.request("GET", f"/v1/runs/{run_id}", headers={"Authorization": f"Bearer {token}"})
                answer = api.getresponse()
                body = json.loads(answer.read())
                latencies.append(time.perf_counter() - began)
                assert answer.status == 200 and body["state"] == "RUNNING", body
                time.sleep(0.25)
        finally:
            os.kill(slurm_box.ctld_pid, signal.SIGCONT)
        resumed_at = time.time()
        during = db_rows(state, f"SELECT count(*) FROM metrics WHERE received_at BETWEEN {stopped_at} AND "
                                f"{resumed_at}")[0][0]
        step_then = daemon.ctl_json("status", run_id)["step"]
        wait_for(lambda: daemon.read("status", run_id)["step"] >= step_then + 100, 180,
                 "100 steps after slurmctld answers again")
        status = daemon.ctl_json("status", run_id)
        assert daemon.ctl("cancel", run_id).returncode == 0
        wait_for(lambda: daemon.read("status", run_id)["attempt_state"] == "ENDED", 120, "the cancel")
    finally:
        daemon.kill(signal.SIGTERM)
        systemd.close()
        for p in trainer_processes(state):
            p.kill()
    # The numbers for the note (the latency goal is a benchmark's: docs/RESULTS.md).
    ordered = sorted(latencies)
    print(json.dumps({"api_requests": len(ordered), "api_p50_ms": round(ordered[len(ordered) // 2] * 1000, 1),
                      "api_max_ms": round(ordered[-1] * 1000, 1), "steps_during_stop": during}))
    assert ordered[-1] < 5.0, "the API never waited for Slurm's 10 s timeouts"
    assert during >= 100, "telemetry flowed while slurmctld was stopped"
    fed = [t for t, m in systemd.stamped if m == b"WATCHDOG=1" and stopped_at <= t <= resumed_at]
    gaps = [b - a for a, b in zip([stopped_at, *fed], [*fed, resumed_at], strict=True)]
    assert max(gaps) < 4.0, f"the watchdog went hungry: {max(gaps):.1f} s without WATCHDOG=1"
    assert (status["attempts"], status["faults"], status["drained_nodes"]) == (1, [], []), status
    slurm_nodes = parse.parse_nodes(slurm(slurm_box, "scontrol", "-o", "show", "node"))
    assert not any("DRAIN" in n.flags for n in slurm_nodes.values()), "nothing drained in Slurm either"


def succeeds_on_the_box(box: Box, state: Path, fault_free: dict[str, Any], chaos: str,
                        monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """The example on ``box`` with one chaos action: it succeeds with the fault-free model."""
    monkeypatch.setenv("SLURM_CONF", str(box.conf))
    proc = tsup("run", EXAMPLE, "--launcher", "slurm", "--state-dir", state, "--json", "--chaos", chaos)
    s = summary_of(proc)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert s["state"] == "SUCCEEDED" and s["model_digest"] == fault_free["model_digest"]
    return s



def test_a_node_killed_while_the_next_node_holds_its_replica_resumes_from_memory_on_the_box(
        slurm_box: Box, fault_free: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The memory tier on the box, whose nodes each have a /dev/shm of their own: kill-node@47
    takes node2 and its memory with it (everything it ran is killed, its tmpfs gone). node1
    holds the replicas of node2's ranks, so attempt 2 on node1 and the spare node3 resumes
    from memory (node3's ranks get their state from node1 over the box's network), not from
    the persistent checkpoint of step 40. Same model."""
    monkeypatch.setenv("SLURM_CONF", str(slurm_box.conf))
    spec = spec_for_slurm(tmp_path)
    spec.write_text(spec.read_text().replace("keep = 3", "keep = 3\nmemory_every_steps = 5\nasynchronous = true"))
    state = tmp_path / "state"
    proc = tsup("run", spec, "--state-dir", state, "--json", "--chaos", "kill-node@47")
    s = summary_of(proc)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert s["state"] == "SUCCEEDED" and s["model_digest"] == fault_free["model_digest"]
    assert [(f["kind"], f["nodes"]) for f in s["faults"]] == [("node-lost", ["node2"])], what_happened(
        s, state / "runs" / "run-1")
    first, second = s["attempt_history"]
    assert second["nodes"] == ["node1", "node3"]
    assert second["resume_from"] in ("memory:1:45", "memory:1:50"), second
    log = (state / "runs" / "run-1" / "attempts" / "2" / "rank-0.log").read_text()
    assert f"resumed from memory:1:{second['resume_step']} at step {second['resume_step']} in " in log
    # node3's two ranks: their state was on no node of attempt 2 but node1, their replica's.
    assert "save in node memory, 2 rank(s)' state sent over from the node holding its replica" in log, log[-2000:]
    times = {f["kind"]: (round(f["detected_at"] - f["injected_at"], 2), round(f["recovered_at"] - f["injected_at"], 2))
             for f in s["faults"]}
    print(json.dumps({"detect_and_recover_s": times, "resume_from": second["resume_from"]}))


def test_warm_standbys_on_the_box_become_the_next_attempts_ranks_after_kill_rank_and_kill_node(
        slurm_box: Box, fault_free: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """[resources] standby on Slurm: after each attempt starts, a generation of standbys
    (one srun step, a task per rank slot on node1, node2 and the spare node3, torch
    imported) waits; kill-rank@30 and kill-node@75 are each recovered by the waiting
    generation's tasks on the attempt's nodes becoming its ranks, handed their
    assignments in one line (srun --input=all). The killed node's standbys go with it;
    those of a node the attempt does not use leave. Same model; none outlives the run."""
    monkeypatch.setenv("SLURM_CONF", str(slurm_box.conf))
    spec = spec_for_slurm(tmp_path, standby=True)
    state = tmp_path / "state"
    proc = tsup("run", spec, "--state-dir", state, "--json", "--chaos", "kill-rank@30", "--chaos", "kill-node@75")
    s = summary_of(proc)
    assert proc.returncode == 0, proc.stderr[-3000:]
    run_dir = state / "runs" / "run-1"
    assert s["state"] == "SUCCEEDED" and s["model_digest"] == fault_free["model_digest"], what_happened(s, run_dir)
    assert [(f["kind"], f["nodes"]) for f in s["faults"]] == [("rank-exit", ["node2"]), ("node-lost", ["node2"])], \
        what_happened(s, run_dir)
    assert [a["nodes"] for a in s["attempt_history"]] == [["node1", "node2"], ["node1", "node2"], ["node1", "node3"]]
    infos = [json.loads(i) for (i,) in db_rows(state, "SELECT launch_info FROM attempts ORDER BY number")]
    assert "warm" not in infos[0], "the first attempt starts cold: nothing was waiting yet"
    assert infos[1]["warm"] and infos[2]["warm"], infos
    assert infos[1]["step"] != infos[2]["step"], "a used generation is not used again"
    assert len({i["job"] for i in infos}) == 1, "every attempt a step of the one allocation"
    became: dict[int, set[str]] = {}
    for n in (2, 3):
        for log in sorted((run_dir / "attempts" / str(n)).glob("rank-*.log")):
            first = (log.read_text().splitlines() or [""])[0]
            m = re.match(r"standby: pid (\d+) is rank (\d+) of attempt (\d+)", first)
            assert m and (m[2], m[3]) == (log.stem.removeprefix("rank-"), str(n)), (log, first)
            became.setdefault(n, set()).add(m[1])
    assert len(became[2]) == 4 and len(became[3]) == 4, became
    assert trainer_processes(state) == [], "no standby outlives its run"
    times = {f["kind"]: (round(f["detected_at"] - f["injected_at"], 2), round(f["recovered_at"] - f["injected_at"], 2))
             for f in s["faults"]}
    print(json.dumps({"detect_and_recover_s": times}))


def test_a_node_cut_off_from_the_network_is_found_by_silence_drained_and_replaced(
        slurm_box: Box, fault_free: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        watch: Watch) -> None:
    """node2's link goes down for 20 s at step 40: its processes live on, cut off. The
    other node is heard, so node2's silence is its own: drained, resumed on the spare."""
    state = tmp_path / "state"
    # node2's attempt-1 ranks live on out of reach while attempt 2 trains (until the link
    # is back and Slurm can end them): no duplicate, nothing can stop them.
    watch.cut_off.add("node2")
    s = succeeds_on_the_box(slurm_box, state, fault_free, "partition-node@40/20", monkeypatch)
    [fault] = s["faults"]
    assert fault["kind"] == "node-lost" and fault["nodes"] == ["node2"] and "silent" in fault["summary"]
    assert s["drained_nodes"] == ["node2"]
    assert [a["nodes"] for a in s["attempt_history"]] == [["node1", "node2"], ["node1", "node3"]]
    healed = db_rows(state, "SELECT message FROM events WHERE kind = 'chaos.healed'")
    assert len(healed) == 1 and "node2's link up again" in healed[0][0]


def test_a_link_slowed_mid_run_slows_the_run_which_is_stopped_at_its_checkpoint_and_the_node_probed_out(
        slurm_box: Box, fault_free: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """node2's link at 4 Mbit/s from step 20 on: nothing fails, every step waits for it.
    Rank 0's step time rises over twice its first steps' (policy/slowdown.py); after the
    checkpoint of step 40 the attempt is stopped, the diagnosis's link test names node2,
    which is drained, and the run resumes from step 40 on node1 and the spare."""
    monkeypatch.setenv("SLURM_CONF", str(slurm_box.conf))
    spec = spec_for_slurm(tmp_path)
    spec.write_text(spec.read_text() + "\n[health]\ndiagnose = true\n")
    state = tmp_path / "state"
    proc = tsup("run", spec, "--state-dir", state, "--json", "--chaos", "slow-link@20")
    s = summary_of(proc)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert s["state"] == "SUCCEEDED" and s["model_digest"] == fault_free["model_digest"]
    [fault] = s["faults"]
    assert fault["kind"] == "slowdown" and fault["step"] == 40, what_happened(s, state / "runs" / "run-1")
    assert "the whole run slowed" in fault["summary"]
    assert s["drained_nodes"] == ["node2"]
    first, second = s["attempt_history"]
    assert (first["nodes"], second["nodes"], second["resume_step"]) == (["node1", "node2"], ["node1", "node3"], 40)
    node2 = parse.parse_nodes(slurm(slurm_box, "scontrol", "-o", "show", "node", "node2"))["node2"]
    assert node2.reason.startswith("training-supervisor: probe: links: best pair node"), node2.reason
    assert "(run-1, diagnosis)" in node2.reason
    probes = db_rows(state, "SELECT node, kind, status FROM probes ORDER BY id")
    assert probes.count(("node2", "diagnosis", "unhealthy")) == 2, probes
    assert ("node1", "diagnosis", "healthy") in probes, probes


def test_every_node_cut_off_briefly_is_the_network_nothing_is_drained_and_training_continues(
        slurm_box: Box, fault_free: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every node of the attempt cut off for 8 s at step 40 (longer than the hang floor,
    shorter than Slurm's own SlurmdTimeout on the box): no rank is heard, which says
    nothing of the nodes. Nothing is drained, no hang is judged, and training continues
    in the same attempt once the links are back."""
    state = tmp_path / "state"
    s = succeeds_on_the_box(slurm_box, state, fault_free, "partition-all@40/8", monkeypatch)
    assert s["faults"] == [] and s["attempts"] == 1 and s["drained_nodes"] == []
    injected = db_rows(state, "SELECT message FROM events WHERE kind = 'chaos.injected'")
    assert len(injected) == 1 and "node1's link down" in injected[0][0] and "node2's link down" in injected[0][0]


TRAIN_SH = REPO / "tests" / "standins" / "train.sh"


def run_acting_meanwhile(box: Box, tmp_path: Path, args: list[str],
                         act: Callable[[], None]) -> tuple[dict[str, Any], str]:
    """``training-supervisor ARGS`` on ``box`` in the background, ``act()`` while it runs;
    once it exited 0, its summary (the JSON document on its stdout; the daemon's log lines
    go on after it on stderr, merged here, as it stops) and its whole output."""
    out = open(tmp_path / "run.out", "w+")  # noqa: SIM115
    proc = subprocess.Popen([sys.executable, "-m", "slurmbox.tsup", *args], stdout=out, stderr=subprocess.STDOUT,
                            env={**env(), "SLURM_CONF": str(box.conf)}, cwd=REPO)
    try:
        act()
        assert proc.wait(300) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    out.seek(0)
    text = out.read()
    summary, _ = json.JSONDecoder().raw_decode(text, text.index("{\n"))
    return summary, text


def db_rows_soon(state: Path, sql: str) -> list[tuple[Any, ...]]:
    """``db_rows``, or none while the run's database is not made yet."""
    try:
        return db_rows(state, sql)
    except sqlite3.Error:
        return []


def what_happened(s: dict[str, Any], run_dir: Path) -> str:
    """A wrong count of faults, explained: each fault, then the last lines of each
    attempt's logs (srun's, the nodes', the agents'), for the box's directory may not
    outlive the run that failed."""
    lines = [f"{f['kind']} {f['nodes']} (attempt {f['attempt']}): {f['summary']}" for f in s["faults"]]
    for attempt in sorted((run_dir / "attempts").iterdir(), key=lambda p: (len(p.name), p.name)):
        for log in sorted(attempt.glob("*.log")):
            said = [line for line in log.read_text(errors="replace").splitlines() if not line.startswith("[W")]
            lines += [f"--- attempt {attempt.name}: {log.name}", *said[-8:]]
    return "\n".join(lines)


def train_sh_spec(tmp_path: Path) -> Path:
    """`srun ./train.sh` of the FSDP test case's stand-in: 2 nodes of 2 ranks and a spare."""
    argv = [str(TRAIN_SH), str(FSDP_TEST_CASE), *FSDP_TRAIN, "--checkpoint_dir={checkpoint_dir}",
            "--out={run_dir}/final.pt", "--fault_dir={run_dir}"]
    return command_spec(tmp_path / "train-sh.toml", "train-sh", argv, launch="node",
                        resources={"launcher": "slurm", "nodes": 2, "ranks_per_node": 2, "spares": 1},
                        policy={"hang_floor_s": 10, "hang_timeout_s": 120},
                        resume=["--resume_from_checkpoint={checkpoint_dir}"], checkpoint_layout="dcp",
                        steps=FSDP_STEPS, env={"TORCHRUN": str(Path(sys.executable).parent / "torchrun"),
                                               "PROCESSES_PER_NODE": "{nproc_per_node}",
                                               "GLOO_SOCKET_IFNAME": "eth0"})


def test_a_train_sh_job_recovers_from_a_killed_rank_its_first_nodes_loss_and_a_hung_rank(
        slurm_box: Box, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fsdp_never_failed: dict[str, Any]) -> None:
    """`srun ./train.sh`, one task per node: torchrun with --nnodes $SLURM_NTASKS --node_rank
    $SLURM_NODEID and the master the first host of `scontrol show hostnames
    $SLURM_JOB_NODELIST`, training the FSDP test case's stand-in. Rank 3 (a worker under
    node2's torchrun) is SIGKILLed at step 12; the allocation's first node dies at step 25,
    and the next step's master is a live node of that step; a rank is stopped at step 45
    (a hang, read from the output). The weights end as those of a run that never failed.

    A chaos scenario (`make chaos`; drawn into `make test` by the rotating seed): the blame
    for the first node's loss depends on timing and is not yet stable (its own issue)."""
    monkeypatch.setenv("SLURM_CONF", str(slurm_box.conf))
    spec = train_sh_spec(tmp_path)
    state = tmp_path / "state"
    proc = tsup("run", spec, "--state-dir", state, "--json", "--chaos", "kill-rank@12:3", "--chaos",
                "kill-node@25:0", "--chaos", "hang-rank@45:1", timeout_s=520)
    s = summary_of(proc)
    assert s["state"] == "SUCCEEDED", s
    run_dir = state / "runs" / "run-1"
    assert len(s["faults"]) == 3, what_happened(s, run_dir)
    killed, lost, hung = s["faults"]
    assert killed["kind"] == "rank-exit" and 3 in killed["ranks"], killed
    assert (lost["kind"], lost["nodes"]) == ("node-lost", ["node1"]), lost
    assert any(said in lost["summary"] for said in POWER_LOST_SAID), lost["summary"]  # a power loss: no last will
    assert hung["kind"] == "hang" and "adaptive hang timeout" in hung["summary"], hung
    assert s["drained_nodes"] == ["node1"]
    history = s["attempt_history"]
    assert [a["nodes"] for a in history] == [["node1", "node2"], ["node1", "node2"], ["node2", "node3"],
                                             ["node2", "node3"]]
    # The hang lands at the first step the injector sees at or past 45: on a busy host a
    # save or two later. The last attempt resumes from the newest save before it.
    *first, last = [a["resume_step"] for a in history]
    assert first == [0, 10, 20] and 40 <= last <= hung["step"] and last % 10 == 0, (history, hung)
    for attempt, nodes in enumerate((a["nodes"] for a in history), start=1):
        said = [line for task in (0, 1) for line in
                (run_dir / "attempts" / str(attempt) / f"node-{task}.log").read_text().splitlines()
                if line.startswith("train.sh on ")]
        assert len(said) == 2 and all(f"of 2, master {nodes[0]} (" in line for line in said), said
    assert_same_weights(run_dir / "final.pt", fsdp_never_failed)
    times = {f["kind"]: (round(f["detected_at"] - f["injected_at"], 2), round(f["recovered_at"] - f["injected_at"], 2))
             for f in s["faults"]}
    print(json.dumps({"detect_and_recover_s": times}))


def test_a_train_sh_node_cut_off_is_found_by_its_agents_silence_with_slurm_none_the_wiser(
        slurm_box: Box, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fsdp_never_failed: dict[str, Any],
        watch: Watch) -> None:
    """The train.sh job sends no telemetry of its own. node2's link goes down for 30 s at
    step 25, with Slurm's SlurmdTimeout at its default 300 s: Slurm says nothing of node2
    for minutes, its processes live on, cut off. Its node agent's silence past
    silence_timeout_s (10 s) finds it while the link is still down: drained, resumed on the
    spare, the same weights."""
    monkeypatch.setenv("SLURM_CONF", str(slurm_box.conf))
    slurm_box_mod.set_slurmd_timeout(slurm_box, 300)
    state = tmp_path / "state"
    # node2's attempt-1 processes live on, out of reach, while attempt 2 trains; the run
    # ends before the link is back, and the scenario's end kills them.
    watch.cut_off.add("node2")
    proc = tsup("run", train_sh_spec(tmp_path), "--state-dir", state, "--json", "--chaos", "partition-node@25/30",
                timeout_s=520)
    s = summary_of(proc)
    assert s["state"] == "SUCCEEDED", s
    assert len(s["faults"]) == 1, what_happened(s, state / "runs" / "run-1")
    [fault] = s["faults"]
    assert (fault["kind"], fault["nodes"]) == ("node-lost", ["node2"]), fault
    assert "its agent and every rank" in fault["summary"], fault["summary"]
    # Found while the link was still down (Slurm would have taken 300 s); how soon is the
    # figure printed below, not an assertion.
    assert fault["detected_at"] - fault["injected_at"] < 30, fault
    assert s["drained_nodes"] == ["node2"]
    assert [a["nodes"] for a in s["attempt_history"]] == [["node1", "node2"], ["node1", "node3"]]
    assert_same_weights(state / "runs" / "run-1" / "final.pt", fsdp_never_failed)
    print(json.dumps({"detected_s": round(fault["detected_at"] - fault["injected_at"], 2)}))

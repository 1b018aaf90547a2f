"""The Slurm findings' exploits on a real cluster (three slurmd posing as nodes, each a
host of its own; tests/conftest.py's slurm_box). The same findings without Slurm are in
tests/unit/test_slurm_security.py.

- A trainer's words in a drain Reason rewrote the daemon's node table: the next step's
  MASTER_ADDR came from it, and the drained node vanished from it.
- Another user's job named like a run's allocation was adopted as the run's, and the
  run's end scancelled it; another user's step named like an attempt's could be
  scancelled in its place.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from slurmbox.box import Box
from supervisor.slurm import parse
from supervisor.slurm.launcher import prefix_for
from supervisor.users import RunAs
from tests.conftest import wait_for
from tests.e2e.conftest import command_spec, db_rows, slurm, summary_of, tsup
from tests.e2e.test_least_privilege import remove_user, system_user

pytestmark = pytest.mark.e2e

# The line the finding quotes: a CUDA ECC failure as far as the supervisor's output
# reader can tell (supervisor/gathering/output_progress.py), so it drains the node that printed it
# with the line in its Reason; the rest is the attacker's.
ATTACK = "uncorrectable ECC error encountered NodeName=node1 NodeAddr=10.6.6.6 State=IDLE"


def test_a_drain_reason_carrying_node_fields_reads_back_as_the_nodes_slurm_has(
        slurm_box: Box, tmp_path: Path) -> None:
    """node3 drained through the daemon's own path with the attacker's words (and a
    second line of them): its node listing still shows every node at its address and in
    its state, node3 drained, with the words in its Reason as one line."""
    from supervisor.slurm.cluster import slurm_cluster

    adapters = slurm_cluster(slurm_conf=str(slurm_box.conf), state_dir=tmp_path / "state", poll_interval_s=0.0)
    adapters.nodes.drain("node3", f"training-supervisor: device: rank 1 printed: {ATTACK}\nNodeName=node2 State=DOWN")

    nodes = adapters.state.nodes()
    assert nodes is not None
    assert {n.name: n.addr for n in nodes.values()} == {n: slurm_box.addr(n) for n in ("node1", "node2", "node3")}
    assert nodes["node1"].state == "IDLE" and nodes["node2"].state == "IDLE"
    assert adapters.nodes.drained("node3") is True, "the drain is seen, so it is confirmed"
    shown = ATTACK.replace("=", ":")  # a Reason goes to Slurm without "=" (slurm_reason)
    assert nodes["node3"].reason == (f"training-supervisor: device: rank 1 printed: {shown} "
                                     "NodeName:node2 State:DOWN")
    # The text form of the same table, as read where no JSON form answers.
    text = parse.parse_nodes(slurm(slurm_box, "scontrol", "-o", "show", "node"))
    assert text == nodes

    # An operator's two-line Reason, set by hand: its second line comes after Slurm's stamp.
    slurm(slurm_box, "scontrol", "update", "NodeName=node2", "State=DRAIN", f"Reason=fan\n{ATTACK}")
    adapters.state.refresh()
    nodes = adapters.state.nodes()
    assert nodes is not None and nodes["node2"].reason == f"fan\n{ATTACK}" and nodes["node1"].state == "IDLE"
    text = parse.parse_nodes(slurm(slurm_box, "scontrol", "-o", "show", "node"))
    assert [(n.name, n.addr, n.state) for n in text.values()] == [(n.name, n.addr, n.state) for n in nodes.values()]


# Attempt 1: rank 1 prints the attacker's line and exits 1; rank 0 waits to be stopped.
# Attempt 2: each rank notes the MASTER_ADDR it was given and exits 0.
ECC_TRAINER = """echo "$TSUP_ATTEMPT $RANK $TSUP_NODE $MASTER_ADDR" >> "$1/seen"
if [ "$TSUP_ATTEMPT" = 1 ]; then
  if [ "$RANK" = 1 ]; then echo "$2"; exit 1; fi
  exec sleep 300
fi
"""


def test_a_trainers_ecc_line_naming_node1_neither_moves_the_next_masters_address_nor_hides_the_drain(
        slurm_box: Box, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The finding's exploit end to end: a [command] on node1 and node2 whose rank on node2
    prints the line. node2 is drained with it, the drain is confirmed, and the next
    attempt's master is node1 at its real address, not 10.6.6.6."""
    monkeypatch.setenv("SLURM_CONF", str(slurm_box.conf))
    spec = command_spec(tmp_path / "ecc.toml", "ecc-words", ["sh", "-c", ECC_TRAINER, "ecc", "{run_dir}", ATTACK],
                        resources={"launcher": "slurm", "nodes": 2, "ranks_per_node": 1, "spares": 1},
                        policy={"backoff_base_s": 0.5, "stop_grace_s": 2})
    state = tmp_path / "state"
    proc = tsup("run", spec, "--state-dir", state, "--json", timeout_s=300)
    s = summary_of(proc)
    assert s["state"] == "SUCCEEDED", (s, proc.stderr[-3000:])
    first, second = (a["nodes"] for a in s["attempt_history"])
    assert first == ["node1", "node2"], "rank 1 ran on node2"
    assert s["drained_nodes"] == ["node2"] and second == ["node1", "node3"]
    seen = [line.split() for line in (state / "runs" / "run-1" / "seen").read_text().splitlines()]
    masters = {addr for attempt, _, _, addr in seen if attempt == "2"}
    assert masters == {slurm_box.addr("node1")}, f"attempt 2 was told MASTER_ADDR {masters}"
    node2 = parse.parse_nodes(slurm(slurm_box, "scontrol", "-o", "show", "node", "node2"))["node2"]
    assert "DRAIN" in node2.flags and ATTACK.replace("=", ":") in node2.reason and "\n" not in node2.reason
    node1 = parse.parse_nodes(slurm(slurm_box, "scontrol", "-o", "show", "node", "node1"))["node1"]
    assert node1.addr == slurm_box.addr("node1") and node1.usable


# --- another user's job and step, named like the run's -------------------------------


@pytest.fixture
def mallory(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunAs]:
    """Another real user of this host, who may submit jobs to the box."""
    home = tmp_path_factory.mktemp("home")
    home.chmod(0o755)
    user = system_user("tsup-mallory", home)
    try:
        yield user
    finally:
        remove_user(user)


def as_user(user: RunAs, box: Box, *argv: str) -> subprocess.Popen[str]:
    return subprocess.Popen(list(argv), env={**box.env, "HOME": user.home, "USER": user.name}, cwd="/",
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, user=user.uid,
                            group=user.gid, extra_groups=list(user.groups))


# Attempt 1: rank 1 exits 3 at once and rank 0 waits, so the attempt is stopped (its step
# scancelled); attempt 2: both ranks exit 0.
STOPPED_ONCE = """if [ "$TSUP_ATTEMPT" = 1 ]; then
  if [ "$RANK" = 1 ]; then exit 3; fi
  exec sleep 300
fi
"""


def test_another_users_job_and_step_named_like_the_runs_are_neither_adopted_nor_cancelled(
        slurm_box: Box, mallory: RunAs, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """mallory submits, before the run, a job named as the run's first allocation will be
    (``<prefix>.run-1.1``: the prefix is derived from the state directory) and starts in
    it a step named as the run's first attempt (``<prefix>.run-1.a1``). The daemon (root)
    submits its own allocation, stops its own attempt 1, gives its own allocation back,
    and leaves mallory's job, step and srun as they were."""
    monkeypatch.setenv("SLURM_CONF", str(slurm_box.conf))
    state = tmp_path / "state"
    prefix = prefix_for(state)
    submitted = as_user(mallory, slurm_box, "sbatch", "--parsable", f"--job-name={prefix}.run-1.1", "--nodes=1",
                        "--output=/dev/null", "--wrap", "sleep 600")
    out, err = submitted.communicate(timeout=30)
    assert submitted.returncode == 0, err
    squat = parse.parse_sbatch_job_id(out)
    wait_for(lambda: "RUNNING" in slurm(slurm_box, "squeue", "-h", "-j", squat, "-o", "%T"), 30, "mallory's job")
    srun = as_user(mallory, slurm_box, "srun", f"--jobid={squat}", "--overlap", f"--job-name={prefix}.run-1.a1",
                   "sleep", "600")
    try:
        wait_for(lambda: f"{prefix}.run-1.a1" in slurm(slurm_box, "squeue", "--steps", "-h", "-o", "%j"), 30,
                 "mallory's step")
        spec = command_spec(tmp_path / "stopped.toml", "stopped-once", ["sh", "-c", STOPPED_ONCE],
                            resources={"launcher": "slurm", "nodes": 1, "ranks_per_node": 2},
                            policy={"backoff_base_s": 0.5, "stop_grace_s": 2})
        proc = tsup("run", spec, "--state-dir", state, "--json", timeout_s=240)
        s = summary_of(proc)
        jobs = {json.loads(i)["job"] for (i,) in db_rows(state, "SELECT launch_info FROM attempts")}
        assert squat not in jobs, "the run trained in mallory's job"
        assert s["state"] == "SUCCEEDED" and s["attempts"] == 2, (s, proc.stderr[-3000:])

        listed = parse.parse_squeue_text(slurm(slurm_box, "squeue", "-h", "-o", parse.SQUEUE_OWNED_FORMAT),
                                         owners=True)
        assert list(listed) == [squat], "the run gave its own allocation back, and only that"
        assert listed[squat].state == "RUNNING" and listed[squat].user_id == mallory.uid
        steps = parse.parse_steps_text(slurm(slurm_box, "squeue", "--steps", "-h", "-o", parse.STEPS_OWNED_FORMAT),
                                       owners=True)
        assert [(st.job_id, st.name) for st in steps if st.step_id == "0"] == [(squat, f"{prefix}.run-1.a1")]
        assert srun.poll() is None and psutil.Process(srun.pid).uids().real == mallory.uid
    finally:
        srun.kill()
        srun.wait()

"""The supervisor on a real Slurm cluster (three slurmd posing as nodes on this host):
what it refuses at submit, and how it probes and drains nodes. The faults a run
survives on Slurm are in tests/chaos/test_slurm.py."""

from __future__ import annotations

import json
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil
import pytest

from slurmbox.box import Box
from supervisor.slurm import parse
from supervisor.slurm.nodes import slurm_reason
from tests.conftest import REPO, free_port, wait_for
from tests.e2e.conftest import (
    Serve,
    command_spec,
    db_rows,
    slurm,
    slurm_serve,
    spec_for_slurm,
    summary_of,
    tsup,
)
from tests.fake_tools.replay import make_tools

pytestmark = pytest.mark.e2e


def test_specs_the_cluster_cannot_serve_are_refused_at_submit(
        slurm_box: Box, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SLURM_CONF", str(slurm_box.conf))
    bad_partition = tsup("run", spec_for_slurm(tmp_path, partition="gpu-h100"), "--state-dir", tmp_path / "s1")
    assert bad_partition.returncode == 2
    assert "resources.partition: no partition 'gpu-h100' on this cluster (it has train)" in bad_partition.stderr

    too_big = spec_for_slurm(tmp_path, partition="train")
    too_big.write_text(too_big.read_text().replace("nodes = 2", "nodes = 4"))
    refused = tsup("run", too_big, "--state-dir", tmp_path / "s2")
    assert refused.returncode == 2
    assert "resources.nodes: 4 nodes asked, partition 'train' has 3" in refused.stderr
    assert slurm(slurm_box, "squeue", "-h") == "", "nothing was submitted"


def test_a_node_reporting_an_uncorrectable_hbm_error_is_drained_before_launch(
        slurm_box: Box, fault_free: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Preflight probes through srun on the allocation's nodes; node2's (fake)
    neuron-monitor reports an uncorrectable HBM error."""
    fixtures = REPO / "tests" / "fixtures" / "health" / "neuron"
    hw = tmp_path / "hw"
    (hw / "default").mkdir(parents=True)
    (hw / "node2").mkdir()
    (hw / "default" / "neuron-ls").write_text((fixtures / "neuron-ls_json_trn1.32xlarge_SYNTHESIZED.json").read_text())
    (hw / "default" / "neuron-monitor").write_text(
        (fixtures / "neuron-monitor_report_trn1_healthy_SYNTHESIZED.json").read_text())
    (hw / "node2" / "neuron-monitor").write_text(
        (fixtures / "neuron-monitor_report_trn1_hbm_ue_SYNTHESIZED.json").read_text())
    tools = make_tools(tmp_path / "tools", ["neuron-ls", "neuron-monitor"])
    monkeypatch.setenv("SLURM_CONF", str(slurm_box.conf))
    monkeypatch.setenv("TSUP_HEALTH_TOOLS", str(tools))
    monkeypatch.setenv("TSUP_FAKE_HW", str(hw))
    spec = spec_for_slurm(tmp_path)
    spec.write_text(spec.read_text() + '\n[health]\npreflight = true\ninstance_type = "trn1.32xlarge"\n'
                    'min_free_gib = 0.1\n')
    state = tmp_path / "state"
    proc = tsup("run", spec, "--state-dir", state, "--json")
    s = summary_of(proc)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert s["state"] == "SUCCEEDED" and s["model_digest"] == fault_free["model_digest"]
    assert s["faults"] == [] and s["attempts"] == 1, "the bad node never got the trainer"
    assert s["attempt_history"][0]["nodes"] == ["node1", "node3"]
    assert s["drained_nodes"] == ["node2"]
    node2 = parse.parse_nodes(slurm(slurm_box, "scontrol", "-o", "show", "node", "node2"))["node2"]
    assert "DRAIN" in node2.flags
    assert node2.reason.startswith("training-supervisor: probe: neuron-monitor:")
    assert "uncorrected" in node2.reason.lower() and "HBM" in node2.reason
    probes = db_rows(state, "SELECT node, kind, status FROM probes ORDER BY id")
    assert probes.count(("node2", "preflight", "unhealthy")) == 2, "confirmed by a second probe"
    assert ("node1", "preflight", "healthy") in probes and ("node3", "preflight", "healthy") in probes


def test_a_drained_node_is_probed_inside_a_reservation_and_stays_drained_until_returned(
        slurm_box: Box, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The sweep's path for drained nodes: Slurm runs no job on a drained node, so the
    launcher reserves it, resumes it, probes it and drains it again with the same Reason."""
    from supervisor import node_health
    from supervisor.slurm.cluster import slurm_cluster

    fixtures = REPO / "tests" / "fixtures" / "health" / "neuron"
    hw = tmp_path / "hw" / "default"
    hw.mkdir(parents=True)
    (hw / "neuron-ls").write_text((fixtures / "neuron-ls_json_trn1.32xlarge_SYNTHESIZED.json").read_text())
    (hw / "neuron-monitor").write_text((fixtures / "neuron-monitor_report_trn1_healthy_SYNTHESIZED.json").read_text())
    monkeypatch.setenv("SLURM_CONF", str(slurm_box.conf))
    monkeypatch.setenv("TSUP_HEALTH_TOOLS", str(make_tools(tmp_path / "tools", ["neuron-ls", "neuron-monitor"])))
    monkeypatch.setenv("TSUP_FAKE_HW", str(tmp_path / "hw"))
    reason = "training-supervisor: probe: neuron-monitor: mem_ecc_uncorrected=1 (run-1, preflight)"
    slurm(slurm_box, "scontrol", "update", "NodeName=node3", "State=DRAIN", f"Reason={reason}")
    launcher = slurm_cluster(slurm_conf=str(slurm_box.conf), state_dir=tmp_path / "state").nodes
    argv = node_health.probe_argv(["--instance-type", "trn1.32xlarge", "--min-free-gib", "0.1"])

    answers = launcher.probe_drained({"node3": reason}, argv, timeout_s=60)

    record = node_health.record("node3", answers.get("node3"), "sweep", None, 0.0)
    assert record.status == "healthy", answers
    node3 = parse.parse_nodes(slurm(slurm_box, "scontrol", "-o", "show", "node", "node3"))["node3"]
    assert "DRAIN" in node3.flags and node3.reason == slurm_reason(reason)  # drained again as the daemon writes it
    assert "No reservations" in slurm(slurm_box, "scontrol", "show", "reservation")
    assert launcher.probe(["node3"], argv, allocation_info=None, timeout_s=30) == {}, "no job on a drained node"

    launcher.undrain("node3")
    node3 = parse.parse_nodes(slurm(slurm_box, "scontrol", "-o", "show", "node", "node3"))["node3"]
    assert "DRAIN" not in node3.flags
    # Slurm may take a scheduling pass to offer the returned node (under load, the probe
    # job of a moment ago can still be completing there): a sweep would simply try again
    # at its next period, so the test tries again too, for at most a minute.
    def probed() -> bool:
        return "node3" in launcher.probe(["node3"], argv, allocation_info=None, timeout_s=30)
    wait_for(probed, 60, "a probe of the returned node3: " + slurm(slurm_box, "scontrol", "-o", "show", "node", "node3"),
             interval_s=1)


def test_a_drain_whose_first_scontrol_fails_is_in_slurm_within_a_few_ticks(slurm_box: Box, tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """The intent protocol against real Slurm: the first `scontrol update ... State=DRAIN`
    fails (as when slurmctld is briefly unreachable); the drain is sent again at the next
    tick after RESEND_S and shows in Slurm, with the operator's reason."""
    from supervisor.domain import Node, NodeCommandKind, NodeState
    from supervisor.reconciler import Reconciler, ReconcilerConfig
    from supervisor.service import SupervisorService
    from supervisor.slurm.cluster import slurm_cluster
    from supervisor.slurm.commands import Reply
    from supervisor.store import SqlStore
    from supervisor.telemetry.view import TelemetryView

    adapters = slurm_cluster(slurm_conf=str(slurm_box.conf), state_dir=tmp_path / "state", poll_interval_s=0.0)
    real_run = adapters.commands.run
    refused: list[tuple[str, ...]] = []

    def run(argv: Any, **kw: Any) -> Reply:
        if list(argv[:2]) == ["scontrol", "update"] and "State=DRAIN" in argv and not refused:
            refused.append(tuple(argv))
            return Reply(tuple(argv), False, "", "", "exit 1: Unable to contact slurm controller (connect failure)")
        return real_run(argv, **kw)

    monkeypatch.setattr(adapters.commands, "run", run)
    store = SqlStore(tmp_path / "state" / "supervisor.db")
    store.open()
    with store.tx() as tx:
        tx.put_node(Node(name="node2", state=NodeState.IDLE), time.time())
    rec = Reconciler(store, TelemetryView(), ReconcilerConfig(mqtt_url=None), launcher=adapters.launcher,
                     nodes=adapters.nodes)
    service = SupervisorService(store, tmp_path / "runs", allow_root_runs=True, mqtt_url=None, launcher=adapters.launcher,
                                check_trainer=False)
    service.request_node("node2", NodeCommandKind.DRAIN, "fan failure")
    ticks = 0
    try:
        for ticks in range(1, 40):
            rec.tick()
            node2 = parse.parse_nodes(slurm(slurm_box, "scontrol", "-o", "show", "node", "node2"))["node2"]
            if "DRAIN" in node2.flags:
                break
            time.sleep(0.25)  # the daemon's tick
        with store.tx() as tx:
            intent = tx.intent("node2")
            failed = tx.list_events(None, kind="node.drain_failed")
    finally:
        rec.close()
        store.close()
    print(json.dumps({"ticks_to_drain": ticks}))
    assert len(refused) == 1 and "DRAIN" in node2.flags and node2.reason == "operator: fan failure"
    assert ticks <= 8, f"in Slurm only after {ticks} ticks"
    assert intent is not None and intent.sent == 2 and intent.last_error is None
    assert [e.data["node"] for e in failed] == ["node2"], "the failure is said once"


def test_two_boxes_run_side_by_side_each_node_a_host_of_its_own_and_down_leaves_nothing(tmp_path: Path) -> None:
    """Each box has its own subnet, bridge and namespaces; a task on a node sees its own
    address only, and 127.0.0.1 there is the node (the controller's slurmctld port does
    not answer on it); `down` leaves no process, namespace or link behind."""
    from slurmbox import box as slurm_box_mod
    from tests.conftest import require, slurm_installed

    require("Slurm (slurmctld, slurmd, munge, slurm-client)", slurm_installed())
    boxes: list[Box] = []
    try:
        for name in ("a", "b"):
            directory = Path(tempfile.mkdtemp(prefix=f"tsup-box{name}-"))
            boxes.append(slurm_box_mod.up(directory, 2))
        a, b = boxes
        assert a.subnet != b.subnet and a.bridge != b.bridge and a.netns("node1") != b.netns("node1")
        probe = (f"hostname -I; python3 -c \"import socket; s=socket.socket(); "
                 f"print(s.connect_ex(('127.0.0.1', {b.ctld_port})), s.connect_ex(('{b.controller_addr}', "
                 f"{b.ctld_port})))\"")
        out = slurm(b, "srun", "-N1", "-w", "node2", "sh", "-c", probe).split()
        assert out[0] == b.addr("node2"), out
        assert out[1] != "0" and out[2] == "0", "loopback on the node is the node; the controller is on the bridge"
        pids = [p for box in boxes for p in (box.ctld_pid, box.munged_pid, *box.slurmd_pids.values())]
        # A process in a node's namespace that is no child of its slurmd (a slurmstepd
        # still starting when the box goes down is one): gone with the box too.
        stray = subprocess.Popen(["nsenter", f"--net={slurm_box_mod.NETNS_DIR / a.netns('node1')}",
                                  "sleep", "600"], start_new_session=True)
        wait_for(lambda: psutil.Process(stray.pid).name() == "sleep", 10, "the stray process in node1's network")
        pids.append(stray.pid)
    finally:
        for box in boxes:
            slurm_box_mod.down(Path(box.dir))
            shutil.rmtree(box.dir, ignore_errors=True)
    assert len(boxes) == 2
    for box in boxes:
        assert slurm_box_mod.network_leftovers(box) == []
    assert not [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]


def test_a_paused_run_gives_its_nodes_back_and_resume_goes_on_in_the_same_job(
        slurm_box: Box, fault_free: dict[str, Any], tmp_path: Path) -> None:
    """A shared cluster: after `pause_release_s` a paused run holds no node, its job kept
    in the queue, held (the users' trainers key their checkpoints on its id); `resume`
    releases it and trains on from the newest checkpoint, in the same job."""
    spec = spec_for_slurm(tmp_path)
    spec.write_text(spec.read_text().replace("[policy]\n", "[policy]\npause_release_s = 5\n"))
    state = tmp_path / "state"
    daemon = slurm_serve(state, free_port(), slurm_box)
    try:
        run_id = daemon.ctl_json("submit", str(spec))["run_id"]
        wait_for(lambda: any(c["complete"] for c in daemon.read("checkpoints", run_id)), 240,
                 "a committed checkpoint")
        [first_job] = slurm(slurm_box, "squeue", "-h", "-o", "%i").split()
        assert daemon.ctl_json("pause", run_id)["result"] == "accepted"
        wait_for(lambda: daemon.read("status", run_id)["attempt_state"] == "ENDED", 60, "the pause")
        parked = f"{first_job}|PENDING||job requeued in held state"  # no node (%N)
        wait_for(lambda: slurm(slurm_box, "squeue", "-h", "-o", "%i|%T|%N|%r").strip() == parked, 60,
                 "the nodes given back, the job held in the queue")
        assert daemon.ctl_json("status", run_id)["state"] == "PAUSED"
        newest = max(c["step"] for c in daemon.ctl_json("checkpoints", run_id) if c["complete"])
        released = [e for e in daemon.ctl_json("events", run_id) if e["kind"] == "allocation.released"]
        assert len(released) == 1, released

        assert daemon.ctl_json("resume", run_id)["result"] == "accepted"
        wait_for(lambda: slurm(slurm_box, "squeue", "-h", "-o", "%i|%T").strip() == f"{first_job}|RUNNING", 60,
                 "the same job running again")
        assert "Restarts=1" in slurm(slurm_box, "scontrol", "show", "job", first_job)
        final = wait_for(lambda: (d := daemon.read("status", run_id))["state"] in ("SUCCEEDED", "FAILED") and d,
                         300, "the resumed run to end", interval_s=1.0)
        assert final["state"] == "SUCCEEDED" and final["model_digest"] == fault_free["model_digest"], final
        resumed = final["attempt_history"][-1]
        assert final["attempts"] == 2 and resumed["resume_step"] == newest, final["attempt_history"]
        wait_for(lambda: slurm(slurm_box, "squeue", "-h") == "", 60, "the finished run's allocation given back")
    finally:
        daemon.kill(15)


# Each task writes what it sees: the job-wide node list and count, and where it runs.
STEP_ENV = ('printf "%s %s %s\\n" "$SLURM_JOB_NODELIST" "$SLURM_JOB_NUM_NODES" "$(pwd)" > "$1/env-$SLURM_PROCID"; '
            'echo hello')


def test_a_command_sees_its_steps_nodes_as_the_job_and_runs_in_its_cwd_with_its_srun_args(
        slurm_box: Box, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """2 nodes + 1 spare: inside the step, SLURM_JOB_NODELIST names the step's 2 nodes,
    not the allocation's 3 (a script taking its master from it stays inside the step)."""
    monkeypatch.setenv("SLURM_CONF", str(slurm_box.conf))
    spec = command_spec(tmp_path / "env.toml", "step-env", ["sh", "-c", STEP_ENV, "step-env", "{run_dir}"],
                        resources={"launcher": "slurm", "nodes": 2, "ranks_per_node": 1, "spares": 1},
                        cwd="{run_dir}/attempts", srun_args=["-l"])
    state = tmp_path / "state"
    s = summary_of(tsup("run", spec, "--state-dir", state, "--json", timeout_s=120))
    assert s["state"] == "SUCCEEDED", s
    [attempt] = s["attempt_history"]
    run_dir = state / "runs" / "run-1"
    for task in (0, 1):
        nodelist, count, cwd = (run_dir / f"env-{task}").read_text().split()
        hosts = slurm(slurm_box, "scontrol", "show", "hostnames", nodelist).split()
        assert hosts == attempt["nodes"] and count == "2", (nodelist, count, attempt["nodes"])
        assert cwd == str(run_dir / "attempts")
    assert (run_dir / "attempts" / "1" / "rank-0.log").read_text().strip() == "0: hello", "srun -l labels"


def test_on_hyperpod_a_runs_only_node_lost_is_handed_to_its_repair_and_taken_back_when_it_returns(
        slurm_box: Box, tmp_path: Path) -> None:
    """With `hyperpod = true`, a run of one node and no spare: its node losing its power
    mid-run (its link down, then everything on it SIGKILLed: no last will is sent) is a
    lost node once Slurm declares it down (not a hang, not a network cut), set FAIL with
    Reason "Action:Replace" (what HyperPod's agent acts on); the run's job is requeued,
    its id kept, and goes on on another node, in one attempt (the srun of the dead
    incarnation kills nothing of it). Once HyperPod brings the node back (here: slurmd
    started again and the node resumed, as its agent does) the supervisor takes it back
    into its pool."""
    from slurmbox import box as box_mod

    spec = spec_for_slurm(tmp_path)
    # 240 steps, not the example's 80: the node must die while it trains. 80 steps take
    # about 5 s after the first checkpoint, less than a few status calls on a busy host.
    spec.write_text(spec.read_text().replace("nodes = 2\n", "nodes = 1\n").replace("spares = 1\n", "spares = 0\n")
                    .replace("steps = 80\n", "steps = 240\n"))
    state = tmp_path / "state"
    daemon = Serve(state, free_port(), "--launcher", "slurm",
                   extra_env={"SLURM_CONF": str(slurm_box.conf), "TSUP_HYPERPOD": "true"})
    try:
        run_id = daemon.ctl_json("submit", str(spec))["run_id"]
        wait_for(lambda: any(c["complete"] for c in daemon.read("checkpoints", run_id)), 240,
                 "a committed checkpoint")
        [job] = slurm(slurm_box, "squeue", "-h", "-o", "%i").split()
        [lost] = daemon.ctl_json("status", run_id)["attempt_history"][-1]["nodes"]
        box_mod.kill_node(slurm_box, lost, power_loss=True)
        assert (daemon.ctl_json("status", run_id)["step"] or 0) < 240, "the run ended before its node was killed"

        def node() -> parse.NodeInfo:
            return parse.parse_nodes(slurm(slurm_box, "scontrol", "-o", "show", "node", lost))[lost]

        failed = wait_for(lambda: "FAIL" in node().flags and node(), 60, f"{lost} handed to HyperPod")
        assert failed.reason == "Action:Replace", failed
        ours = {n["name"]: n for n in daemon.ctl_json("nodes")}[lost]
        assert ours["state"] == "DRAINED" and ours["reason"].startswith("training-supervisor: node lost")
        [fault] = daemon.ctl_json("status", run_id)["faults"]
        assert fault["kind"] == "node-lost" and fault["nodes"] == [lost], fault
        again = wait_for(lambda: len(h := daemon.read("status", run_id)["attempt_history"]) == 2
                         and h[-1]["state"] == "RUNNING" and h[-1], 120, "training again, on another node")
        assert again["nodes"] != [lost] and again["resume_step"] > 0, again
        assert "Restarts=1" in slurm(slurm_box, "scontrol", "show", "job", job), "requeued, its id kept"

        box_mod.start_node(slurm_box, lost)  # the replacement, under the same name
        slurm(slurm_box, "scontrol", "update", f"NodeName={lost}", "State=RESUME")
        back = wait_for(lambda: (n := {x["name"]: x for x in daemon.read("nodes")}[lost])["state"] != "DRAINED"
                        and n, 60, f"{lost} back in the supervisor's pool")
        assert back["state"] in ("IDLE", "ALLOCATED"), back
        events = [e["message"] for e in daemon.ctl_json("events", run_id) if e["kind"] == "node.returned"]
        assert any("back in service after the cluster's repair" in m for m in events), events
        done = wait_for(lambda: (d := daemon.read("status", run_id))["state"] in ("SUCCEEDED", "FAILED") and d,
                        300, "the run to finish")
        assert done["state"] == "SUCCEEDED" and done["attempts"] == 2, done
        assert "FAIL" not in node().flags and "DRAIN" not in node().flags, "nothing took it out again"
    finally:
        daemon.kill(15)


def test_each_box_node_has_a_dev_shm_of_its_own_that_a_killed_node_loses(slurm_box: Box, tmp_path: Path) -> None:
    """The memory tier's premise on the box: /dev/shm is a node's own memory. What a step
    writes there on node1 node1's next step reads, and neither node2 nor the controller
    sees; node1 killed (SIGKILL to everything it runs) and started again has an empty one."""
    from slurmbox import box as box_mod

    shm = f"/dev/shm/tsup-node-memory-{tmp_path.name}"

    def on(node: str, script: str) -> str:
        return slurm(slurm_box, "srun", "--nodes=1", f"--nodelist={node}", "/bin/sh", "-c", script)

    assert on("node1", f"echo node1 > {shm} && cat {shm}") == "node1\n"
    assert on("node1", f"cat {shm}") == "node1\n", "a node keeps its memory between steps"
    assert on("node2", f"test ! -e {shm} && echo absent") == "absent\n", "node2 sees node1's memory"
    assert not Path(shm).exists(), "the controller sees node1's memory"
    box_mod.kill_node(slurm_box, "node1", power_loss=True)
    link = subprocess.run(["ip", "-o", "link", "show", slurm_box.link("node1")], capture_output=True, text=True,
                          check=True).stdout
    assert "state DOWN" in link, "a node without power sends nothing: its link is down"
    box_mod.start_node(slurm_box, "node1")  # back, with its link
    box_mod.wait_idle(slurm_box, 60)
    assert on("node1", f"test ! -e {shm} && echo gone") == "gone\n", "a killed node's memory outlived it"


def test_a_node_without_the_supervisors_interpreter_says_so_naming_itself_and_the_path(
        slurm_box: Box, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The probe runs the supervisor's interpreter, at the same path on every node
    (scripts/install-node): a node without it answers unhealthy through the probe's guard,
    where srun alone prints an execve error naming neither the node nor the path; a run's
    command missing there (--require) is named the same way."""
    from supervisor import node_health
    from supervisor.slurm.cluster import slurm_cluster

    monkeypatch.setenv("SLURM_CONF", str(slurm_box.conf))
    launcher = slurm_cluster(slurm_conf=str(slurm_box.conf), state_dir=tmp_path / "state").nodes
    absent = "/opt/training-supervisor/.venv/bin/python3-not-installed"
    argv = node_health.probe_argv(["--min-free-gib", "0.1"], interpreter=absent)
    answers = launcher.probe(["node2", "node3"], argv, allocation_info=None, timeout_s=60)
    for node in ("node2", "node3"):
        record = node_health.record(node, answers.get(node), "preflight", 1, 0.0)
        assert record.status == "unhealthy", answers
        assert record.reason == (f"deploy: {absent}, the supervisor's interpreter, is missing on this node: "
                                 "install the supervisor there at the same path (scripts/install-node)")
    script = tmp_path / "examples" / "train.sh"
    argv = node_health.probe_argv(["--min-free-gib", "0.1"], [str(script.parent), str(script)])
    answers = launcher.probe(["node2"], argv, allocation_info=None, timeout_s=60)
    record = node_health.record("node2", answers.get("node2"), "preflight", 1, 0.0)
    assert record.status == "unhealthy" and f"run-files: {script.parent} is missing on this node" in record.reason
    script.parent.mkdir()
    script.write_text("#!/bin/sh\n")
    script.chmod(0o755)
    answers = launcher.probe(["node2"], argv, allocation_info=None, timeout_s=60)
    assert node_health.record("node2", answers.get("node2"), "preflight", 1, 0.0).status != "unhealthy", answers

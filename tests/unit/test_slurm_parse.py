"""supervisor/slurm/parse.py: every parser against recorded Slurm 22.05.8 output, one
synthesized 23.02 squeue --json document, and one test per quirk.

Pure: no subprocess, no Slurm. Fixtures live in tests/fixtures/slurm/; the ones written
by hand have SYNTHESIZED in their names.
"""

from __future__ import annotations

import json

import pytest

from supervisor.errors import SupervisorError
from supervisor.slurm import parse
from supervisor.slurm.parse import (
    JOB_STATES,
    JobInfo,
    JobPhase,
    NodeInfo,
    SlurmParseError,
    StepInfo,
    expand_hostlist,
    parse_key_values,
    parse_nodes,
    parse_partitions,
    parse_sbatch_job_id,
    parse_squeue_json,
    parse_squeue_text,
    parse_steps_text,
)
from tests.conftest import REPO

FIXTURES = REPO / "tests" / "fixtures" / "slurm"


def fixture(name: str) -> str:
    return (FIXTURES / name).read_text()


def squeue_json(*jobs: dict[str, object]) -> str:
    return json.dumps({"meta": {}, "errors": [], "jobs": list(jobs)})


# --- host lists -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("node[1-3,7]", ("node1", "node2", "node3", "node7")),
        ("gpu[01-03]", ("gpu01", "gpu02", "gpu03")),
        ("gpu[08-10]", ("gpu08", "gpu09", "gpu10")),  # padding kept across a digit boundary
        ("node[0-2]", ("node0", "node1", "node2")),
        ("node[9-11]", ("node9", "node10", "node11")),  # no padding: widths grow
        ("a[1-2],b3", ("a1", "a2", "b3")),
        ("b3,a[1-2]", ("b3", "a1", "a2")),  # Slurm's order is kept, not sorted
        ("rack1-n[1-2]-ib", ("rack1-n1-ib", "rack1-n2-ib")),  # prefix and suffix around the range
        ("node5", ("node5",)),
        ("node1,node3", ("node1", "node3")),
        ("  node[1-2]\n", ("node1", "node2")),
        ("(null)", ()),
        ("", ()),
    ],
)
def test_expand_hostlist(text: str, expected: tuple[str, ...]) -> None:
    assert expand_hostlist(text) == expected


@pytest.mark.parametrize(
    "text",
    [
        "node[1-3",  # unbalanced: never closed
        "node1-3]",  # unbalanced: never opened
        "node]1[",  # balanced count, wrong order
        "node[a-b]",  # not numbers
        "node[3-1]",  # backwards range
        "node[]",  # empty range
        "node[1,,2]",  # empty item
        "node[1-2,]",  # trailing comma inside brackets
        "node[1-1000000]",  # absurd size: a misread, not a cluster
    ],
)
def test_expand_hostlist_garbage_raises(text: str) -> None:
    with pytest.raises(SlurmParseError, match="host list"):
        expand_hostlist(text)


def test_slurm_parse_error_is_a_supervisor_error() -> None:
    # The launcher catches SlurmParseError; anything else would escape as a crash.
    assert issubclass(SlurmParseError, SupervisorError)


# --- job states -------------------------------------------------------------------

# Every string job_state_string() in Slurm's src/common/slurm_protocol_defs.c can
# print for squeue's %T (flags first, then base states), plus OUT_OF_MEMORY.
SLURM_PRINTS = [
    "COMPLETING", "STAGE_OUT", "CONFIGURING", "RESIZING", "REQUEUED", "REQUEUE_FED", "REQUEUE_HOLD",
    "SPECIAL_EXIT", "STOPPED", "REVOKED", "RESV_DEL_HOLD", "SIGNALING",
    "PENDING", "RUNNING", "SUSPENDED", "COMPLETED", "CANCELLED", "FAILED", "TIMEOUT", "NODE_FAIL",
    "PREEMPTED", "BOOT_FAIL", "DEADLINE", "OUT_OF_MEMORY",
]


def test_every_state_slurm_prints_has_a_phase() -> None:
    assert [s for s in SLURM_PRINTS if s not in JOB_STATES] == []
    assert all(isinstance(p, JobPhase) for p in JOB_STATES.values())


@pytest.mark.parametrize(
    ("state", "phase"),
    [
        ("PENDING", JobPhase.WAITING),
        ("REQUEUED", JobPhase.WAITING),  # requeued after NODE_FAIL/preemption: back in the queue
        ("REQUEUE_HOLD", JobPhase.WAITING),
        ("CONFIGURING", JobPhase.WAITING),
        ("RUNNING", JobPhase.HOLDING),
        ("SUSPENDED", JobPhase.HOLDING),
        ("COMPLETED", JobPhase.ENDED),
        ("CANCELLED", JobPhase.ENDED),
        ("FAILED", JobPhase.ENDED),
        ("TIMEOUT", JobPhase.ENDED),
        ("NODE_FAIL", JobPhase.ENDED),
        ("PREEMPTED", JobPhase.ENDED),
        ("BOOT_FAIL", JobPhase.ENDED),
        ("OUT_OF_MEMORY", JobPhase.ENDED),
    ],
)
def test_job_state_table(state: str, phase: JobPhase) -> None:
    assert JOB_STATES[state] is phase
    line = f"9|{state}|node1|None|j\n"
    assert parse_squeue_text(line)["9"].phase is phase


def test_unknown_job_state_raises_in_text_and_json() -> None:
    with pytest.raises(SlurmParseError, match="unknown Slurm job state 'WIBBLE'"):
        parse_squeue_text("9|WIBBLE|node1|None|j\n")
    with pytest.raises(SlurmParseError, match="unknown Slurm job state"):
        parse_squeue_json(squeue_json({"job_id": 9, "job_state": "WIBBLE", "nodes": ""}))
    with pytest.raises(SlurmParseError, match="unknown Slurm job state"):
        parse_squeue_json(squeue_json({"job_id": 9, "job_state": ["WIBBLE"], "nodes": ""}))
    with pytest.raises(SlurmParseError, match="unknown Slurm job state"):
        parse_squeue_json(squeue_json({"job_id": 9, "job_state": [], "nodes": ""}))


# --- squeue --json ----------------------------------------------------------------


def test_squeue_json_22_05_fixture() -> None:
    jobs = parse_squeue_json(fixture("squeue-22.05-running-pending-cancelled.json"))
    assert sorted(jobs) == ["1", "2", "3", "4"]
    assert jobs["3"] == JobInfo(job_id="3", name="tsup.alloc", state="RUNNING", phase=JobPhase.HOLDING,
                                nodes=("node1", "node2"), reason="None")
    assert jobs["4"] == JobInfo(job_id="4", name="tsup.pending", state="PENDING", phase=JobPhase.WAITING,
                                nodes=(), reason="Resources")


def test_squeue_json_with_the_controller_down_is_an_error_not_an_empty_queue() -> None:
    """Real output of squeue --json (22.05) a second after slurmctld was killed: exit
    code 0, no jobs, and an error. Read as "no jobs", it made a run give up its allocation."""
    with pytest.raises(SlurmParseError, match="slurm_load_jobs; Failed while looking for jobs"):
        parse_squeue_json(fixture("squeue-22.05-controller-down.json"))


def test_squeue_json_cancelled_jobs_are_ended_and_hold_no_nodes() -> None:
    jobs = parse_squeue_json(fixture("squeue-22.05-running-pending-cancelled.json"))
    for job_id in ("1", "2"):
        assert jobs[job_id].state == "CANCELLED"
        assert jobs[job_id].phase is JobPhase.ENDED
        # The recorded records still name node[1-3] and node[1-2]: an ended job's
        # nodes are not ours.
        assert jobs[job_id].nodes == ()


def test_squeue_json_23_02_fixture() -> None:
    jobs = parse_squeue_json(fixture("squeue-23.02-SYNTHESIZED-running-pending.json"))
    assert jobs == {
        "101": JobInfo(job_id="101", name="tsup.run-7.alloc", state="RUNNING", phase=JobPhase.HOLDING,
                       nodes=("gpu01", "gpu02"), reason="None"),
        "102": JobInfo(job_id="102", name="tsup.run-8.alloc", state="PENDING", phase=JobPhase.WAITING,
                       nodes=(), reason="Resources"),
    }


def test_squeue_json_state_list_with_flags_takes_the_base_state() -> None:
    # 23.02+ prints the base state first, then flags.
    jobs = parse_squeue_json(squeue_json(
        {"job_id": 5, "job_state": ["PENDING", "REQUEUED"], "name": "a", "nodes": "", "state_reason": "BeginTime"},
        {"job_id": 6, "job_state": ["RUNNING", "SIGNALING"], "name": "b", "nodes": "n[1-2]"},
        {"job_id": 7, "job_state": ["CANCELLED", "COMPLETING"], "name": "c", "nodes": "n3"},
    ))
    assert (jobs["5"].state, jobs["5"].phase, jobs["5"].nodes) == ("PENDING", JobPhase.WAITING, ())
    assert (jobs["6"].state, jobs["6"].phase, jobs["6"].nodes) == ("RUNNING", JobPhase.HOLDING, ("n1", "n2"))
    assert (jobs["7"].state, jobs["7"].phase, jobs["7"].nodes) == ("CANCELLED", JobPhase.ENDED, ())


def test_squeue_json_wrapped_number_job_id() -> None:
    jobs = parse_squeue_json(squeue_json(
        {"job_id": {"set": True, "infinite": False, "number": 42}, "job_state": ["RUNNING"], "nodes": "n1"},
    ))
    assert list(jobs) == ["42"]
    assert jobs["42"].job_id == "42"
    assert jobs["42"].nodes == ("n1",)


def test_squeue_json_null_nodes_and_missing_optional_fields() -> None:
    jobs = parse_squeue_json(squeue_json({"job_id": 8, "job_state": "PENDING", "nodes": None}))
    assert jobs["8"] == JobInfo(job_id="8", name="", state="PENDING", phase=JobPhase.WAITING, nodes=(),
                                reason="")


def test_squeue_json_no_jobs() -> None:
    assert parse_squeue_json('{"jobs": []}') == {}


@pytest.mark.parametrize(
    "text",
    [
        "",
        "{",
        "squeue: error: Invalid user",
        "[]",  # not an object
        '{"errors": []}',  # no jobs key
        '{"jobs": {}}',  # jobs not a list
        '{"jobs": [1]}',  # a job that is not a record
        '{"jobs": [{"job_id": 1}]}',  # no job_state
        '{"jobs": [{"job_state": "RUNNING", "nodes": "n1"}]}',  # no job_id
    ],
)
def test_squeue_json_malformed_raises(text: str) -> None:
    with pytest.raises(SlurmParseError, match="squeue --json"):
        parse_squeue_json(text)


def test_squeue_json_bad_hostlist_raises_slurm_parse_error() -> None:
    with pytest.raises(SlurmParseError, match="host list"):
        parse_squeue_json(squeue_json({"job_id": 1, "job_state": "RUNNING", "nodes": "n[1-"}))


# --- squeue text ------------------------------------------------------------------


def test_squeue_format_is_five_fields() -> None:
    assert parse.SQUEUE_FORMAT == "%i|%T|%N|%r|%j"  # the free-text name last
    assert parse.STEPS_FORMAT == "%i|%N|%j"


def test_squeue_text_22_05_fixture_5_fields() -> None:
    # Derived from squeue-22.05-text.txt: its fields reordered to SQUEUE_FORMAT, %l dropped.
    jobs = parse_squeue_text(fixture("squeue-22.05-text-5field-SYNTHESIZED.txt"))
    assert jobs == {
        "4": JobInfo(job_id="4", name="tsup.pending", state="PENDING", phase=JobPhase.WAITING, nodes=(),
                     reason="Resources"),
        "3": JobInfo(job_id="3", name="tsup.alloc", state="RUNNING", phase=JobPhase.HOLDING,
                     nodes=("node1", "node2"), reason="None"),
    }


def test_squeue_text_and_json_agree_on_the_recorded_jobs() -> None:
    text = parse_squeue_text(fixture("squeue-22.05-text-5field-SYNTHESIZED.txt"))
    js = parse_squeue_json(fixture("squeue-22.05-running-pending-cancelled.json"))
    assert text == {k: js[k] for k in ("3", "4")}


def test_squeue_text_recorded_6_field_line_is_rejected() -> None:
    # The recording used an older "%i|%j|%T|%N|%r|%l": its lines must not be misread.
    with pytest.raises(SlurmParseError, match=r"unknown Slurm job state 'tsup.pending'"):
        parse_squeue_text(fixture("squeue-22.05-text.txt"))


def test_squeue_text_too_few_fields_raises() -> None:
    with pytest.raises(SlurmParseError, match="squeue: cannot read line"):
        parse_squeue_text("3|RUNNING|node1|None\n")


def test_squeue_text_ended_and_pending_jobs_hold_no_nodes() -> None:
    jobs = parse_squeue_text("5|CANCELLED|node[1-2]|None|x\n6|PENDING|(null)|Priority|y\n")
    assert (jobs["5"].phase, jobs["5"].nodes) == (JobPhase.ENDED, ())
    assert (jobs["6"].phase, jobs["6"].nodes, jobs["6"].reason) == (JobPhase.WAITING, (), "Priority")


def test_squeue_text_blank_lines_and_empty_output() -> None:
    assert parse_squeue_text("") == {}
    assert list(parse_squeue_text("\n3|RUNNING|n1|None|a\n\n  \n")) == ["3"]


def test_squeue_text_job_name_with_pipe_does_not_break_the_poll() -> None:
    jobs = parse_squeue_text("7|RUNNING|n1|None|someone's|job\n3|RUNNING|node[1-2]|None|tsup.alloc\n")
    assert jobs["3"].nodes == ("node1", "node2")
    assert jobs["7"].name == "someone's|job"


# --- squeue --steps ---------------------------------------------------------------


def test_steps_22_05_fixture() -> None:
    assert parse_steps_text(fixture("squeue-steps-22.05.txt")) == [
        StepInfo(job_id="3", step_id="0", name="tsup.A", nodes=("node1", "node3")),
        StepInfo(job_id="3", step_id="1", name="tsup.B", nodes=("node1", "node2")),
        StepInfo(job_id="3", step_id="batch", name="batch", nodes=("node1",)),
    ]


def test_steps_empty_output() -> None:
    assert parse_steps_text("\n") == []


def test_steps_name_with_pipe_is_kept_whole() -> None:
    assert parse_steps_text("3.0|node1|a|b\n")[0].name == "a|b"


@pytest.mark.parametrize("line", ["3|node1|tsup.A", "3.0|tsup.A"])
def test_steps_malformed_line_raises(line: str) -> None:
    with pytest.raises(SlurmParseError, match="squeue --steps: cannot read"):
        parse_steps_text(line + "\n")


# --- scontrol -o: key=value -------------------------------------------------------


def test_key_values_plain_tokens() -> None:
    kv = parse_key_values("NodeName=n1 State=IDLE CfgTRES=cpu=2,mem=4000M AllocTRES= OS=Linux 6.1 #1 SMP")
    assert kv == {"NodeName": "n1", "State": "IDLE", "CfgTRES": "cpu=2,mem=4000M", "AllocTRES": "",
                  "OS": "Linux"}


def test_key_values_reason_runs_to_end_of_line_and_drops_slurm_suffix() -> None:
    kv = parse_key_values("NodeName=n1 State=DOWN Reason=probe failed: ECC x=1 [root@2026-11-22T08:59:15]")
    assert kv["Reason"] == "probe failed: ECC x=1"
    assert "x" not in kv  # "x=1" belongs to the reason, not a key


def test_key_values_reason_without_suffix_or_with_plain_brackets_is_kept() -> None:
    assert parse_key_values("NodeName=n1 Reason=Not responding")["Reason"] == "Not responding"
    assert parse_key_values("NodeName=n1 Reason=ECC [gpu 3]")["Reason"] == "ECC [gpu 3]"


def test_key_values_keys_after_reason() -> None:
    kv = parse_key_values("NodeName=n1 State=IDLE+DRAIN CurrentWatts=0 AveWatts=0 "
                          "Reason=gpu gone [root@2026-11-22T08:59:15] Comment=rma-ticket-7")
    assert kv["Reason"] == "gpu gone"
    assert kv["Comment"] == "rma-ticket-7"


# --- scontrol -o show node --------------------------------------------------------


def test_nodes_22_05_fixture() -> None:
    nodes = parse_nodes(fixture("scontrol-show-node-22.05.txt"))
    assert list(nodes) == ["node1", "node2", "node3"]
    assert nodes["node1"] == NodeInfo(name="node1", state="ALLOCATED", addr="127.0.0.1", reason="")
    assert nodes["node2"] == NodeInfo(name="node2", state="ALLOCATED", addr="127.0.0.1", reason="")
    assert nodes["node3"] == NodeInfo(name="node3", state="DOWN+DRAIN+NOT_RESPONDING", addr="127.0.0.1",
                                      reason="x y")
    assert nodes["node3"].flags == {"DOWN", "DRAIN", "NOT_RESPONDING"}
    assert [n.usable for n in nodes.values()] == [True, True, False]


def test_node_reason_suffix_dropped() -> None:
    line = fixture("scontrol-show-node-22.05.txt").splitlines()[2]
    assert line.endswith("Reason=x y [root@2026-11-22T08:59:15]")
    assert parse_nodes(line)["node3"].reason == "x y"


def test_node_state_star_suffix_stripped() -> None:
    nodes = parse_nodes("NodeName=n1 NodeAddr=10.0.0.1 State=IDLE* Partitions=train\n"
                        "NodeName=n2 State=ALLOCATED* Partitions=train\n")
    assert "*" not in nodes["n1"].state
    assert nodes["n1"].state.split("+")[0] == "IDLE"
    assert nodes["n2"].state.split("+")[0] == "ALLOCATED"
    assert nodes["n1"].addr == "10.0.0.1"
    assert nodes["n2"].addr == "n2"  # no NodeAddr: the name


def test_node_state_star_means_not_responding() -> None:
    nodes = parse_nodes("NodeName=n1 State=IDLE* Partitions=train\n")
    assert nodes["n1"].usable is False


@pytest.mark.parametrize(
    ("state", "usable"),
    [
        ("IDLE", True),
        ("ALLOCATED", True),
        ("MIXED", True),
        ("IDLE+DRAIN", False),
        ("ALLOCATED+DRAIN", False),
        ("MIXED+DRAIN", False),
        ("DRAINED", False),
        ("DOWN", False),
        ("DOWN+DRAIN+NOT_RESPONDING", False),
        ("IDLE+NOT_RESPONDING", False),
        ("ALLOCATED+FAIL", False),
        ("IDLE+POWERED_DOWN", False),
        ("IDLE+MAINTENANCE", False),
        ("IDLE+REBOOT_REQUESTED", False),
    ],
)
def test_node_usable(state: str, usable: bool) -> None:
    assert NodeInfo(name="n", state=state, addr="n", reason="").usable is usable
    assert parse_nodes(f"NodeName=n State={state}\n")["n"].usable is usable


@pytest.mark.parametrize("line", ["State=IDLE NodeAddr=x", "NodeName=n1 NodeAddr=x", "garbage"])
def test_node_line_without_name_or_state_raises(line: str) -> None:
    with pytest.raises(SlurmParseError, match="scontrol show node: cannot read line"):
        parse_nodes(line + "\n")


def test_nodes_empty_output() -> None:
    assert parse_nodes("") == {}


# --- scontrol -o show partition ---------------------------------------------------


def test_partitions_22_05_fixture() -> None:
    parts = parse_partitions(fixture("scontrol-show-partition-22.05.txt"))
    assert list(parts) == ["train"]
    p = parts["train"]
    assert p.nodes == ("node1", "node2", "node3")
    assert p.state == "UP"
    assert p.total_nodes == 3
    assert p.max_nodes is None  # MaxNodes=UNLIMITED
    assert p.default is True


def test_partition_limited_not_default() -> None:
    parts = parse_partitions(fixture("scontrol-show-partition-22.05.txt")
                             + "PartitionName=debug Default=NO MaxNodes=4 Nodes=gpu[01-02] State=DOWN "
                               "TotalNodes=2\n")
    d = parts["debug"]
    assert (d.nodes, d.state, d.total_nodes, d.max_nodes, d.default) == (("gpu01", "gpu02"), "DOWN", 2, 4, False)
    assert parts["train"].default is True


def test_partition_without_nodes() -> None:
    p = parse_partitions("PartitionName=empty Nodes=(null) TotalNodes=0 State=INACTIVE\n")["empty"]
    assert (p.nodes, p.total_nodes, p.state, p.default) == ((), 0, "INACTIVE", False)


@pytest.mark.parametrize(
    "line",
    ["Default=YES TotalNodes=3", "PartitionName=x MaxNodes=lots", "PartitionName=x TotalNodes=three"],
)
def test_partition_malformed_raises(line: str) -> None:
    with pytest.raises(SlurmParseError, match="scontrol show partition: cannot read line"):
        parse_partitions(line + "\n")


# --- sbatch --parsable ------------------------------------------------------------


@pytest.mark.parametrize(("text", "job_id"), [("12", "12"), ("12\n", "12"), ("12;cluster", "12"),
                                               ("  4711;tsupbox38027\n", "4711")])
def test_sbatch_job_id(text: str, job_id: str) -> None:
    assert parse_sbatch_job_id(text) == job_id


@pytest.mark.parametrize("text", ["", "\n", "Submitted batch job 12", "cluster;12", "12a", "-3", "1 2"])
def test_sbatch_job_id_garbage_raises(text: str) -> None:
    with pytest.raises(SlurmParseError, match="not a job id"):
        parse_sbatch_job_id(text)


def test_sbatch_job_id_from_recorded_error_raises() -> None:
    text = fixture("sbatch-unknown-partition.txt")
    assert "Invalid partition name specified" in text
    with pytest.raises(SlurmParseError, match="sbatch: error: invalid partition"):
        parse_sbatch_job_id(text)


def test_key_values_job_reason_mid_line_ends_at_the_next_key() -> None:
    kv = parse_key_values("JobId=3 JobState=PENDING Reason=Resources Dependency=(null) ExcNodeList=node2")
    assert kv["Reason"] == "Resources" and kv["ExcNodeList"] == "node2" and kv["Dependency"] == "(null)"


def test_framed_squeue_text_takes_a_name_whole_and_drops_one_with_control_characters() -> None:
    fmt = parse.framed(parse.SQUEUE_OWNED_FORMAT, "f4a3")
    assert fmt == "%i|%T|%N|%r|%U|f4a3%jf4a3"
    text = ("12|RUNNING|node1|None|1001|f4a3tsup.run-1|with a bar and\n13|RUNNING|node2|None|0|evilf4a3\n"
            "14|PENDING||Resources|1002|f4a3plain namef4a3\n")
    jobs = parse_squeue_text(text, owners=True, frame="f4a3")
    assert list(jobs) == ["14"], "12's name holds a newline: dropped, and 13 is no record of its own"
    assert jobs["14"].name == "plain name" and jobs["14"].user_id == 1002
    with pytest.raises(SlurmParseError, match="without its closing frame"):
        parse_squeue_text("15|RUNNING|n|None|1|f4a3open", owners=True, frame="f4a3")

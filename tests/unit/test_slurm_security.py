"""Three findings against the Slurm adapters, each test named for its exploit.

- A trainer's words in a drain Reason rewrote the node table the daemon parses (a
  ``[command]`` printing ``uncorrectable ECC error encountered NodeName=node1
  NodeAddr=10.6.6.6 State=IDLE`` got its node drained with that line, and the daemon then
  saw node1 idle at 10.6.6.6 and the drained node gone).
- A NUL byte in a Slurm launch was a ValueError from Popen that SlurmLauncher.start did
  not catch: the attempt stayed LAUNCHING and was relaunched every tick.
- Jobs, steps and srun processes were taken for the run's by name alone, whoever owned
  them: another user's job squatted a run, and stop() could scancel another user's step.

No Slurm here: recorded outputs (tests/fixtures/slurm/) and scripted commands. The same
exploits against a real cluster are in tests/e2e/test_slurm_security.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import psutil
import pytest

from supervisor.domain import ProcState
from supervisor.errors import CannotExecute, LaunchError, SpecError
from supervisor.launchers.base import AllocationRequest, LaunchSpec
from supervisor.slurm import parse
from supervisor.slurm.commands import Reply, SlurmCommands
from supervisor.slurm.launcher import SlurmLauncher
from supervisor.slurm.nodes import REASON_MAX, SlurmNodes, slurm_reason
from supervisor.slurm.srun import find_srun
from supervisor.slurm.state import SlurmState
from supervisor.spec import load_spec
from tests.conftest import REPO, wait_for

FIXTURES = REPO / "tests" / "fixtures" / "slurm"
# The line the finding quotes, word for word: what a [command] trainer on node3 printed.
ATTACK = "uncorrectable ECC error encountered NodeName=node1 NodeAddr=10.6.6.6 State=IDLE"
ME = os.geteuid()
SOMEONE = ME + 4242  # a uid that is not this process's


def fixture(name: str) -> str:
    return (FIXTURES / name).read_text()


# --- a scripted Slurm -------------------------------------------------------------------


class ScriptedSlurm:
    """SlurmCommands' run/admin/fire, answered from ``answers`` (the first words of an
    argv -> its stdout, or a Reply) and recorded."""

    def __init__(self, answers: dict[tuple[str, ...], str | Reply | Callable[[], str]]) -> None:
        self.answers = answers
        self.ran: list[list[str]] = []
        self.users: list[object] = []  # each run's ``user`` (None: as the daemon)
        self.fired: list[list[str]] = []
        self.timeout_s = 10.0
        self.admin_prefix: tuple[str, ...] = ()

    def run(self, argv: Sequence[str], **kw: Any) -> Reply:
        self.ran.append(list(argv))
        self.users.append(kw.get("user"))
        for n in range(len(argv), 0, -1):
            answer = self.answers.get(tuple(argv[:n]))
            if answer is None:
                continue
            if isinstance(answer, Reply):
                return answer
            text = answer() if callable(answer) else answer
            return Reply(tuple(argv), True, framed_as_asked(argv, text), "", "")
        return Reply(tuple(argv), False, "", f"{argv[0]}: unrecognized option", "exit 1: unrecognized option")


    def admin(self, argv: Sequence[str], **kw: Any) -> Reply:
        return self.run(argv, **kw)

    def fire(self, argv: Sequence[str], **kw: Any) -> None:
        self.fired.append(list(argv))

    def scancels(self) -> list[list[str]]:
        return [a for a in [*self.ran, *self.fired] if a[0] == "scancel"]


def framed_as_asked(argv: Sequence[str], text: str) -> str:
    """squeue's text (one record a line) as squeue prints it for a format whose name is
    framed (supervisor/slurm/parse.py: framed): each name between the poll's frames."""
    fmt = argv[argv.index("-o") + 1] if "-o" in argv else ""
    head, _, last = fmt.rpartition("|")
    frame = last.split("%j")[0] if "%j" in last else ""
    if not frame or frame in text:  # (a test that frames its records itself)
        return text
    fields = head.count("|") + 2
    records = (line.split("|", fields - 1) for line in text.splitlines() if line.strip())
    return "".join(f"{'|'.join(r[:-1])}|{frame}{r[-1]}{frame}\n" for r in records)


def failed(argv: str, why: str) -> Reply:
    return Reply(tuple(argv.split()), False, "", why, f"exit 1: {why}")


def squeue(*jobs: dict[str, Any]) -> str:
    return json.dumps({"errors": [], "jobs": [{"job_state": "RUNNING", "nodes": "node[1-2]",
                                                "state_reason": "None", **j} for j in jobs]})


NODES_JSON = fixture("sinfo-json-22.05-drain-reason-with-keys.json")


def slurm_of(jobs: str = squeue(), steps: str = "", **more: str | Reply) -> ScriptedSlurm:
    answers: dict[tuple[str, ...], str | Reply | Callable[[], str]] = {
        ("squeue", "--json"): jobs, ("squeue", "--steps"): steps, ("sinfo", "--json"): NODES_JSON}
    answers |= {tuple(k.split("_")): v for k, v in more.items()}
    return ScriptedSlurm(answers)


def launcher_on(slurm: ScriptedSlurm, tmp_path: Path) -> SlurmLauncher:
    state = SlurmState(slurm, poll_interval_s=0.0)  # type: ignore[arg-type]
    return SlurmLauncher(slurm, state, state_dir=tmp_path / "state")  # type: ignore[arg-type]


# --- (2) a trainer's words in a drain Reason --------------------------------------------


def test_an_ecc_line_naming_node1_in_node3s_drain_reason_leaves_node1_and_node3_as_slurm_has_them() -> None:
    """Recorded on the box (22.05): node3 drained with the attacker's line as its Reason,
    node1's slurmd killed (DOWN, not responding). Both forms the daemon reads say so: the
    attacker's fields stay inside node3's Reason."""
    text = fixture("scontrol-show-node-22.05-drain-reason-with-keys.txt")
    assert f"Reason={ATTACK} [root@" in text.splitlines()[2]
    for read in (lambda: parse.parse_nodes(text), lambda: parse.parse_nodes_json(NODES_JSON)):
        nodes = read()
        assert list(nodes) == ["node1", "node2", "node3"], "node3 is still listed"
        assert nodes["node1"] == parse.NodeInfo(name="node1", state="DOWN+NOT_RESPONDING", addr="10.77.1.11",
                                                reason="Not responding")
        assert nodes["node3"] == parse.NodeInfo(name="node3", state="IDLE+DRAIN", addr="10.77.1.13", reason=ATTACK)
        assert not nodes["node1"].usable and "DRAIN" in nodes["node3"].flags


def test_the_attackers_exact_line_on_a_node_line_written_by_hand_is_no_fields_either() -> None:
    line = (f"NodeName=node3 Arch=x86_64 NodeAddr=10.0.0.3 NodeHostName=n3 State=IDLE+DRAIN Partitions=train "
            f"CurrentWatts=0 AveWatts=0 Reason={ATTACK}")  # no stamp: the reason runs to the end
    node = parse.parse_nodes(line)
    assert node == {"node3": parse.NodeInfo(name="node3", state="IDLE+DRAIN", addr="10.0.0.3", reason=ATTACK)}
    kv = parse.parse_node_line(line)
    assert (kv["NodeName"], kv["NodeAddr"], kv["State"]) == ("node3", "10.0.0.3", "IDLE+DRAIN")


def test_a_reason_of_two_lines_puts_its_second_line_after_slurms_stamp_and_still_is_no_fields() -> None:
    """22.05 prints a Reason's later lines after the ``[user@time]`` stamp, where newer
    Slurm prints Comment= and the like (recorded: node2 drained with "line one\\n
    NodeName=node1 State=IDLE")."""
    text = fixture("scontrol-show-node-22.05-multiline-reason.txt")
    [node2] = parse.parse_nodes(text).values()
    assert (node2.name, node2.state, node2.addr) == ("node2", "IDLE+DRAIN", "10.77.1.12")
    assert node2.reason.startswith("line one [root@") and node2.reason.endswith("NodeName=node1 State=IDLE")
    js = parse.parse_nodes_json(fixture("sinfo-json-22.05-multiline-reason.json"))
    assert js["node2"].reason == "line one\nNodeName=node1 State=IDLE" and js["node1"].addr == "10.77.1.11"


def test_on_newer_slurm_only_the_keys_it_prints_after_a_reason_are_read_and_they_override_nothing() -> None:
    """SYNTHESIZED from src/api/node_info.c (after 22.05): Reason, its stamp, then
    Comment=, Extra=, InstanceId=, InstanceType=, ReservationName= when set. A stamp the
    trainer forged inside its reason comes before Slurm's own."""
    forged = "ECC [root@2026-01-01T00:00:00] Comment=x NodeName=node1 State=IDLE"
    line = (f"NodeName=node3 NodeAddr=10.0.0.3 State=MIXED+DRAIN CurrentWatts=n/a AveWatts=n/a "
            f"Reason={forged} [root@2026-11-22T08:59:15] Comment=rma ticket 7 Extra=rack=4 InstanceId=i-0abc "
            f"InstanceType=p5.48xlarge ReservationName=maint")
    kv = parse.parse_node_line(line)
    assert kv["Reason"] == forged
    assert (kv["NodeName"], kv["NodeAddr"], kv["State"]) == ("node3", "10.0.0.3", "MIXED+DRAIN")
    assert (kv["Comment"], kv["Extra"], kv["InstanceId"], kv["InstanceType"], kv["ReservationName"]) == (
        "rma ticket 7", "rack=4", "i-0abc", "p5.48xlarge", "maint")
    # A key Slurm never prints after a Reason is the reason's own text.
    kv = parse.parse_node_line("NodeName=n1 State=IDLE Reason=gpu gone [root@2026-11-22T08:59:15] NodeAddr=6.6.6.6")
    assert "NodeAddr" not in kv and kv["Reason"].endswith("NodeAddr=6.6.6.6")


def test_a_job_line_keeps_its_keys_after_reason_and_the_first_of_a_repeated_key() -> None:
    kv = parse.parse_key_values("JobId=7 JobState=RUNNING Reason=None Dependency=(null) ExcNodeList=node2 JobId=8")
    assert (kv["JobId"], kv["Reason"], kv["ExcNodeList"]) == ("7", "None", "node2")


def test_the_node_table_of_23_02_and_later_reads_its_state_list() -> None:
    doc = {"meta": {}, "errors": [], "nodes": [
        {"name": "gpu1", "address": "10.1.0.1", "state": ["IDLE", "DRAIN"], "reason": ATTACK},
        {"name": "gpu2", "address": "", "state": ["MIXED"], "reason": ""},
        {"name": "", "state": ["FUTURE"]},  # a blank dynamic node
    ]}
    nodes = parse.parse_nodes_json(json.dumps(doc), "scontrol --json")
    assert nodes == {"gpu1": parse.NodeInfo(name="gpu1", state="IDLE+DRAIN", addr="10.1.0.1", reason=ATTACK),
                     "gpu2": parse.NodeInfo(name="gpu2", state="MIXED", addr="gpu2", reason="")}


@pytest.mark.parametrize("text", ["", "{", '{"nodes": {}}', '{"sinfo": []}', '{"nodes": [{"name": "n1"}]}',
                                  '{"nodes": [{"name": "n1", "state": []}]}'])
def test_a_node_table_that_cannot_be_read_is_an_error(text: str) -> None:
    with pytest.raises(parse.SlurmParseError, match="sinfo --json"):
        parse.parse_nodes_json(text)


def test_sinfo_json_with_the_controller_down_is_an_error_not_an_empty_table() -> None:
    """Recorded: sinfo --json exits 0 with no nodes and an error when slurmctld is gone."""
    with pytest.raises(parse.SlurmParseError, match="sinfo --json reported an error: Unspecified error"):
        parse.parse_nodes_json(fixture("sinfo-json-22.05-controller-down.json"))


def test_the_daemon_reads_the_node_table_from_json_and_asks_the_same_way_after() -> None:
    slurm = slurm_of()
    state = SlurmState(slurm, poll_interval_s=0.0)  # type: ignore[arg-type]
    nodes = state.nodes()
    assert nodes is not None and nodes["node1"].addr == "10.77.1.11" and nodes["node3"].reason == ATTACK
    state.refresh()
    state.nodes()
    assert [a[:2] for a in slurm.ran] == [["sinfo", "--json"]] * 2, "one command a poll"


def test_without_sinfo_json_the_daemon_tries_scontrol_json_then_the_text_and_keeps_what_answered() -> None:
    text = fixture("scontrol-show-node-22.05-drain-reason-with-keys.txt")
    slurm = ScriptedSlurm({("sinfo", "--json"): failed("sinfo --json", "sinfo: unrecognized option '--json'"),
                           ("scontrol", "-o", "show", "node"): text})
    state = SlurmState(slurm, poll_interval_s=0.0)  # type: ignore[arg-type]
    nodes = state.nodes()
    assert nodes is not None and nodes["node1"].addr == "10.77.1.11" and nodes["node3"].reason == ATTACK
    assert [a[:2] for a in slurm.ran] == [["sinfo", "--json"], ["scontrol", "--json"], ["scontrol", "-o"]]
    state.refresh()
    state.nodes()
    assert [a[:2] for a in slurm.ran[3:]] == [["scontrol", "-o"]]

    newer = ScriptedSlurm({("scontrol", "--json", "show", "node"): json.dumps(
        {"errors": [], "nodes": [{"name": "n1", "address": "10.0.0.1", "state": ["IDLE"], "reason": ""}]})})
    nodes = SlurmState(newer, poll_interval_s=0.0).nodes()  # type: ignore[arg-type]
    assert nodes is not None and nodes["n1"].addr == "10.0.0.1"


def test_a_drain_reason_goes_to_slurm_as_one_bounded_line_of_printable_text() -> None:
    slurm = slurm_of(scontrol_update="")
    nodes = SlurmNodes(slurm, SlurmState(slurm, poll_interval_s=0.0), prefix="tsup-x")  # type: ignore[arg-type]
    said = f"training-supervisor: device: rank 1 printed: {ATTACK}\nNodeName=node2\tState=IDLE\x1b[2J\u202e" + "x" * 500
    nodes.drain("node3", said)
    [argv] = [a for a in slurm.ran if a[:2] == ["scontrol", "update"]]
    assert argv[:3] == ["scontrol", "update", "NodeName=node3"] and argv[3] == "State=DRAIN"
    reason = argv[4].removeprefix("Reason=")
    shown = ATTACK.replace("=", ":")  # no "=" in a Reason: nothing reads as a field after it
    assert reason.startswith(f"training-supervisor: device: rank 1 printed: {shown} NodeName:node2 State:IDLE [2J")
    assert len(reason) <= REASON_MAX and reason.endswith("...") and reason.isprintable()
    assert slurm_reason("operator: fan failure") == "operator: fan failure"
    assert slurm_reason("\n\t ") == "(no reason given)"
    assert "=" not in slurm_reason("loss=nan grad_norm=inf")


# --- (6) a NUL byte ---------------------------------------------------------------------


@pytest.mark.parametrize(("table", "complaint"), [
    ('[command]\nargv = ["python", "train.py\\u0000--evil"]\ncheckpoint_dir = "ck"', "command.argv[1]"),
    ('[command]\nargv = ["python"]\ncheckpoint_dir = "ck"\nenv = {A = "x\\u0000y"}', "command.env.A"),
    ('[command]\nargv = ["python"]\ncheckpoint_dir = "ck"\nenv = {"A\\u0000B" = "x"}', "command.env: key 'A\\x00B'"),
    ('[command]\nargv = ["python"]\ncheckpoint_dir = "ck\\u0000"', "command.checkpoint_dir"),
    ('[command]\nargv = ["python"]\ncheckpoint_dir = "ck"\ncwd = "/tmp/\\u0000"', "command.cwd"),
    ('[command]\nargv = ["python"]\ncheckpoint_dir = "ck"\nresume = ["--from", "{checkpoint}\\u0000"]',
     "command.resume[1]"),
    ('[command]\nargv = ["python"]\ncheckpoint_dir = "ck"\nsrun_args = ["--container-image=a\\u0000"]',
     "command.srun_args[0]"),
    ('[trainer]\nsteps = 5\n[trainer.checkpoint]\ndir = "/ck/\\u0000"', "trainer.checkpoint.dir"),
    ('[trainer]\nsteps = 5\n[health]\ninstance_type = "trn1.\\u0000"', "health.instance_type"),
])
def test_a_nul_byte_in_a_spec_is_refused_at_submit_naming_its_key(tmp_path: Path, table: str,
                                                                   complaint: str) -> None:
    path = tmp_path / "spec.toml"
    path.write_text(f'name = "nul"\n[resources]\nlauncher = "slurm"\n{table}\n')
    with pytest.raises(SpecError) as e:
        load_spec(path)
    assert str(e.value).startswith(f"{path}: {complaint}: holds a NUL byte"), str(e.value)


class _NoNodes:
    def nodes(self) -> dict[str, parse.NodeInfo]:
        return {}

    def jobs(self) -> dict[str, parse.JobInfo]:
        return {}

    def refresh(self) -> None:
        pass


@pytest.mark.parametrize("where", ["argv", "env"])
def test_a_nul_byte_in_a_slurm_launch_fails_the_attempt_for_good_instead_of_leaving_it_launching(
        tmp_path: Path, where: str) -> None:
    """Popen refuses a NUL byte with a ValueError. The launcher turns it into CannotExecute:
    the executor records the attempt's launch as failed and fatal (supervisor/effects/attempts.py),
    so the run fails once, rather than the attempt staying LAUNCHING and being started
    again every tick. Nothing is started."""
    launcher = SlurmLauncher(SlurmCommands(), _NoNodes(), state_dir=tmp_path)  # type: ignore[arg-type]
    spec = LaunchSpec(run_id="run-1", attempt=1, nodes=("node1",), ranks_per_node=1,
                      argv=("python", "train.py\0--evil") if where == "argv" else ("python",),
                      env={"X": "a\0b"} if where == "env" else {}, log_dir=tmp_path / "logs", marker="m",
                      allocation_info=json.dumps({"job": "7", "seq": 1}))
    with pytest.raises(CannotExecute, match="null byte") as e:
        launcher.start(spec)
    assert isinstance(e.value, LaunchError)
    assert launcher._children == {}, "no srun was started"


# --- (8) other users' jobs, steps and sruns ---------------------------------------------


def request(user: str | None = None, info: str | None = None) -> AllocationRequest:
    return AllocationRequest(run_id="run-1", count=2, minimum=2, held=(), drained=frozenset(), idle=(),
                             known=frozenset(), info=info, user=user)


def test_another_users_job_named_like_the_runs_allocation_is_not_adopted(tmp_path: Path) -> None:
    launcher = launcher_on(slurm := slurm_of(), tmp_path)
    name = f"{launcher.prefix}.run-1.1"
    slurm.answers[("squeue", "--json")] = squeue({"job_id": 66, "name": name, "user_id": SOMEONE})
    slurm.answers[("sbatch",)] = "67\n"
    grant = launcher.allocate(request())
    assert [a[0] for a in slurm.ran].count("sbatch") == 1, "a job of its own is submitted"
    assert json.loads(grant.info or "") == {"job": "67", "seq": 1, "uid": ME}
    assert slurm.scancels() == [], "and the other user's is left alone"


def test_the_owners_own_unrecorded_job_is_adopted_after_a_crash(tmp_path: Path) -> None:
    """The reason adoption by name exists: a daemon killed between sbatch and recording
    the job id finds its job again, and submits no second one."""
    launcher = launcher_on(slurm := slurm_of(), tmp_path)
    name = f"{launcher.prefix}.run-1.1"
    slurm.answers[("squeue", "--json")] = squeue({"job_id": 66, "name": name, "user_id": SOMEONE},
                                                 {"job_id": 68, "name": name, "user_id": ME})
    grant = launcher.allocate(request())
    assert "sbatch" not in [a[0] for a in slurm.ran]
    assert json.loads(grant.info or "")["job"] == "68" and grant.nodes == ("node2",), "node1 is down"


def test_a_recorded_job_id_that_is_now_another_users_is_neither_held_nor_cancelled(tmp_path: Path) -> None:
    """Job ids start again when slurmctld loses its state: the recorded id may name
    another user's job later."""
    launcher = launcher_on(slurm := slurm_of(squeue({"job_id": 5, "name": "theirs", "user_id": SOMEONE})),
                           tmp_path)
    info = json.dumps({"job": "5", "seq": 1, "uid": ME})
    grant = launcher.held("run-1", info)
    assert grant is not None and grant.nodes == () and "now someone else's" in grant.note
    assert json.loads(grant.info or "")["job"] is None
    assert launcher.release("run-1", info) is True
    assert slurm.scancels() == []


def test_release_cancels_the_runs_allocation_only_as_its_owner(tmp_path: Path) -> None:
    launcher = launcher_on(slurm := slurm_of(squeue({"job_id": 5, "name": "ours", "user_id": ME})), tmp_path)
    slurm.answers[("scancel",)] = ""
    assert launcher.release("run-1", json.dumps({"job": "5", "seq": 1, "uid": ME}))
    assert slurm.scancels() == [["scancel", f"--user={ME}", "5"]]


def test_stop_cancels_the_attempts_own_step_never_another_users_step_of_that_name(tmp_path: Path) -> None:
    launcher = launcher_on(slurm := slurm_of(), tmp_path)
    name = launcher.step_name("run-1", 1)
    slurm.answers[("squeue", "--steps")] = (f"66.0|node1|{SOMEONE}|{name}\n"  # another user's, listed first
                                            f"9.0|node9|{ME}|{name}\n"  # ours, in another allocation
                                            f"7.0|node[1-2]|{ME}|{name}\n")
    info = json.dumps({"job": "7", "step": name, "uid": ME, "srun_pid": 0, "srun_ct": 0.0, "ranks": [[0, "node1"]],
                       "log": str(tmp_path / "srun.log")})
    launcher.stop(info, force=True)
    assert slurm.scancels() == [["scancel", f"--user={ME}", "--signal=KILL", "7.0"]]


def test_another_users_step_of_the_attempts_name_does_not_keep_its_ranks_alive(tmp_path: Path) -> None:
    launcher = launcher_on(slurm := slurm_of(), tmp_path)
    name = launcher.step_name("run-1", 1)
    slurm.answers[("squeue", "--steps")] = f"66.0|node1|{SOMEONE}|{name}\n"
    info = json.dumps({"job": "7", "step": name, "uid": ME, "srun_pid": 0, "srun_ct": 0.0, "ranks": [[0, "node1"]],
                       "log": str(tmp_path / "srun.log")})
    assert [r.proc for r in launcher.observe(info)] == [ProcState.VANISHED]
    slurm.answers[("squeue", "--steps")] = f"7.0|node1|{ME}|{name}\n"
    assert [r.proc for r in launcher.observe(info)] == [ProcState.UNKNOWN]


def test_a_name_with_a_newline_forges_no_record_of_another_user(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """A medium of issue 37 (verified on the box): any user names a job or a step, and a
    newline in the name made squeue's text print a record of the attacker's choosing,
    with the victim's uid, our step's name and its job id: the attempt's ranks looked alive
    after its step had gone, and a stop cancelled whatever that record named. The name now
    sits between the poll's own frames: the forgery is one name, the attacker's, dropped."""
    launcher = launcher_on(slurm := slurm_of(), tmp_path)
    name = launcher.step_name("run-1", 1)
    monkeypatch.setattr("supervisor.slurm.state.secrets.token_hex", lambda n: "5eed5eed5eed5eed")
    forged = f"x\n7.0|node1|{ME}|{name}"
    slurm.answers[("squeue", "--steps")] = f"66.0|node1|{SOMEONE}|5eed5eed5eed5eed{forged}5eed5eed5eed5eed\n"
    info = json.dumps({"job": "7", "step": name, "uid": ME, "srun_pid": 0, "srun_ct": 0.0, "ranks": [[0, "node1"]],
                       "log": str(tmp_path / "srun.log")})
    assert [r.proc for r in launcher.observe(info)] == [ProcState.VANISHED]
    launcher.stop(info, force=True)
    assert slurm.scancels() == [], "no step of ours is listed: nothing to cancel"
    unframed = parse.parse_steps_text(f"66.0|node1|{SOMEONE}|{forged}\n", owners=True)
    assert ("7", ME) in [(x.job_id, x.user_id) for x in unframed], "what the old unframed poll read"


@pytest.fixture
def fake_srun() -> Iterator[Callable[..., subprocess.Popen[bytes]]]:
    """Start processes whose command line reads ``srun ARGS`` (a Python that sleeps)."""
    started: list[subprocess.Popen[bytes]] = []

    def start(*args: str, **kw: Any) -> subprocess.Popen[bytes]:
        p = subprocess.Popen(["srun", "-c", "import time; time.sleep(60)", *args], executable=sys.executable, **kw)
        started.append(p)
        wait_for(lambda: psutil.Process(p.pid).cmdline()[:1] == ["srun"], 10, "the fake srun")
        return p

    yield start
    for p in started:
        p.kill()
        p.wait()


def test_an_srun_of_another_job_or_user_is_not_taken_for_the_attempts(fake_srun: Any) -> None:
    flags = ("--jobid=7", "--job-name=tsup-x.run-1.a1")
    mine = fake_srun(*flags)
    assert find_srun("tsup-x.run-1.a1", "7", ME).pid == mine.pid  # type: ignore[union-attr]
    assert find_srun("tsup-x.run-1.a1", "8", ME) is None, "another allocation's"
    assert find_srun("tsup-x.run-1.a1", "7", SOMEONE) is None, "another user's"
    if ME == 0:  # a real other user's process, as on a shared login node
        mine.kill()
        mine.wait()
        theirs = fake_srun(*flags, user=65534, group=65534, extra_groups=[])
        time.sleep(0.2)
        assert psutil.Process(theirs.pid).uids().real == 65534
        assert find_srun("tsup-x.run-1.a1", "7", ME) is None


def test_a_nul_byte_that_reaches_a_slurm_launch_fails_the_run_once_instead_of_relaunching_every_tick(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The reconciler's whole path, on a scripted Slurm: a launch whose argv holds a NUL
    byte (one that got past the spec's check; here put there by hand) ends its attempt
    with the reason and fails the run, and nothing is launched again."""
    from supervisor.domain import AttemptState, RunState
    from supervisor.reconciler import Reconciler, ReconcilerConfig
    from supervisor.runfiles import trainer_cmd
    from supervisor.service import SupervisorService
    from supervisor.spec import parse_spec
    from supervisor.store import SqlStore
    from supervisor.telemetry.view import TelemetryView

    slurm = slurm_of()
    launcher = launcher_on(slurm, tmp_path)
    submitted: list[str] = []

    def sbatch() -> str:
        submitted.append("8")
        return "8\n"

    slurm.answers[("sbatch",)] = sbatch
    slurm.answers[("squeue", "--json")] = lambda: squeue(*[
        {"job_id": 8, "name": f"{launcher.prefix}.run-1.1", "user_id": ME, "nodes": "node[2-3]"}
        for _ in submitted])
    slurm.answers[("scontrol", "-o", "show", "partition")] = fixture("scontrol-show-partition-22.05.txt")
    slurm.answers[("scontrol", "-o", "show", "node")] = fixture("scontrol-show-node-22.05-drain-reason-with-keys.txt")
    slurm.answers[("scancel",)] = ""
    slurm.start_step = SlurmCommands().start_step  # type: ignore[attr-defined]  # Popen for real
    real_argv = trainer_cmd.attempt_argv
    monkeypatch.setattr(trainer_cmd, "attempt_argv", lambda *a: (*real_argv(*a), "--resume\0evil"))

    store = SqlStore(tmp_path / "supervisor.db")
    store.open()
    nodes = SlurmNodes(slurm, launcher.state, prefix=launcher.prefix)  # type: ignore[arg-type]
    rec = Reconciler(store, TelemetryView(), ReconcilerConfig(mqtt_url=None), launcher=launcher, nodes=nodes)
    service = SupervisorService(store, tmp_path / "runs", allow_root_runs=True, mqtt_url=None, launcher=launcher,
                                check_trainer=False)
    try:
        service.submit(parse_spec({"name": "nul", "resources": {"launcher": "slurm", "nodes": 1},
                                   "command": {"argv": ["python", "train.py"], "checkpoint_dir": "ck"}}))
        for _ in range(8):
            rec.tick()
        with store.tx() as tx:
            run = tx.get_run(1)
            attempts = tx.list_attempts(1)
    finally:
        rec.close()
        store.close()
    assert [a.state for a in attempts] == [AttemptState.ENDED], "one attempt, never relaunched"
    assert attempts[0].launch_error is not None and "null byte" in attempts[0].launch_error
    assert run.state is RunState.FAILED, run
    assert launcher._children == {}

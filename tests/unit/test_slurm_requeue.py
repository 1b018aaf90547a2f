"""A run keeps its Slurm job (supervisor/slurm/allocation.py): a job left with too few
healthy nodes, or ended while Slurm still knows it, is requeued and started again with
its id, and a paused or failed run parks it; against a scripted Slurm whose squeue
answers were recorded on the box (tests/fixtures/slurm/)."""

from __future__ import annotations

import contextlib
import json
import signal
import subprocess
import threading
from pathlib import Path

from supervisor.errors import LaunchError
from supervisor.launchers.base import AllocationRequest, LaunchSpec
from supervisor.slurm import parse
from supervisor.slurm.commands import Reply
from supervisor.slurm.launcher import SlurmLauncher
from tests.unit.test_slurm_security import ME, fixture, launcher_on, slurm_of, squeue

# The scripted node table: node1 is down, node2 up, node3 drained; node4 is in no table (usable).
INFO = json.dumps({"job": "5", "seq": 1, "uid": ME})
ASKED = ("scontrol", "requeuehold", "5")  # a park


def request(info: str = INFO, drained: frozenset[str] = frozenset({"node1"})) -> AllocationRequest:
    """A run of 2 nodes and 1 spare that may not shrink."""
    return AllocationRequest(run_id="run-1", count=3, minimum=2, held=("node2",), drained=drained, idle=(),
                             known=frozenset(), info=info, user=None)


def scontrols(slurm: object) -> list[list[str]]:
    return [a for a in slurm.ran if a[0] == "scontrol"]  # type: ignore[attr-defined]


def test_the_recorded_restart_count_and_held_states_are_read_from_both_forms() -> None:
    jobs = parse.parse_squeue_json(fixture("squeue-22.05-requeued-held-and-begintime.json"))
    held, begin = jobs["2"], jobs["3"]
    assert (held.phase, held.held_by_owner, held.restarts) == (parse.JobPhase.WAITING, True, 2)
    assert (begin.phase, begin.reason, begin.restarts, begin.held_by_owner) == (
        parse.JobPhase.WAITING, "BeginTime", 1, False)
    assert jobs["1"].phase is parse.JobPhase.ENDED and jobs["1"].restarts == 3
    text = parse.parse_squeue_text(fixture("squeue-22.05-text-requeued.txt"), owners=True)
    assert text["2"].held_by_owner and text["2"].restarts is None and text["3"].reason == "BeginTime"


def test_a_requeued_job_still_ending_on_a_dead_node_is_waiting_not_ended() -> None:
    """Recorded on the box: a job requeued (held) right after its node2's slurmd was killed
    stays COMPLETING on node2 until Slurm declares node2 down."""
    for jobs in (parse.parse_squeue_json(fixture("squeue-22.05-requeue-completing-on-a-dead-node.json")),
                 parse.parse_squeue_text(fixture("squeue-22.05-text-requeue-completing.txt"), owners=True)):
        job = jobs["6"]
        assert (job.phase, job.finishing, job.held_by_owner, job.nodes) == (parse.JobPhase.WAITING, True, True, ())


def test_a_job_left_with_too_few_healthy_nodes_is_requeued_its_id_kept(tmp_path: Path) -> None:
    launcher = launcher_on(slurm := slurm_of(squeue({"job_id": 5, "name": "first", "user_id": ME,
                                                     "nodes": "node[1-2]"},
                                                    {"job_id": 67, "name": "g", "user_id": ME, "nodes": "node4"})),
                           tmp_path)
    slurm.answers[("scontrol",)] = ""
    info = json.dumps({"job": "5", "seq": 1, "uid": ME, "grow": ["67"], "grown": 1})
    grant = launcher.allocate(request(info))
    assert scontrols(slurm) == [["scontrol", "requeue", "5"]], "no update: Slurm refuses those of a resized job"
    assert grant.nodes == () and grant.note == "job 5 requeued (its id kept) for 3 node(s)"
    assert json.loads(grant.info or "") == {"job": "5", "seq": 1, "uid": ME, "grow": [], "grown": 1, "requeued": True}
    assert ["scancel", f"--user={ME}", "67"] in slurm.scancels(), "the first job asks for every node again"
    # Ending its steps on the nodes it held, it is waited for, not requeued again nor replaced
    # (squeue says COMPLETING, with no reason, as of a job that ends).
    slurm.answers[("squeue", "--json")] = squeue({"job_id": 5, "name": "first", "user_id": ME,
                                                  "job_state": "COMPLETING", "restart_cnt": 1})
    launcher.state.refresh()
    waiting = launcher.allocate(request(grant.info))
    assert waiting.note.startswith("job 5 requeued: Slurm is ending its steps") and len(scontrols(slurm)) == 1
    # Running again: no longer requeued.
    slurm.answers[("squeue", "--json")] = squeue({"job_id": 5, "name": "first", "user_id": ME, "nodes": "node[2,4]",
                                                  "restart_cnt": 1})
    launcher.state.refresh()
    assert "requeued" not in json.loads(launcher.allocate(request(grant.info)).info or "")
    assert not [a for a in slurm.ran if a[0] == "sbatch"], "no new job: a new id would lose the trainer's tree"
    assert slurm.users == [None] * len(slurm.users), "as the run's user (here the daemon's own)"


def test_a_requeued_job_is_not_requeued_again_on_an_answer_asked_before_the_requeue(tmp_path: Path) -> None:
    """squeue is polled off the reconciler's path: the answer the next tick reads may have
    been asked before the requeue, the job still running on the one healthy node it had.
    Taken at its word, the job was requeued twice (on the box, under load: its restart
    count 2, and the second requeue killed the attempt the first one's restart had begun)."""
    launcher = launcher_on(slurm := slurm_of(squeue({"job_id": 5, "name": "first", "user_id": ME,
                                                     "nodes": "node[1-2]"})), tmp_path)
    slurm.answers[("scontrol",)] = ""
    now = [100.0]
    launcher.state.clock = lambda: now[0]
    grant = launcher.allocate(request())
    assert scontrols(slurm) == [["scontrol", "requeue", "5"]]
    # The poller's answer asked a moment before the requeue (the job running on node1 and
    # node2) arrives after it; reads get the poller's last answers, as when it runs.
    now[0] = 99.5
    assert launcher.state.jobs()["5"].nodes == ("node1", "node2")  # type: ignore[index]
    now[0] = 101.0
    launcher.state._thread = threading.current_thread()
    again = launcher.allocate(request(grant.info))
    assert scontrols(slurm) == [["scontrol", "requeue", "5"]], "not requeued twice"
    assert again.nodes == () and again.note == "job 5 requeued: waiting for squeue to say so"
    # The poller's next answers, asked after the requeue: started again on node2 and node4.
    launcher.state._thread = None
    slurm.answers[("squeue", "--json")] = squeue({"job_id": 5, "name": "first", "user_id": ME,
                                                  "nodes": "node[2,4]", "restart_cnt": 1})
    launcher.state.refresh()
    assert launcher.allocate(request(grant.info)).nodes == ("node2", "node4")
    assert scontrols(slurm) == [["scontrol", "requeue", "5"]]


def test_the_sruns_of_a_job_are_killed_before_it_is_requeued(tmp_path: Path) -> None:
    """An srun that outlives its step ends it by number once KillWait has passed; the
    requeued job numbers its steps from 0 again, so that would be the restarted job's
    step (on the box, under load: attempt 2 killed 8 s in). Each srun of the job still
    running here is SIGKILLed before the requeue; another job's is left alone."""
    launcher = launcher_on(slurm := slurm_of(squeue({"job_id": 5, "name": "first", "user_id": ME,
                                                     "nodes": "node[1-2]"})), tmp_path)
    slurm.answers[("scontrol",)] = ""
    mine, other = (subprocess.Popen(["sh", "-c", "sleep 60", f"--jobid={job}"]) for job in ("5", "6"))
    try:
        launcher._children |= {mine.pid: mine, other.pid: other}
        launcher.allocate(request())
        assert scontrols(slurm) == [["scontrol", "requeue", "5"]]
        assert mine.wait(5) == -signal.SIGKILL
        assert other.poll() is None
    finally:
        other.kill()
        other.wait()


def test_a_held_job_is_released(tmp_path: Path) -> None:
    held = {"job_id": 5, "name": "first", "user_id": ME, "job_state": "PENDING", "nodes": "",
            "state_reason": "JobHeldUser", "restart_cnt": 1}
    launcher = launcher_on(slurm := slurm_of(squeue(held)), tmp_path)
    slurm.answers[("scontrol",)] = ""
    grant = launcher.allocate(request())
    assert scontrols(slurm) == [["scontrol", "release", "5"]]
    assert grant.nodes == () and grant.info == INFO and grant.note == "job 5 released"


def test_a_held_job_slurm_will_not_release_is_cancelled_and_requeued_which_needs_no_update(tmp_path: Path) -> None:
    """Slurm 22.05 without accounting storage refuses every update of a job it resized (a
    --no-kill job a node of which failed): "Job update not available right now, the DB
    index is being set", for good. scancel and requeue are no updates."""
    held = {"job_id": 5, "name": "first", "user_id": ME, "job_state": "PENDING", "nodes": "",
            "state_reason": "JobHeldUser", "restart_cnt": 1}
    launcher = launcher_on(slurm := slurm_of(squeue(held)), tmp_path)
    slurm.answers[("scontrol",)] = ""
    slurm.answers[("scontrol", "release")] = Reply(("scontrol", "release", "5"), False, "", "",
                                                   "exit 1: Job update not available right now, the DB index is "
                                                   "being set, try again in a bit for job 5")
    slurm.answers[("scancel",)] = ""
    grant = launcher.allocate(request())
    assert [a for a in slurm.ran if a[0] in ("scontrol", "scancel")] == [
        ["scontrol", "release", "5"], ["scancel", "5"], ["scontrol", "requeue", "5"]]
    assert grant.note == "job 5 cancelled and requeued (Slurm would not release it)"


def test_a_requeued_job_is_asked_once_to_start_now_not_after_the_credential_lifetime(tmp_path: Path) -> None:
    begin = {"job_id": 5, "name": "first", "user_id": ME, "job_state": "PENDING", "nodes": "",
             "state_reason": "BeginTime", "restart_cnt": 1}
    launcher = launcher_on(slurm := slurm_of(squeue(begin)), tmp_path)
    grant = launcher.allocate(request())
    assert slurm.fired == [["scontrol", "update", "JobId=5", "StartTime=now"]] and scontrols(slurm) == []
    assert json.loads(grant.info or "")["hurried"] == 1
    again = launcher.allocate(request(grant.info))
    assert len(slurm.fired) == 1 and again.note == "job 5 pending: BeginTime", "once a requeue, not every tick"


def test_a_job_the_supervisor_requeued_is_asked_to_start_now_whatever_its_reason(tmp_path: Path) -> None:
    """Requeued, a job may wait for the scheduler's next pass (its reason None): the update
    wakes it."""
    pending = {"job_id": 5, "name": "first", "user_id": ME, "job_state": "PENDING", "nodes": "",
               "state_reason": "None", "restart_cnt": 2}
    launcher = launcher_on(slurm := slurm_of(squeue(pending)), tmp_path)
    info = json.dumps({"job": "5", "seq": 1, "uid": ME, "requeued": True, "hurried": 1})
    grant = launcher.allocate(request(info))
    assert slurm.fired == [["scontrol", "update", "JobId=5", "StartTime=now"]]
    assert json.loads(grant.info or "")["hurried"] == 2


def test_a_queued_job_never_requeued_is_left_to_the_scheduler(tmp_path: Path) -> None:
    for reason in ("Resources", "BeginTime"):  # BeginTime: the user's own --begin
        waiting = {"job_id": 5, "name": "first", "user_id": ME, "job_state": "PENDING", "nodes": "",
                   "state_reason": reason, "restart_cnt": 0}
        launcher = launcher_on(slurm := slurm_of(squeue(waiting)), tmp_path)
        assert launcher.allocate(request()).note == f"job 5 pending: {reason}"
        assert scontrols(slurm) == []


def test_a_requeued_job_still_ending_is_waited_for(tmp_path: Path) -> None:
    finishing = {"job_id": 5, "name": "first", "user_id": ME, "job_state": "COMPLETING", "nodes": "node1",
                 "state_reason": "JobHeldUser", "restart_cnt": 1}
    launcher = launcher_on(slurm := slurm_of(squeue(finishing)), tmp_path)
    grant = launcher.allocate(request())
    assert scontrols(slurm) == [] and grant.nodes == ()
    assert grant.note.startswith("job 5 requeued: Slurm is ending its steps on the nodes it held")


def test_a_job_slurm_requeued_itself_meanwhile_is_taken_as_requeued(tmp_path: Path) -> None:
    """Its only node failed: Slurm requeued it (--requeue) before the supervisor could."""
    launcher = launcher_on(slurm := slurm_of(squeue({"job_id": 5, "name": "first", "user_id": ME,
                                                     "nodes": "node1"})), tmp_path)
    slurm.answers[("scontrol", "requeue")] = Reply(("scontrol", "requeue", "5"), False, "", "",
                                                   "exit 1: Job is pending execution for job 5")
    grant = launcher.allocate(request())
    assert json.loads(grant.info or "")["requeued"] and not [a for a in slurm.ran if a[0] == "sbatch"]


def test_a_job_that_ended_while_slurm_still_knows_it_is_requeued_not_replaced(tmp_path: Path) -> None:
    ended = {"job_id": 5, "name": "first", "user_id": ME, "job_state": "TIMEOUT", "nodes": "node[2,4]"}
    launcher = launcher_on(slurm := slurm_of(squeue(ended)), tmp_path)
    slurm.answers[("scontrol",)] = ""
    held = launcher.held("run-1", INFO)
    assert held is not None and held.nodes == () and held.info == INFO, "its id is kept"
    grant = launcher.allocate(request())
    assert scontrols(slurm) == [["scontrol", "requeue", "5"]]
    assert json.loads(grant.info or "")["job"] == "5"


def test_a_job_gone_from_squeue_is_replaced_by_a_new_one(tmp_path: Path) -> None:
    launcher = launcher_on(slurm := slurm_of(squeue()), tmp_path)
    slurm.answers[("sbatch",)] = "71\n"
    held = launcher.held("run-1", INFO)
    assert held is not None and json.loads(held.info or "")["job"] is None
    grant = launcher.allocate(request(held.info))
    assert json.loads(grant.info or "")["job"] == "71" and scontrols(slurm) == []
    argv = next(a for a in slurm.ran if a[0] == "sbatch")
    assert "--requeue" in argv and "--no-requeue" not in argv


def test_a_paused_or_failed_run_parks_its_job_requeued_and_held(tmp_path: Path) -> None:
    launcher = launcher_on(slurm := slurm_of(squeue({"job_id": 5, "name": "first", "user_id": ME,
                                                     "nodes": "node[2,4]"})), tmp_path)
    slurm.answers[("scontrol",)] = ""
    parked = launcher.park("run-1", INFO, None)
    assert parked.done and parked.info is not None and json.loads(parked.info)["job"] == "5"
    assert scontrols(slurm) == [list(ASKED)] and slurm.scancels() == []
    assert json.loads(parked.info)["requeued"], "it holds no node until a resume starts it again"


def test_a_queued_job_is_parked_by_holding_it_and_a_held_one_as_it_is(tmp_path: Path) -> None:
    queued = {"job_id": 5, "name": "first", "user_id": ME, "job_state": "PENDING", "nodes": "",
              "state_reason": "Resources"}
    launcher = launcher_on(slurm := slurm_of(squeue(queued)), tmp_path)
    slurm.answers[("scontrol",)] = ""
    assert launcher.park("run-1", INFO, None).info is not None
    assert scontrols(slurm) == [["scontrol", "hold", "5"]]
    launcher = launcher_on(slurm := slurm_of(squeue({**queued, "state_reason": "JobHeldUser"})), tmp_path)
    assert launcher.park("run-1", INFO, None).info is not None and scontrols(slurm) == []


def test_a_job_slurm_will_not_requeue_is_given_back_when_parked(tmp_path: Path) -> None:
    launcher = launcher_on(slurm := slurm_of(squeue({"job_id": 5, "name": "first", "user_id": ME,
                                                     "nodes": "node[2,4]"})), tmp_path)
    slurm.answers[("scontrol", "requeuehold")] = Reply(ASKED, False, "", "", "exit 1: Requested operation is "
                                                                         "presently disabled")
    slurm.answers[("scancel",)] = ""
    parked = launcher.park("run-1", INFO, None)
    assert parked.done and parked.info is None
    assert slurm.scancels() == [["scancel", f"--user={ME}", "5"]]


def test_an_ended_job_is_given_back_without_a_scancel(tmp_path: Path) -> None:
    launcher = launcher_on(slurm := slurm_of(squeue({"job_id": 5, "name": "first", "user_id": ME,
                                                     "job_state": "CANCELLED"})), tmp_path)
    assert launcher.release("run-1", INFO) and slurm.scancels() == []


def test_a_job_being_requeued_is_cancelled_when_its_run_ends(tmp_path: Path) -> None:
    """A requeue in progress shows as COMPLETING, as a job that ends does; left alone it
    would start again and hold nodes for a run that is over."""
    launcher = launcher_on(slurm := slurm_of(squeue({"job_id": 5, "name": "first", "user_id": ME,
                                                     "job_state": "COMPLETING", "restart_cnt": 1})), tmp_path)
    slurm.answers[("scancel",)] = ""
    assert launcher.release("run-1", json.dumps({"job": "5", "seq": 1, "uid": ME, "requeued": True}))
    assert slurm.scancels() == [["scancel", f"--user={ME}", "5"]]


def test_the_steps_get_the_jobs_restart_count(tmp_path: Path) -> None:
    """Slurm sets $SLURM_RESTART_COUNT in a batch script only; NxD Training's train_setup.sh
    keys its logs on it (logs/<job>/<restart>/<node>)."""
    running = {"job_id": 5, "name": "first", "user_id": ME, "nodes": "node[2,4]", "restart_cnt": 2}
    launcher = launcher_on(slurm := slurm_of(squeue(running)), tmp_path)
    started: list[dict[str, str]] = []

    def start_step(argv: list[str], *, env: dict[str, str], **_: object) -> object:
        started.append(env)
        raise OSError("recorded")

    slurm.start_step = start_step  # type: ignore[attr-defined]
    with contextlib.suppress(LaunchError):  # the recorded start fails on purpose
        launcher.start(LaunchSpec(run_id="run-1", attempt=2, nodes=("node2",), ranks_per_node=1, argv=("true",),
                                  env={}, log_dir=tmp_path / "attempts" / "2", marker="m", allocation_info=INFO))
    assert started and started[0]["SLURM_RESTART_COUNT"] == "2"


def test_the_ranks_of_a_node_slurm_declared_down_carry_its_word(tmp_path: Path) -> None:
    """A node that lost its power sends nothing; Slurm's DOWN (after SlurmdTimeout) is the
    word that it went (recorded node table: node1 down and not responding, node2 up)."""
    launcher = launcher_on(slurm_of(), tmp_path)
    info = json.dumps({"job": "7", "step": "s", "uid": ME, "srun_pid": 0, "srun_ct": 0.0,
                       "ranks": [[0, "node1"], [1, "node2"]], "log": str(tmp_path / "srun.log")})
    one, two = launcher.observe(info)
    assert (one.node_up, one.node_down) == (False, "Slurm set it DOWN+NOT_RESPONDING (Not responding)")
    assert (two.node_up, two.node_down) == (None, ""), "up: nothing said either way"


def test_a_stop_after_slurm_requeued_the_job_kills_the_old_srun_quietly(tmp_path: Path) -> None:
    """A requeued job numbers its steps from 0 again: the srun of the attempt its dead
    node ended, told to stop by SIGINT, would kill step 0 of the job's next incarnation,
    the next attempt's (seen on the box: the attempt after a power loss SIGKILLed 2 s in).
    Once the job is requeued under it, it gets SIGKILL, which makes it say nothing."""
    import subprocess
    import sys

    from supervisor.launchers.local_record import start_time_of

    def srun() -> subprocess.Popen[bytes]:
        """A stand-in srun that, as srun does, takes SIGINT whatever the signal mask it
        inherits (a worker of the suite may hold SIGINT blocked: its child then sleeps on
        through both), signalled once it runs its own program (a signal sent between fork
        and exec goes to the parent's handler, and exec forgets it)."""
        p = subprocess.Popen([sys.executable, "-c", "import signal, time; "
                              "signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT}); "
                              "signal.signal(signal.SIGINT, signal.default_int_handler); "
                              "print(flush=True); time.sleep(60)"], stdout=subprocess.PIPE)
        assert p.stdout is not None and p.stdout.readline()
        return p

    def info(p: subprocess.Popen[bytes]) -> str:
        return json.dumps({"job": "5", "step": "s", "uid": ME, "restarts": 0, "srun_pid": p.pid,
                           "srun_ct": start_time_of(p.pid), "ranks": [[0, "node1"]], "log": str(tmp_path / "l")})

    same = squeue({"job_id": 5, "name": "first", "user_id": ME, "restart_cnt": 0})
    again = squeue({"job_id": 5, "name": "first", "user_id": ME, "restart_cnt": 1})  # running again
    waiting = squeue({"job_id": 5, "name": "first", "user_id": ME, "restart_cnt": 1, "job_state": "PENDING",
                      "state_reason": "BeginTime", "nodes": ""})
    for jobs, signal_seen in ((same, -2), (again, -9), (waiting, -9)):
        launcher = launcher_on(slurm_of(jobs), tmp_path)
        p = srun()
        try:
            launcher.stop(info(p), force=True)
            assert p.wait(10) == signal_seen, jobs
        finally:
            p.kill()
            p.wait()


def agents_srun_of_job_5(launcher: SlurmLauncher, srun: subprocess.Popen[bytes], tmp_path: Path) -> str:
    """``srun`` as the node agents' srun of an attempt in job 5 (kept as start() keeps it),
    and that attempt's launch_info."""
    launcher._children[srun.pid] = srun
    return json.dumps({"job": "5", "step": "s", "uid": ME, "restarts": 0, "srun_pid": 0, "srun_ct": 0.0,
                       "ranks": [[0, "node1"]], "log": str(tmp_path / "l"), "agent_step": "s.agent",
                       "agents": [{"job": "5", "pid": srun.pid}]})


def test_the_node_agents_srun_of_a_requeued_job_is_killed_quietly_when_its_attempt_is_let_go(
        tmp_path: Path) -> None:
    """The same for the agents' step (seen on the box under load: the agents' srun, sent
    SIGTERM as its attempt was let go, signalled the next incarnation's steps once the dead
    node came back, and the next attempt's ranks and agent died 4 s in)."""
    import subprocess
    import sys

    same = squeue({"job_id": 5, "name": "first", "user_id": ME, "restart_cnt": 0})
    waiting = squeue({"job_id": 5, "name": "first", "user_id": ME, "restart_cnt": 1, "job_state": "PENDING",
                      "state_reason": "BeginTime", "nodes": ""})
    for jobs, signal_seen in ((same, -15), (waiting, -9)):
        launcher = launcher_on(slurm_of(jobs), tmp_path)
        agents = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        info = agents_srun_of_job_5(launcher, agents, tmp_path)
        try:
            launcher.forget(info)
            assert agents.wait(10) == signal_seen, jobs
        finally:
            agents.kill()
            agents.wait()


def test_an_agents_srun_still_waiting_after_its_attempt_was_let_go_is_killed_by_the_next_requeue(
        tmp_path: Path) -> None:
    """Seen on the box under load: the agents' srun, sent SIGTERM as its attempt was let go
    (its job not requeued yet), waits KillWait + 2 s for its step, then ends step 5.0 by
    number. The supervisor requeued the job 60 ms after the SIGTERM, and the restarted
    job's agents were step 5.0: 7 s after the requeue they were cancelled, and the next
    attempt's node was judged lost. A let-go srun that has not exited stays where the
    requeue finds it (``before_requeue``), which SIGKILLs it first."""
    import signal as signals
    import subprocess
    import sys

    same = squeue({"job_id": 5, "name": "first", "user_id": ME, "restart_cnt": 0})
    launcher = launcher_on(slurm_of(same), tmp_path)
    srun = subprocess.Popen([sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, "
                             "signal.SIG_IGN); print(flush=True); time.sleep(60)", "--jobid=5"],
                            stdout=subprocess.PIPE)
    assert srun.stdout is not None and srun.stdout.readline()  # its SIGTERM handler is set
    info = agents_srun_of_job_5(launcher, srun, tmp_path)
    try:
        launcher.forget(info)  # SIGTERM: it waits out its step
        assert srun.poll() is None
        launcher._kill_sruns_of("5")  # the allocation's before_requeue
        assert srun.wait(10) == -signals.SIGKILL
    finally:
        srun.kill()
        srun.wait()

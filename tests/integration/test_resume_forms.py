"""Each seed framework's resume form, end to end with a stand-in of its shape
(tests/standins/step_loop.py): the checkpoint to load named by step (NxD's
``--loading_step N``), left to the trainer's own search (``latest_if_exists``, NxD
Training's ``resume_if_exists``, the FSDP test case's directory), and a resume that comes
back at the wrong step.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import REPO, free_port, wait_for
from tests.e2e.conftest import Serve, command_spec, db_rows, summary_of, tsup

SCRIPT = str(REPO / "tests" / "standins" / "step_loop.py")
STEPS = 40


def never_failed() -> int:
    value = 0
    for step in range(1, STEPS + 1):
        value = (value * 31 + step) % 1_000_003
    return value


def run(tmp_path: Path, form: str, resume: list[str], *fault: str,
        env: dict[str, str] | None = None) -> tuple[dict[str, Any], Path, Path]:
    argv = [sys.executable, SCRIPT, "--form", form, "--steps", str(STEPS), "--checkpoint_dir", "{checkpoint_dir}",
            "--out", "{run_dir}/final.json", "--fault_dir", "{run_dir}", *fault]
    spec = command_spec(tmp_path / f"{form}.toml", form, argv, resume=resume, steps=STEPS, env=env or {},
                        resources={"nodes": 1, "ranks_per_node": 1}, policy={"failures_without_progress": 3},
                        **({"checkpoint_layout": "nemo"} if form == "nemo" else {}))
    state = tmp_path / "state"
    proc = tsup("run", spec, "--state-dir", state, "--json", timeout_s=300)
    return summary_of(proc), state / "runs" / "run-1", state


@pytest.mark.parametrize(("form", "resume"), [
    ("nxd", ["--loading_step", "{step}"]),  # the supervisor names the step
    ("nxd", ["--loading_step", "latest_if_exists"]),  # the trainer searches
    ("nemo", []),  # NxD Training: resume_if_exists, always on, in its version's directory
    ("fsdp", ["--resume_from_checkpoint={checkpoint_dir}"]),  # a directory to search
])
def test_a_crash_resumes_in_the_frameworks_own_form(tmp_path: Path, form: str, resume: list[str]) -> None:
    # NxD Training's version is the Slurm job's id, the same in every attempt of a run that
    # keeps its job; here, on local processes, one the spec sets.
    s, run_dir, _ = run(tmp_path, form, resume, "--crash_at", "25",
                        env={"NEMO_EXPM_VERSION": "the-job"} if form == "nemo" else None)
    assert s["state"] == "SUCCEEDED", s
    assert [a["resume_step"] for a in s["attempt_history"]] == [0, 20]
    final = json.loads((run_dir / "final.json").read_text())
    assert final == {"value": never_failed(), "started_at": 20}


def test_a_searching_trainer_finds_the_checkpoint_the_supervisor_chose(tmp_path: Path) -> None:
    """A NaN at step 30, printed after step 30's checkpoint was saved: the run goes back
    to step 20, and step 30's checkpoint is moved out of latest_if_exists's way."""
    s, run_dir, state = run(tmp_path, "nxd", ["--loading_step", "latest_if_exists"], "--nan_at", "30")
    assert s["state"] == "SUCCEEDED", s
    [fault] = s["faults"]
    assert fault["kind"] == "nonfinite" and fault["step"] == 30
    assert [a["resume_step"] for a in s["attempt_history"]] == [0, 20]
    [(message, data)] = db_rows(state, "SELECT message, data FROM events WHERE kind = 'checkpoint.set-aside'")
    assert "attempt 2 resumes from step_20: moved" in message and "step_30" in message
    moved = [Path(p).name for p in json.loads(data)["moved"]]
    assert "step_30" in moved and "step_20" not in moved
    assert (run_dir / "checkpoints" / ".set-aside" / "attempt-2" / "step_30" / "done").exists()
    assert json.loads((run_dir / "final.json").read_text()) == {"value": never_failed(), "started_at": 20}


def test_a_trainer_that_comes_back_at_the_wrong_step_fails_the_run_with_the_reason(tmp_path: Path) -> None:
    """The FSDP test case given the checkpoint itself where it searches a directory: its
    search finds nothing there, and it would train again from step 0."""
    s, _, _ = run(tmp_path, "fsdp", ["--resume_from_checkpoint={checkpoint}"], "--crash_at", "25")
    assert s["state"] == "FAILED", s
    crash, wrong = s["faults"]
    assert crash["kind"] == "rank-exit" and wrong["kind"] == "wrong-resume"
    assert "the trainer resumed at step 1, not after step 20" in wrong["summary"], wrong
    assert "command.resume" in s["reason"], s["reason"]


def test_nxd_training_in_a_version_directory_of_its_own_each_attempt_fails_the_run_saying_what_to_change(
        tmp_path: Path) -> None:
    """NxD Training resumes only from its own version's directory: started in another one
    (a new Slurm job, where the run's own could not be kept; here a new version per
    start), it trains from scratch, and the run stops naming the config key that fixes it.
    A resume would fail the same way while nothing the job reads changed: refused, unless
    forced; once the job changed, accepted."""
    script = tmp_path / "trainer.py"  # the job's own program, which its user may change
    script.write_text(Path(SCRIPT).read_text())
    argv = [sys.executable, str(script), "--form", "nemo", "--steps", str(STEPS), "--checkpoint_dir",
            "{checkpoint_dir}", "--out", "{run_dir}/final.json", "--fault_dir", "{run_dir}", "--crash_at", "25",
            "--step_sleep", "0.2"]  # steps the daemon sees
    spec = command_spec(tmp_path / "nemo.toml", "nemo", argv, steps=STEPS, checkpoint_layout="nemo",
                        precompile_inputs=[str(script)], resources={"nodes": 1, "ranks_per_node": 1})
    state = tmp_path / "state"
    s = summary_of(tsup("run", spec, "--state-dir", state, "--json", timeout_s=300))
    assert s["state"] == "FAILED", s
    crash, wrong = s["faults"]
    assert crash["kind"] == "rank-exit" and wrong["kind"] == "wrong-resume", s["faults"]
    assert "the trainer resumed at step 1, not after step 20" in wrong["summary"]
    assert "exp_manager.checkpoint_callback_params.dirpath" in s["reason"], s["reason"]

    daemon = Serve(state, free_port(), "--sweep-every", "0")
    try:
        refused = daemon.ctl("resume", "run-1")
        assert refused.returncode != 0 and "would fail again as attempt 2 did" in refused.stderr, refused
        assert str(script) in refused.stderr, "it names what the job reads"
        # Forced, it fails as predicted.
        assert daemon.ctl_json("resume", "run-1", "--force")["result"] == "accepted"
        again = wait_for(lambda: (d := daemon.read("status", "run-1"))["state"] == "FAILED"
                         and len(d["faults"]) == 3 and d, 120, "the forced resume to fail")
        assert again["faults"][-1]["kind"] == "wrong-resume", again["faults"]
        assert daemon.ctl("resume", "run-1").returncode != 0
        script.write_text(script.read_text() + "\n# the user's change\n")
        assert daemon.ctl_json("resume", "run-1")["result"] == "accepted", "the job changed: it may land now"
    finally:
        daemon.kill(15)


def test_a_long_compile_and_a_long_checkpoint_load_are_not_hangs(tmp_path: Path) -> None:
    """Neuron's compiler lines give the first attempt its compile allowance (12 s of them,
    with 5 s allowed before a first step and 4 s between steps); after a crash, a 9 s
    checkpoint load stays within the startup allowance. One fault: the crash."""
    argv = [sys.executable, SCRIPT, "--form", "nxd", "--steps", str(STEPS), "--checkpoint_dir", "{checkpoint_dir}",
            "--out", "{run_dir}/final.json", "--fault_dir", "{run_dir}", "--crash_at", "25", "--compile_s", "12",
            "--restore_s", "9"]
    spec = command_spec(tmp_path / "slow.toml", "slow", argv, resume=["--loading_step", "{step}"], steps=STEPS,
                        resources={"nodes": 1, "ranks_per_node": 1},
                        policy={"hang_timeout_s": 4, "hang_floor_s": 2, "startup_timeout_s": 10,
                                "compile_timeout_s": 60})
    s = summary_of(tsup("run", spec, "--state-dir", tmp_path / "state", "--json", timeout_s=300))
    assert s["state"] == "SUCCEEDED", s
    assert [f["kind"] for f in s["faults"]] == ["rank-exit"], s["faults"]
    assert [a["resume_step"] for a in s["attempt_history"]] == [0, 20]


def test_a_compile_past_its_allowance_is_a_hang(tmp_path: Path) -> None:
    """Compiler lines are a phase, not progress: 30 s of them against an 8 s allowance."""
    argv = [sys.executable, SCRIPT, "--form", "nxd", "--checkpoint_dir", "{checkpoint_dir}",
            "--out", "{run_dir}/final.json", "--fault_dir", "{run_dir}", "--compile_s", "30"]
    spec = command_spec(tmp_path / "stuck.toml", "stuck", argv, steps=STEPS, resources={"nodes": 1, "ranks_per_node": 1},
                        policy={"startup_timeout_s": 5, "compile_timeout_s": 8, "failures_without_progress": 1})
    s = summary_of(tsup("run", spec, "--state-dir", tmp_path / "state", "--json", timeout_s=300))
    assert s["state"] == "FAILED", s
    [hang] = s["faults"]
    assert hang["kind"] == "hang" and "(compile allowance 8 s)" in hang["summary"], hang

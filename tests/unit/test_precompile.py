"""The job's precompile pass (supervisor/runfiles/precompile.py): when it is due, how the policy runs
it as the run's first attempt, and what its steps do not count for."""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

import pytest

from supervisor.domain import (
    Attempt,
    AttemptOutcome,
    AttemptState,
    AttemptStats,
    BringBackCheckpoints,
    CheckpointRef,
    EndAttempt,
    EventKind,
    FaultKind,
    FaultRecord,
    FinishRun,
    MarkAttemptRunning,
    MarkFaultsRecovered,
    ProcState,
    RecordFault,
    RunState,
    SetRunState,
    StartAttempt,
    StepSample,
    TrainerResult,
)
from supervisor.domain.effects import Emit
from supervisor.goodput import account
from supervisor.policy import decide, resume_before
from supervisor.runfiles import precompile, trainer_cmd, user_tree
from supervisor.spec import RunSpec, SpecError, parse_spec
from tests.unit.policy_world import NOW, attempt, obs, of, rank, run, view

DUE = "f" * 64
CK = CheckpointRef(step=40, path="/ck/hf_llama--step=40-consumed_samples=320.0.ckpt")


def pre(number: int = 1, **kw: object) -> Attempt:
    """A precompile attempt, running since 10.0 with no step seen."""
    kw.setdefault("first_step_at", None)
    return attempt(number, precompile=DUE, **kw)


# --- the policy ---------------------------------------------------------------------


def test_a_due_precompile_pass_is_the_first_attempt_and_resumes_from_nothing() -> None:
    v = replace(view(run(RunState.PENDING), ck=CK),
                precompile_due=DUE)
    [start] = of(decide(v, None, NOW), StartAttempt)
    assert start == StartAttempt(number=1, nodes=("n1", "n2"), resume_from=None, resume_step=0, precompile=DUE)


def test_its_clean_exit_ends_it_then_the_runs_checkpoints_come_back_then_training_starts() -> None:
    done = obs(*(rank(i, ProcState.EXITED, exit_code=0, last_step=3) for i in range(4)),
               result=TrainerResult(final_step=None, model_digest=None))
    v = replace(view(run(RunState.STARTING), (pre(),)), precompile_due=DUE)
    effects = decide(v, done, NOW)
    [end] = of(effects, EndAttempt)
    assert (end.number, end.outcome) == (1, AttemptOutcome.SUCCEEDED)
    assert not of(effects, FinishRun), "the run is not over: it has not trained yet"
    assert [e.kind for e in of(effects, Emit) if e.kind is EventKind.PRECOMPILED]
    assert not of(effects, StartAttempt), "this tick's view saw no checkpoint: the run's are set aside"
    ended = pre(state=AttemptState.ENDED, outcome=AttemptOutcome.SUCCEEDED)
    effects = decide(replace(view(run(RunState.STARTING), (ended,)), precompile_aside=1), None, NOW)
    assert of(effects, BringBackCheckpoints) == [BringBackCheckpoints(number=1)]
    assert not of(effects, StartAttempt)
    [start] = of(decide(view(run(RunState.STARTING), (ended,), ck=CK), None, NOW), StartAttempt)
    assert (start.number, start.resume_from, start.resume_step, start.precompile) == (2, CK.path, 40, None)


def test_its_steps_are_not_training() -> None:
    """No first step marked, no run state RUNNING, no fault marked recovered."""
    v = view(run(RunState.RECOVERING), (pre(),), open_faults=1)
    effects = decide(v, obs(*(rank(i, last_step=5) for i in range(4))), NOW)
    assert not of(effects, MarkAttemptRunning) and not of(effects, MarkFaultsRecovered)
    assert not of(effects, SetRunState)


def test_its_hang_limit_is_the_compile_allowance_whatever_its_lines_say() -> None:
    r = run(RunState.STARTING)  # hang_timeout_s 60, startup_timeout_s 300, compile_timeout_s 7200
    quiet = [rank(i, last_step=2, progress_at=10.0, phase="train") for i in range(4)]
    assert not of(decide(view(r, (pre(started_at=10.0),)), obs(*quiet), 10.0 + 7000), RecordFault)
    [fault] = of(decide(view(r, (pre(started_at=10.0),)), obs(*quiet), 10.0 + 7300), RecordFault)
    assert fault.kind is FaultKind.HANG and "compile allowance 7200 s" in fault.summary


def test_a_non_finite_loss_or_a_spike_in_it_is_no_fault() -> None:
    r = run(RunState.STARTING)
    recent = tuple(StepSample(step=s, loss=1.0 if s < 20 else 500.0, grad_norm=1.0, first_sample=s)
                   for s in range(1, 30))
    for poisoned in ({"nonfinite_step": 3}, {}):
        ranks = [rank(i, last_step=29, **poisoned) for i in range(4)]
        assert not of(decide(view(r, (pre(),)), obs(*ranks, recent=recent), NOW), RecordFault)
        [fault] = of(decide(view(r, (attempt(),)), obs(*ranks, recent=recent), NOW), RecordFault)  # training's
        assert fault.kind is (FaultKind.NONFINITE if poisoned else FaultKind.SPIKE)


def test_a_failed_pass_is_run_again_and_failures_without_progress_end_the_run() -> None:
    failed = [pre(i, state=AttemptState.ENDED, outcome=AttemptOutcome.FAILED, ended_at=NOW - 1000, final_step=9)
              for i in (1, 2)]
    v = replace(view(run(RunState.RECOVERING), tuple(failed), ck=CK), precompile_due=DUE)
    [start] = of(decide(v, None, NOW), StartAttempt)
    assert start.precompile == DUE, "9 steps of a precompile pass are no progress"
    third = pre(3, state=AttemptState.ENDED, outcome=AttemptOutcome.FAILED, ended_at=NOW - 1000, final_step=9)
    v = replace(view(run(RunState.RECOVERING), (*failed, third), ck=CK), precompile_due=DUE)
    [finish] = of(decide(v, None, NOW), FinishRun)
    assert finish.reason.startswith("no progress: 3 failed attempts in a row")


def test_a_rollback_after_a_nan_survives_a_precompile_pass_between() -> None:
    """Attempt 1 went NaN at step 30; attempt 2 was a precompile pass (train.sh changed):
    attempt 3 still resumes from before step 30."""
    nan = attempt(1, AttemptState.ENDED, outcome=AttemptOutcome.FAILED, ended_at=NOW - 100)
    compiled = pre(2, state=AttemptState.ENDED, outcome=AttemptOutcome.SUCCEEDED, ended_at=NOW - 10)
    fault = FaultRecord(id=1, run_number=7, attempt=1, kind=FaultKind.NONFINITE, ranks=(), nodes=(), step=30,
                        summary="", detected_at=NOW - 110, recovered_at=None)
    assert resume_before((nan, compiled), (fault,)) == 30
    v = replace(view(run(RunState.RECOVERING), (nan, compiled), ck=CheckpointRef(step=20, path="/ck/20")),
                faults=(fault,))
    [start] = of(decide(v, None, NOW), StartAttempt)
    assert (start.number, start.resume_step, start.precompile) == (3, 20, None)


# --- goodput ------------------------------------------------------------------------


def test_a_precompile_attempt_is_startup_time_and_rewinds_no_earlier_training() -> None:
    """Attempt 1 trains steps 1-10 (1 s each) from 0 to 12; attempt 2 precompiles from 12
    to 42 (its 3 steps reported); attempt 3 resumes at step 10 from 42 and trains to 55."""
    r = replace(run(RunState.SUCCEEDED), ended_at=55.0)

    def a(n: int, start: float, end: float, resume: int, **kw: object) -> Attempt:
        return Attempt(run_number=7, number=n, state=AttemptState.ENDED, nodes=("n1",), resume_from=None,
                       resume_step=resume, created_at=start, started_at=start, ended_at=end,
                       outcome=AttemptOutcome.SUCCEEDED, **kw)  # type: ignore[arg-type]

    attempts = [a(1, 0.0, 12.0, 0), a(2, 12.0, 42.0, 0, precompile=DUE), a(3, 42.0, 55.0, 10)]
    stats = {1: AttemptStats(attempt=1, steps=10, first_step=1, last_step=10, first_at=2.0, first_step_time_s=1.0,
                             last_at=11.0, step_time_s=10.0),
             2: AttemptStats(attempt=2, steps=3, first_step=1, last_step=3, first_at=40.0, first_step_time_s=0.1,
                             last_at=41.0, step_time_s=0.3),
             3: AttemptStats(attempt=3, steps=10, first_step=11, last_step=20, first_at=45.0,
                             first_step_time_s=1.0, last_at=54.0, step_time_s=10.0)}
    g = account(r, attempts, stats, [], {}, now=55.0)
    assert (g.kept_steps, g.lost_steps) == (20, 0)
    assert g.productive_s == pytest.approx(20.0)
    # attempt 1: 0 -> 1 (its first step began at 2 - 1); attempt 2: all of 12 -> 42; attempt 3: 42 -> 44
    assert g.startup_s == pytest.approx(1.0 + 30.0 + 2.0)


# --- the fingerprint ------------------------------------------------------------------


def spec_in(cwd: Path, **command: object) -> RunSpec:
    data = {"name": "nxdt", "resources": {"launcher": "slurm", "nodes": 1, "ranks_per_node": 2},
            "command": {"argv": ["./train.sh"], "launch": "node", "cwd": str(cwd), "checkpoint_dir": "/ck",
                        "env": {"COMPILE": "0"}, "precompile_env": {"COMPILE": "1"}, **command}}
    return parse_spec(data, "t.toml")


def test_the_fingerprint_follows_the_script_and_the_command_and_nothing_else(tmp_path: Path) -> None:
    script = tmp_path / "train.sh"
    script.write_text("#!/bin/sh\necho one\n")
    spec = spec_in(tmp_path)
    first = precompile.fingerprint(spec, tmp_path)
    assert precompile.fingerprint(spec, tmp_path) == first
    os.utime(script, (1, 1))  # touched, same content
    assert precompile.fingerprint(spec, tmp_path) == first
    script.write_text("#!/bin/sh\necho two\n")
    changed = precompile.fingerprint(spec, tmp_path)
    assert changed != first
    other = spec_in(tmp_path, env={"COMPILE": "0", "CONF_FILE": "hf_llama3_8B_config"})
    assert precompile.fingerprint(other, tmp_path) not in (first, changed)


def test_named_inputs_are_read_relative_to_cwd_and_a_missing_one_counts_as_its_absence(tmp_path: Path) -> None:
    (tmp_path / "conf").mkdir()
    config = tmp_path / "conf" / "hf_llama3_8B_config.yaml"
    spec = spec_in(tmp_path, precompile_inputs=["conf/hf_llama3_8B_config.yaml"])
    assert precompile.inputs(spec, tmp_path) == [config]
    missing = precompile.fingerprint(spec, tmp_path)
    config.write_text("trainer:\n  devices: 2\n")
    assert precompile.fingerprint(spec, tmp_path) != missing
    assert precompile.inputs(spec_in(tmp_path, argv=["python3", "x.py"]), tmp_path) == []


def test_a_sparse_file_named_many_ways_is_neither_read_by_each_name_nor_past_its_bound(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """H7 of issue 37: one sparse file named 300 ways took 13 s a tick (64 MiB read per
    name, the cache thrashed). Now the spec takes at most MAX_PRECOMPILE_INPUTS names, a
    file is read once per version whatever its names, and one over READ_MAX_BYTES is not
    read at all: its version stands for it."""
    with pytest.raises(SpecError, match="at most 32 items"):
        spec_in(tmp_path, precompile_inputs=[f"./{'.' if i % 2 else ''}/big" for i in range(300)])
    reads: list[Path] = []
    digest = precompile._file_digest
    monkeypatch.setattr(precompile, "_file_digest", lambda path: reads.append(path) or digest(path))
    big, small = tmp_path / "big", tmp_path / "small.yaml"
    with big.open("wb") as f:
        f.truncate(1 << 30)  # 1 GiB, sparse
    small.write_text("trainer:\n  devices: 2\n")
    names = [f"{'./' * i}big" for i in range(16)] + [f"{'./' * i}small.yaml" for i in range(16)]
    spec = spec_in(tmp_path, precompile_inputs=names)
    first = precompile.fingerprint(spec, tmp_path)
    assert precompile.fingerprint(spec, tmp_path) == first
    assert reads == [tmp_path / "small.yaml"], "the small file once, the big one never"
    os.utime(big, (5, 5))
    assert precompile.fingerprint(spec, tmp_path) != first, "an unread file still counts by its version"


def test_a_fifo_in_place_of_an_input_neither_blocks_nor_is_read(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "train.sh")
    digest = precompile.fingerprint(spec_in(tmp_path), tmp_path)
    assert len(digest) == 64


def test_due_until_an_attempt_of_the_same_inputs_succeeded() -> None:
    ok = pre(1, state=AttemptState.ENDED, outcome=AttemptOutcome.SUCCEEDED)
    failed = pre(1, state=AttemptState.ENDED, outcome=AttemptOutcome.FAILED)
    assert precompile.due(DUE, [failed]) == DUE
    assert precompile.due(DUE, [ok]) is None
    assert precompile.due("0" * 64, [ok]) == "0" * 64


def test_the_pass_runs_with_precompile_env_over_env(tmp_path: Path) -> None:
    spec = spec_in(tmp_path)
    assert trainer_cmd.attempt_env(spec, tmp_path)["COMPILE"] == "0"
    assert trainer_cmd.attempt_env(spec, tmp_path, precompile=True)["COMPILE"] == "1"


def test_a_precompile_env_with_an_unknown_placeholder_is_refused(tmp_path: Path) -> None:
    with pytest.raises(SpecError, match="precompile_env"):
        spec_in(tmp_path, precompile_env={"COMPILE": "{nope}"})


# --- the run's checkpoints, out of the pass's way ----------------------------------------


def nemo_checkpoint(directory: Path, version: str, step: int, content: str) -> Path:
    """An NxD Training save: <name>/<version>/checkpoints/<file name>.ckpt/ with its markers."""
    ck = directory / version / "checkpoints" / f"hf_llama3_70B--step={step}-consumed_samples={step * 8}.0.ckpt"
    (ck / "model").mkdir(parents=True)
    (ck / "model" / "dp_rank_00_tp_rank_00_pp_rank_00.pt").write_text(content)
    (ck / "checkpoint").write_text("")
    (ck / "done").write_text("")
    return ck


def test_the_runs_checkpoints_sit_out_the_pass_and_what_it_saved_is_set_aside(tmp_path: Path) -> None:
    directory, run_dir = tmp_path / "hf_llama", tmp_path / "run"
    run_dir.mkdir()
    mine = [nemo_checkpoint(directory, "41", 10, "run"), nemo_checkpoint(directory, "41", 20, "run")]
    recorded: list[precompile.Moves] = []
    moved = user_tree.LOCAL.keep_aside(directory, "nemo", 3, lambda moves: recorded.append(list(moves)))
    assert recorded[0] == [] and recorded[-1] == moved, "recorded before the first move, then after each"
    assert sorted(src for src, _ in moved) == sorted(mine) and not any(p.exists() for p in mine)
    assert list(run_dir.iterdir()) == [], "H2 of issue 37: nothing of the daemon's in the run's tree"
    attempts = [replace(pre(3, state=AttemptState.ENDED, outcome=AttemptOutcome.SUCCEEDED),
                        set_aside=precompile.moves_json(moved))]
    assert precompile.aside(attempts) == 3
    # the pass saves under a name of the run's own, and a newer one
    trial = [nemo_checkpoint(directory, "41", 20, "trial"), nemo_checkpoint(directory, "41", 30, "trial")]
    saved, back = user_tree.LOCAL.bring_back(directory, "nemo", 3, precompile.moves_of(attempts[0].set_aside or ""))
    assert sorted(saved) == sorted(trial) and sorted(back) == sorted(mine)
    assert [(p / "model" / "dp_rank_00_tp_rank_00_pp_rank_00.pt").read_text() for p in mine] == ["run", "run"]
    assert not trial[1].exists()
    kept = directory / ".set-aside" / "precompile-3" / "41" / "checkpoints"
    assert sorted(p.name for p in kept.iterdir()) == sorted(p.name for p in trial)
    assert precompile.aside([replace(attempts[0], set_aside=None)]) is None


def test_a_daemon_killed_half_way_through_bringing_them_back_finishes_the_job(tmp_path: Path) -> None:
    directory = tmp_path / "hf_llama"
    mine = [nemo_checkpoint(directory, "41", step, "run") for step in (10, 20)]
    moves = user_tree.LOCAL.keep_aside(directory, "nemo", 1, lambda _: None)
    src, dst = next((s, d) for s, d in moves if s == mine[0])
    dst.rename(src)  # the first came back, then the daemon died
    saved, back = user_tree.LOCAL.bring_back(directory, "nemo", 1, moves)
    assert saved == [] and back == [mine[1]]
    assert all((p / "done").exists() for p in mine)

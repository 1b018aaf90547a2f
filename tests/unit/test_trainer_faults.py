"""trainer.faults: parsing TSUP_FAULT and acting on it."""

from __future__ import annotations

from pathlib import Path

import pytest

from trainer import faults
from trainer.faults import SLOW_FACTOR, Fault, FaultPlan, InjectedFault
from wire.errors import EXIT_DEVICE_FAULT, DeviceFault, UsageError, exit_code_for


def test_parse() -> None:
    assert FaultPlan.from_env({}) == FaultPlan()
    assert FaultPlan.parse("hang@25, crash@3:1").faults == (
        Fault("hang", 25, None), Fault("crash", 3, 1))
    for bad in ("explode@3", "crash", "crash@x", "crash@3:y", "hang@-1"):
        with pytest.raises(UsageError, match="TSUP_FAULT"):
            FaultPlan.parse(bad)


def test_crash_fires_on_its_step_and_rank_only() -> None:
    plan = FaultPlan.parse("crash@3:1")
    plan.after_step(2, rank=1)
    plan.after_step(3, rank=0)
    with pytest.raises(InjectedFault, match="after step 3 on rank 1"):
        plan.after_step(3, rank=1)


def test_nan_poisons_its_step_once_per_run(tmp_path) -> None:  # type: ignore[no-untyped-def]
    plan = FaultPlan.from_env({"TSUP_FAULT": "nan@60", "TSUP_FAULT_STATE": str(tmp_path / "fired")})
    assert not plan.poisons(59)
    assert plan.poisons(60)
    assert not plan.poisons(60), "a second rank, or the rerun of step 60 in the next attempt"
    plan.after_step(60, rank=0)  # not an after-step fault: nothing happens
    assert FaultPlan.parse("nan@60").poisons(60) and FaultPlan.parse("nan@60").poisons(60)  # no marker dir


def test_slow_turns_the_node_of_its_rank_slow_for_the_rest_of_the_run(tmp_path) -> None:  # type: ignore[no-untyped-def]
    env = {"TSUP_FAULT": "slow@40:1", "TSUP_FAULT_STATE": str(tmp_path / "fired")}
    plan = FaultPlan.from_env(env)
    assert plan.slowdown(39, rank=1, node="b") == 1.0
    assert plan.slowdown(40, rank=0, node="a") == 1.0
    assert plan.slowdown(40, rank=1, node="b") == SLOW_FACTOR
    assert plan.slowdown(41, rank=2, node="b") == SLOW_FACTOR, "another rank of the slow node"
    # the next attempt: rank 1 now runs on node c, node b holds ranks 2 and 3
    again = FaultPlan.from_env(env)
    assert again.slowdown(50, rank=1, node="c") == 1.0
    assert again.slowdown(1, rank=3, node="b") == SLOW_FACTOR


def test_a_hold_holds_every_rank_of_the_first_attempt_at_its_step_and_no_later_attempt(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """hold@75 (added for the supervisor's kill-node@75): each rank of the attempt that
    first completes step 75 sleeps HOLD_S there, for the fault from outside to land; the
    attempt that resumes after it goes through."""
    slept: list[float] = []
    monkeypatch.setattr("trainer.faults.time.sleep", slept.append)
    env = {"TSUP_FAULT": "hold@75", "TSUP_FAULT_STATE": str(tmp_path / "fired"), "TSUP_ATTEMPT": "2"}
    first = FaultPlan.from_env(env)
    first.after_step(74, rank=0)
    assert slept == []
    first.after_step(75, rank=0)
    first.after_step(75, rank=3)  # another rank of the same attempt
    assert slept == [faults.HOLD_S, faults.HOLD_S]
    assert "holding after step 75" in capsys.readouterr().out
    FaultPlan.from_env(env | {"TSUP_ATTEMPT": "3"}).after_step(75, rank=0)
    assert slept == [faults.HOLD_S, faults.HOLD_S], "the next attempt does not hold again"


def test_device_fails_once_with_exit_code_4(tmp_path) -> None:  # type: ignore[no-untyped-def]
    plan = FaultPlan.from_env({"TSUP_FAULT": "device@50:1", "TSUP_FAULT_STATE": str(tmp_path / "fired")})
    plan.after_step(50, rank=0)
    with pytest.raises(DeviceFault, match="uncorrectable ECC error") as caught:
        plan.after_step(50, rank=1)
    assert exit_code_for(caught.value) == EXIT_DEVICE_FAULT == 4
    plan.after_step(50, rank=1)  # the rerun of step 50 on a repaired (or another) node


@pytest.mark.parametrize(("error", "code"), [
    (RuntimeError("CUDA error: uncorrectable ECC error encountered"), 4),
    (RuntimeError("nrt_execute failed: NRT_EXEC_HW_ERR_HBM_UE (1201)"), 4),
    (RuntimeError("CUDA error: out of memory"), 1),
    (ValueError("boom"), 1),
])
def test_exit_codes_of_errors_with_and_without_a_device_signature(error: Exception, code: int) -> None:
    assert exit_code_for(error) == code


def test_kill_in_save_sigkills_its_rank_once_per_run(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """In a child process (the fault SIGKILLs whoever calls it): the named rank dies at
    the save of its step, and a rerun of that save lives."""
    import subprocess
    import sys

    script = (
        "import sys\n"
        "from trainer.faults import FaultPlan\n"
        f"plan = FaultPlan.from_env({{'TSUP_FAULT': 'kill-in-save@40:1', 'TSUP_FAULT_STATE': {str(tmp_path)!r}}})\n"
        "plan.in_save(20, rank=1)\n"
        "plan.in_save(40, rank=0)\n"
        "plan.in_save(40, rank=1, report=lambda f, d: print('report:', f, d, flush=True))\n"
        "print('alive')\n"
    )
    first = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert first.returncode == -9 and "report: kill-in-save@40:1 rank 1 is killed (SIGKILL)" in first.stdout
    again = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert again.returncode == 0 and again.stdout.strip() == "alive", "once per run"


def test_storage_errors_are_recognised_inside_dcp_failures() -> None:
    import errno

    from torch.distributed.checkpoint.api import CheckpointException, _wrap_exception

    from trainer.checkpoint import _storage_error
    from wire.errors import EXIT_STORAGE_FULL, CheckpointStorageFull

    try:
        raise OSError(errno.ENOSPC, "No space left on device")
    except OSError as e:
        full = CheckpointException("save failed", {2: _wrap_exception(e)})
    found = _storage_error(full)
    assert found is not None and found.errno == errno.ENOSPC
    assert _storage_error(CheckpointException("save failed", {0: _wrap_exception(ValueError("x"))})) is None
    assert _storage_error(RuntimeError("wrapped")) is None
    # torch.save's zip writer, cut short by a full file system, keeps no errno (seen on a
    # 5 MB tmpfs): the same verdict.
    try:
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")
    except RuntimeError as e:
        short = CheckpointException("save failed", {0: _wrap_exception(e)})
    found = _storage_error(short)
    assert found is not None and found.errno == errno.ENOSPC and "unexpected pos 704" in str(found)
    assert exit_code_for(CheckpointStorageFull("no room")) == EXIT_STORAGE_FULL == 5


def test_a_tampered_checkpoint_changes_one_weight_of_a_copy_once_per_run(tmp_path: Path) -> None:
    import torch

    from trainer.checkpoint import _tampered
    from trainer.faults import FaultPlan

    plan = FaultPlan.from_env({"TSUP_FAULT": "tamper-ckpt@40", "TSUP_FAULT_STATE": str(tmp_path / "fired")})
    assert plan.tampers(40, 1) is None, "rank 0's shard by default"
    assert plan.tampers(30, 0) is None
    assert plan.tampers(40, 0) is not None
    assert plan.tampers(40, 0) is None, "once per run"
    state = {"b.weight": torch.zeros(3), "a.bias": torch.ones(2)}
    changed = _tampered(state)
    assert torch.equal(state["a.bias"], torch.ones(2)), "the live model is untouched"
    assert changed["a.bias"][0].item() == pytest.approx(1.001) and changed["a.bias"][1].item() == 1.0
    assert torch.equal(changed["b.weight"], state["b.weight"]), "one weight only"

"""trainer.faults: parsing TSUP_FAULT and acting on it."""

from __future__ import annotations

import pytest

from trainer.errors import UsageError
from trainer.faults import Fault, FaultPlan, InjectedFault


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

"""What observing hands the effects, one ``Observed`` per run each tick: the run as seen
(its ``RunView``, which the policy decides on, and the live attempt's observation) and the
``Facts`` the effects record with the decision."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from supervisor.domain import AttemptObs, Run, RunView
from supervisor.planning import TIER_MEMORY, TIER_PERSISTENT
from supervisor.policy.grants import GrantChanges
from supervisor.runfiles import trainer_cmd
from supervisor.runfiles.checkpoint_scan import Verdict
from supervisor.spec import RunSpec


@dataclass(slots=True, kw_only=True)
class Facts:
    """What observing learnt that the executor records with the decision."""

    grant: GrantChanges | None = None
    checkpoints: list[Verdict] = field(default_factory=list)  # the newest ok one, and newer failed ones
    out_of_range: list[Path] = field(default_factory=list)  # checkpoint directories no step column holds
    output_offsets: tuple[int, str] | None = None  # (attempt, how far its logs were read) to keep


@dataclass(slots=True, kw_only=True)
class Observed:
    """One run, as seen this tick."""

    run: Run
    spec: RunSpec | None  # None: the stored spec no longer validates (view.spec_error says why)
    run_dir: Path
    view: RunView
    obs: AttemptObs | None
    facts: Facts


def of_spec(spec: RunSpec) -> dict[str, Any]:
    """What decide() sees of the run's spec (RunView's fields)."""
    auto = (TIER_PERSISTENT,) * spec.auto_checkpoints + (TIER_MEMORY,) * spec.auto_memory_checkpoints
    return {"diagnose": spec.health.diagnose, "preflight": spec.health.preflight,
            "spare_probe_every_s": spec.health.spare_probe_every_s,
            "exit_codes": spec.exit_meanings, "data_skip_unit": spec.data_skip_unit,
            "resume_advice": trainer_cmd.resume_advice(spec), "auto_tiers": auto}

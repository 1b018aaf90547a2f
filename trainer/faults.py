"""Fault injection for tests and chaos drills, driven by one environment variable.

``TSUP_FAULT`` holds comma-separated faults ``ACTION@STEP`` or ``ACTION@STEP:RANK``
(all ranks when RANK is left out), acted on right after step STEP has completed (and
after its checkpoint, if one was due):

    hang@25        stop making progress but stay alive: the heartbeat thread keeps
                   reporting step 25, so only a step-progress timeout catches it
    crash@25:1     rank 1 raises InjectedFault: a caught error, exit code 1, Exit sent

Unset means no faults. A fault fires in whichever attempt completes STEP, so an attempt
that resumes from a checkpoint before STEP meets it again unless TSUP_FAULT is cleared.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass

from trainer.errors import UsageError

_ACTIONS = ("hang", "crash")


class InjectedFault(RuntimeError):
    """Raised by a ``crash`` fault."""


@dataclass(frozen=True, slots=True)
class Fault:
    action: str
    step: int
    rank: int | None  # None: every rank


@dataclass(frozen=True, slots=True)
class FaultPlan:
    faults: tuple[Fault, ...] = ()

    @classmethod
    def from_env(cls, environ: Mapping[str, str]) -> FaultPlan:
        spec = environ.get("TSUP_FAULT", "").strip()
        return cls.parse(spec) if spec else cls()

    @classmethod
    def parse(cls, spec: str) -> FaultPlan:
        faults = []
        for item in spec.split(","):
            action, _, where = item.strip().partition("@")
            step_text, _, rank_text = where.partition(":")
            try:
                step = int(step_text)
                rank = int(rank_text) if rank_text else None
            except ValueError:
                step = -1
                rank = None
            if action not in _ACTIONS or step < 0:
                raise UsageError(f"TSUP_FAULT: expected ACTION@STEP[:RANK] with ACTION one "
                                 f"of {', '.join(_ACTIONS)}, got {item!r}")
            faults.append(Fault(action, step, rank))
        return cls(tuple(faults))

    def after_step(self, step: int, rank: int) -> None:
        """Act on the faults planned for this step and rank (may never return)."""
        for fault in self.faults:
            if fault.step != step or fault.rank not in (None, rank):
                continue
            if fault.action == "crash":
                raise InjectedFault(f"injected crash after step {step} on rank {rank}")
            while True:  # hang: the training thread sleeps, the heartbeat thread goes on
                time.sleep(3600)

"""What every family of effects is handed: the daemon's parts (``Deps``), and the
decision's context while it is recorded (``Recording``) and then carried out (``Acting``)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol

from supervisor.domain import Attempt, DrainBudget, Run, RunState
from supervisor.domain.events import EventKind
from supervisor.effects.checkpoint_moves import CheckpointMoves
from supervisor.gathering.launch_specs import LaunchSpecs
from supervisor.gathering.observed import Observed
from supervisor.gathering.run_memory import RunMemory
from supervisor.launchers.base import Launcher, NodeAdmin
from supervisor.link_steps import LinkTest
from supervisor.store import SqlStore, Tx
from supervisor.telemetry.view import TelemetryView


class ProbeSubmitter(Protocol):
    """The probe scheduler (supervisor/probes.py), as the executor uses it."""

    sweep_args: tuple[str, ...]
    sweep_timeout_s: float

    def submit(self, *, run_number: int | None, kind: str, nodes: list[str], argv: tuple[str, ...],
               timeout_s: float, round_: int = 1, allocation_info: str | None = None,
               drained: Mapping[str, str] | None = None, command_id: int | None = None,
               links: LinkTest | None = None) -> None: ...


@dataclass(slots=True, kw_only=True)
class Deps:
    """The parts the handlers use. Building it does no I/O."""

    store: SqlStore
    launcher: Launcher
    nodes: NodeAdmin
    telemetry: TelemetryView
    probes: ProbeSubmitter
    memory: RunMemory  # the run's memory between ticks, read here for a run's spec (run_memory.py)
    launch_specs: LaunchSpecs
    clock: Callable[[], float]
    drain_budget: DrainBudget = field(default_factory=DrainBudget)
    moves: CheckpointMoves = field(init=False)

    def __post_init__(self) -> None:
        self.moves = CheckpointMoves(self.post_event, self.store)

    def post_event(self, run_number: int | None, kind: EventKind, message: str,
                   data: dict[str, object]) -> None:
        """An event recorded on its own, outside a decision's transaction."""
        with self.store.tx() as tx:
            tx.add_event(run_number, kind, message, dict(data), self.clock())


@dataclass(slots=True)
class Recording:
    """A decision being written, in one transaction. ``run`` is None for a decision about
    nodes alone (a probe round judged, an operator's node command); ``state`` is the run's
    state after the effects recorded so far; ``attempts`` the run's, as recorded so far."""

    tx: Tx
    now: float
    run: Run | None = None
    state: RunState | None = None
    attempts: dict[int, Attempt] = field(default_factory=dict)

    @property
    def number(self) -> int | None:
        return self.run.number if self.run is not None else None

    def of_run(self) -> Run:
        """The run whose decision this is; a run's effect in a decision about nodes is a bug."""
        if self.run is None:
            raise TypeError("a run's effect outside a run's decision")
        return self.run


@dataclass(frozen=True, slots=True)
class Acting:
    """A recorded decision being carried out. ``seen`` is None for a decision about nodes."""

    now: float
    seen: Observed | None = None
    attempts: dict[int, Attempt] = field(default_factory=dict)

    def of_run(self) -> Observed:
        """The run whose decision this is; a run's effect in a decision about nodes is a bug."""
        if self.seen is None:
            raise TypeError("a run's effect outside a run's decision")
        return self.seen


class Family:
    """The handlers of a family of effects: ``record`` writes an effect in the decision's
    transaction, ``act`` carries it out once that transaction committed. Each family names
    the effect types it handles in ``handles``; supervisor/effects/__init__.py builds the
    one table from them."""

    handles: ClassVar[tuple[type, ...]] = ()

    def __init__(self, deps: Deps) -> None:
        self.d = deps

    def record(self, r: Recording, e: Any) -> None:
        raise NotImplementedError

    def act(self, a: Acting, e: Any) -> None:
        raise NotImplementedError

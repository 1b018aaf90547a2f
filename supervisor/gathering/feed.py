"""Feed: what the telemetry view must know before observe reads it, told to it first.

The reconciler calls it for each run before observing (supervisor/reconciler.py), so that
observe only reads the view. It tells the view the live attempt's world size (a message
about a rank outside it is dropped), and, for a [command] trainer (one the supervisor did
not write, which sends no telemetry), reads what its ranks printed since the last tick,
as the run's user, and gives the view the steps, phases and fatal lines found there as
if the trainer had sent them (supervisor/gathering/output_progress.py).

How far the logs were read is the run's memory's (run_memory.py); every
``OFFSETS_EVERY_S`` the offsets are handed on, for the effects to keep in the store, so
that a restarted daemon reads on where this one was.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from supervisor.domain import Attempt, Run
from supervisor.gathering import output_progress
from supervisor.gathering.output_progress import AttemptOutput
from supervisor.gathering.run_memory import RunMemory
from supervisor.runfiles import trainer_cmd, user_tree
from supervisor.spec import RunSpec
from supervisor.telemetry.view import TelemetryView


@dataclass(frozen=True, slots=True)
class Fed:
    """What feeding the view found, for observe."""

    output: AttemptOutput | None = None  # a [command] trainer's output read so far
    offsets_to_keep: tuple[int, str] | None = None  # (attempt, how far its logs were read) for the store


NOTHING_FED = Fed()


class Feed:
    def __init__(self, telemetry: TelemetryView, memory: RunMemory) -> None:
        self.telemetry = telemetry
        self.memory = memory

    def feed(self, run: Run, live: Attempt | None, now: float) -> Fed:
        """Tell the view what it must know of ``run``'s live attempt this tick."""
        if live is None:
            return NOTHING_FED
        self.telemetry.expect(run.run_id, live.number, len(live.nodes) * run.ranks_per_node)
        spec, run_dir = self.memory.spec(run.number)
        if not isinstance(spec, RunSpec) or spec.command is None:
            return NOTHING_FED
        output = self._read_output(run, spec, run_dir, live, now) if live.launch_info is not None else None
        return Fed(output=output, offsets_to_keep=self._offsets_to_keep(live, now))

    def _read_output(self, run: Run, spec: RunSpec, run_dir: Path, live: Attempt,
                     now: float) -> AttemptOutput:
        """Steps and fatal errors in a [command] trainer's output since the last tick; the
        steps go to the telemetry view, as if the trainer had sent them."""
        assert spec.command is not None
        memory = self.memory.attempt(run.number, live.number)
        state = memory.output
        tree = user_tree.of_present(spec.user)  # its logs are read as the run's user
        if tree is None:
            return state
        if not memory.output_resumed:  # a daemon restarted under it reads on where the last one was
            memory.output_resumed = True
            if live.output_offsets:
                state.resume(live.output_offsets)
        formats = output_progress.formats_for(spec.command.progress_pattern)
        for read in output_progress.read_output(
                state, trainer_cmd.attempt_dir(run_dir, live.number), run_id=run.run_id, attempt=live.number,
                ranks_per_node=run.ranks_per_node, formats=formats, now=now, base=run_dir.parent,
                reader=tree):
            self.telemetry.apply_from_output(read.msg, now, printed=read.printed,
                                             record=live.precompile is None)
        for rank, phase in state.phases.items():
            self.telemetry.phase_from_output(run.run_id, live.number, rank, phase, now)
        return state

    def _offsets_to_keep(self, live: Attempt, now: float) -> tuple[int, str] | None:
        """The offsets read so far, to keep in the store: every OFFSETS_EVERY_S, when they moved."""
        memory = self.memory.attempt(live.run_number, live.number)
        kept_at, kept = memory.offsets_kept
        offsets = memory.output.offsets()
        if offsets == kept or now - kept_at < output_progress.OFFSETS_EVERY_S:
            return None
        memory.offsets_kept = (now, offsets)
        return live.number, json.dumps(offsets, separators=(",", ":"))

"""Checkpoints moved out of a trainer's way, and back: the executor's moves in a run's
checkpoint directory, each said as a ``checkpoint.set-aside`` event.

- ``go_back_to``: an operator's ``resume --from-step N``: every newer checkpoint goes into
  ``.set-aside/resume-<run>-<time>/``, so that this resume and every later one goes on
  from step N;
- ``clear_the_way``: before an attempt of a [command] trainer that picks its checkpoint
  itself (its resume arguments name a directory, or nothing: NxD Training takes the
  newest ``*.ckpt`` of its version by mtime, complete or not), every checkpoint newer
  than the chosen one, a torn one too, goes into ``.set-aside/attempt-<n>/``;
- ``keep_aside_for_pass`` and ``bring_back``: the run's checkpoints sit out the job's
  precompile pass, and what the pass saved is set aside when it ends
  (supervisor/runfiles/precompile.py).

Nothing is deleted, and every move is made by the run's user (supervisor/runfiles/user_tree.py):
what it makes to hold the checkpoints is the user's, and a link planted below the
checkpoint directory reaches only what that user could reach alone.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

from supervisor.domain import Run, StartAttempt
from supervisor.domain.events import EventKind
from supervisor.errors import CannotExecute
from supervisor.runfiles import precompile, trainer_cmd, user_tree
from supervisor.runfiles.user_tree import SET_ASIDE
from supervisor.spec import RunSpec
from supervisor.store import SqlStore

log = logging.getLogger(__name__)

PostEvent = Callable[[int | None, EventKind, str, dict[str, object]], None]


class CheckpointMoves:
    def __init__(self, post_event: PostEvent, store: SqlStore) -> None:
        self.post_event = post_event
        self.store = store  # where a precompile pass's moves are kept (never the run's tree)

    def _record_aside(self, run: Run, number: int, moves: precompile.Moves | None) -> None:
        text = None if moves is None else precompile.moves_json(moves)
        with self.store.tx() as tx:
            tx.update_attempt(run.number, number, set_aside=text)

    def go_back_to(self, run: Run, spec: RunSpec, run_dir: Path, step: int, now: float) -> None:
        """An operator's resume from the checkpoint of ``step``: every newer checkpoint is
        moved out of the way, so that this resume and every later one goes on from there."""
        directory = trainer_cmd.checkpoint_dir(spec, run_dir)
        layout = trainer_cmd.checkpoint_layout(spec)
        tree = user_tree.of(spec.user)
        keep, _ = tree.pick(directory, layout, before_step=step + 1)
        into = directory / SET_ASIDE / f"resume-{run.run_id}-{now:.0f}"
        moved = tree.set_aside(directory, layout, keep.path if keep else None, step + 1, into)
        if moved:
            names = ", ".join(src.name for src, _ in moved)
            self.post_event(run.number, EventKind.CHECKPOINT_SET_ASIDE,
                            f"resuming from step {step}: moved {names} into {moved[0][1].parent}",
                            {"from_step": step, "moved": [str(src) for src, _ in moved]})

    def clear_the_way(self, run: Run, spec: RunSpec, run_dir: Path, e: StartAttempt) -> None:
        """A [command] trainer that picks its checkpoint itself must find the one chosen
        for attempt ``e``: every newer one is moved out of its way first."""
        if spec.command is None or not spec.command.searches:
            return
        directory = trainer_cmd.checkpoint_dir(spec, run_dir)
        keep = Path(e.resume_from) if e.resume_from is not None else None
        moved = user_tree.of(spec.user).set_aside(directory, trainer_cmd.checkpoint_layout(spec), keep,
                                                  e.resume_step if keep is not None else 0,
                                                  directory / SET_ASIDE / f"attempt-{e.number}")
        if moved:
            names = ", ".join(src.name for src, _ in moved)
            start = keep.name if keep is not None else "scratch"
            self.post_event(run.number, EventKind.CHECKPOINT_SET_ASIDE,
                            f"attempt {e.number} resumes from {start}: moved {names} out of the trainer's "
                            f"way into {moved[0][1].parent}",
                            {"attempt": e.number, "moved": [str(src) for src, _ in moved]})

    def keep_aside_for_pass(self, run: Run, spec: RunSpec, run_dir: Path, number: int) -> None:
        """The run's checkpoints out of the way of its precompile pass, attempt ``number``."""
        directory = trainer_cmd.checkpoint_dir(spec, run_dir)
        moved = user_tree.of(spec.user).keep_aside(directory, trainer_cmd.checkpoint_layout(spec), number,
                                                   lambda moves: self._record_aside(run, number, moves))
        if moved:
            names = ", ".join(src.name for src, _ in moved)
            where = f"{SET_ASIDE}/before-precompile-{number}/"
            self.post_event(run.number, EventKind.CHECKPOINT_SET_ASIDE,
                            f"attempt {number} is the job's precompile pass: moved {names} out of its way "
                            f"(into {where}); they come back when it ends",
                            {"attempt": number, "moved": [str(src) for src, _ in moved]})

    def bring_back(self, run: Run, spec: RunSpec, run_dir: Path, number: int, set_aside: str) -> None:
        """The pass ``number`` has ended: what it saved set aside, the run's own back
        (``set_aside``: the moves that kept them out of its way)."""
        directory, layout = trainer_cmd.checkpoint_dir(spec, run_dir), trainer_cmd.checkpoint_layout(spec)
        try:
            saved, back = user_tree.of(spec.user).bring_back(directory, layout, number,
                                                             precompile.moves_of(set_aside))
            self._record_aside(run, number, None)
        except (OSError, ValueError, CannotExecute) as err:  # again next tick: nothing launches meanwhile
            log.warning("run %s: the checkpoints set aside for precompile attempt %d are not back yet: %s",
                        run.run_id, number, err)
            return
        if saved or back:
            said = f"what it saved ({', '.join(p.name for p in saved)}) set aside; " if saved else ""
            self.post_event(run.number, EventKind.CHECKPOINT_SET_ASIDE,
                            f"the precompile pass of attempt {number} has ended: {said}"
                            f"{len(back)} checkpoint(s) of the run back in place",
                            {"attempt": number, "moved": [str(p) for p in saved],
                             "back": [str(p) for p in back]})

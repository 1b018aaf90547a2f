"""Checkpoint names of the Neuron backend: NeuronX Distributed's own layout (pure).

``neuronx_distributed.trainer.save_checkpoint(dir, tag, ...)`` writes::

    <checkpoint.dir>/
        step_40/                tag "step_<N>", N not zero-padded (NxD's examples' form)
            checkpoint          written when the save begins
            model/ optim/       every rank's shards
            user_content.pt     what the trainer adds: step, consumed samples, last loss
            done                written once every rank has finished (async saves too)
        newest                  the newest tag (written before the data: never trusted here)

A checkpoint is complete when ``done`` is there; that is also the supervisor's rule for
the ``nxd`` layout (supervisor/runfiles/checkpoint_scan.py), so the run resumes from what the
trainer would pick itself. The trainer keeps ``checkpoint.keep`` of them
(NxD's ``num_kept_ckpts``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from trainer import checkpoint_layout as layout
from wire.files import nxd_step_of, nxd_tag

BEGIN_MARKER = "checkpoint"
DONE_MARKER = "done"


@dataclass(frozen=True, slots=True)
class CheckpointPaths:
    """Where one save's parts go."""

    directory: Path
    begin_marker: Path
    done_marker: Path
    model: Path
    optimizer: Path


def paths(root: Path, step: int) -> CheckpointPaths:
    directory = root / nxd_tag(step)
    return CheckpointPaths(directory=directory, begin_marker=directory / BEGIN_MARKER,
                           done_marker=directory / DONE_MARKER, model=directory / "model",
                           optimizer=directory / "optim")


def is_complete(path: Path) -> bool:
    return nxd_step_of(path.name) is not None and (path / DONE_MARKER).is_file()


def newest_complete(root: Path) -> Path | None:
    found = layout.complete_checkpoints(root, step_of=nxd_step_of, is_complete=is_complete)
    return found[-1][1] if found else None


def resolve_resume(request: str, root: Path) -> Path | None:
    """The checkpoint ``--resume`` names: ``auto`` (the newest complete one, or none),
    ``none``, or the path of a complete one (else UsageError: a retry cannot help)."""
    return layout.resolve_resume(request, root, step_of=nxd_step_of, is_complete=is_complete,
                                 expected=f"an NxD step_N directory with a {DONE_MARKER} marker")

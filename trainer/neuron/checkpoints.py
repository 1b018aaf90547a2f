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

from wire.errors import UsageError
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
    found = sorted((step, p) for p in root.iterdir()
                   if (step := nxd_step_of(p.name)) is not None and is_complete(p)) if root.is_dir() else []
    return found[-1][1] if found else None


def resolve_resume(request: str, root: Path) -> Path | None:
    """The checkpoint ``--resume`` names: ``auto`` (the newest complete one, or none),
    ``none``, or the path of a complete one (else UsageError: a retry cannot help)."""
    if request == "none":
        return None
    if request == "auto":
        return newest_complete(root)
    path = Path(request)
    if not is_complete(path):
        raise UsageError(f"--resume {request}: not a complete NxD checkpoint (expected a step_N "
                         f"directory with a {DONE_MARKER} marker)")
    return path

"""Find the newest complete checkpoint in a run's checkpoint directory.

The reference trainer's layout (trainer/checkpoint_layout.py):

    <dir>/step_00000040/           complete: committed by an atomic rename
        .metadata                  written by torch.distributed.checkpoint last
        trainer_meta.json          {"step": 40, ...}
        __0_0.distcp ...
    <dir>/.tmp-step_00000060/      a save in progress or cut short: never complete

A checkpoint is complete when its directory has the final name and holds a non-empty
``.metadata`` and a ``trainer_meta.json`` naming the same step, and verified when every
shard file beside them is non-empty. Candidates are tried newest first, so that a
newest checkpoint that fails verification falls back to the one before it.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

_STEP_DIR = re.compile(r"^step_(\d{8})$")


@dataclass(frozen=True, slots=True, kw_only=True)
class Verdict:
    step: int
    path: Path
    ok: bool
    why: str  # empty when ok


def inspect(path: Path) -> Verdict | None:
    """None when ``path`` is not a checkpoint of this layout at all (or vanished).

    The trainer deletes old checkpoints while we look, so a file that disappears
    mid-inspection means "not a checkpoint any more", never an error.
    """
    try:
        return _inspect(path)
    except FileNotFoundError:
        return None


def _inspect(path: Path) -> Verdict | None:
    m = _STEP_DIR.match(path.name)
    if m is None or not path.is_dir():
        return None
    step = int(m.group(1))

    def bad(why: str) -> Verdict:
        return Verdict(step=step, path=path, ok=False, why=why)

    metadata = path / ".metadata"
    if not metadata.is_file() or metadata.stat().st_size == 0:
        return bad("no .metadata (the save did not finish)")
    try:
        meta = json.loads((path / "trainer_meta.json").read_text())
    except (OSError, ValueError) as e:
        return bad(f"trainer_meta.json unreadable: {e}")
    if not isinstance(meta, dict) or meta.get("step") != step:
        return bad(f"trainer_meta.json names step {meta.get('step') if isinstance(meta, dict) else '?'}")
    empty = sorted(p.name for p in path.glob("*.distcp") if p.stat().st_size == 0)
    if empty:
        return bad(f"empty shard file(s): {', '.join(empty)}")
    return Verdict(step=step, path=path, ok=True, why="")


def scan(directory: Path) -> list[Verdict]:
    """Every checkpoint of this layout in ``directory``, newest first."""
    if not directory.is_dir():
        return []
    found = [v for p in directory.iterdir() if (v := inspect(p)) is not None]
    return sorted(found, key=lambda v: v.step, reverse=True)


def pick(directory: Path) -> tuple[Verdict | None, list[Verdict]]:
    """The newest checkpoint that passes verification, and the newer ones that failed."""
    rejected: list[Verdict] = []
    for v in scan(directory):
        if v.ok:
            return v, rejected
        rejected.append(v)
    return None, rejected

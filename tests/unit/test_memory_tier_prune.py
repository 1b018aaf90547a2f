"""The memory tier's pruning across attempts (issue 26, item 10): a new attempt's first
save deletes nothing of an earlier attempt (the supervisor may hold one of those on
record, its report of a newer one lost); once the new attempt has a whole save of its
own, the older attempts' saves go."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

from trainer.memory_tier import WHOLE, MemoryTier, save_dir_name


def saves(node_dir: Path) -> list[str]:
    return sorted(p.name for p in node_dir.iterdir())


def make(node_dir: Path, attempt: int, step: int, whole: bool = True) -> None:
    d = node_dir / save_dir_name(attempt, step)
    d.mkdir(parents=True)
    if whole:
        (d / WHOLE).touch()


def test_a_new_attempts_first_save_deletes_no_earlier_save(tmp_path: Path) -> None:
    make(tmp_path, 1, 10)
    make(tmp_path, 1, 20)  # whole, but its report was lost: the supervisor resumed from step 10
    tier = SimpleNamespace(node_dir=tmp_path, attempt=2)
    make(tmp_path, 2, 15, whole=False)
    MemoryTier._prune(tier, writing=15)  # type: ignore[arg-type]
    assert saves(tmp_path) == ["a0001-s00000010", "a0001-s00000020", "a0002-s00000015"]
    (tmp_path / save_dir_name(2, 15) / WHOLE).touch()
    make(tmp_path, 2, 20, whole=False)
    MemoryTier._prune(tier, writing=20)  # type: ignore[arg-type]
    assert saves(tmp_path) == ["a0002-s00000015", "a0002-s00000020"]

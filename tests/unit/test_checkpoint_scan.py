"""The completeness and verification rules of supervisor/checkpoint_scan.py."""

from __future__ import annotations

import json
from pathlib import Path

from supervisor.checkpoint_scan import Verdict, pick, scan


def newest(root: Path) -> Verdict | None:
    return pick(root)[0]


def make(root: Path, step: int, *, name: str | None = None, metadata: bool = True, meta_step: int | None = None,
         shards: tuple[int, ...] = (10, 10)) -> Path:
    d = root / (name or f"step_{step:08d}")
    d.mkdir(parents=True)
    if metadata:
        (d / ".metadata").write_bytes(b"x" * 8)
    (d / "trainer_meta.json").write_text(json.dumps({"step": meta_step if meta_step is not None else step}))
    for i, size in enumerate(shards):
        (d / f"__{i}_0.distcp").write_bytes(b"y" * size)
    return d


def test_newest_complete_wins(tmp_path: Path) -> None:
    make(tmp_path, 20)
    make(tmp_path, 40)
    assert newest(tmp_path).step == 40  # type: ignore[union-attr]


def test_save_in_progress_is_never_complete(tmp_path: Path) -> None:
    make(tmp_path, 20)
    make(tmp_path, 40, name=".tmp-step_00000040")
    make(tmp_path, 60, metadata=False)
    ref = newest(tmp_path)
    assert ref is not None and ref.step == 20
    [v60, v20] = scan(tmp_path)
    assert not v60.ok and "no .metadata" in v60.why and v20.ok


def test_newest_failing_verification_falls_back_to_the_previous(tmp_path: Path) -> None:
    make(tmp_path, 20)
    make(tmp_path, 40, shards=(10, 0))  # a truncated shard
    make(tmp_path, 60, meta_step=59)
    verdicts = scan(tmp_path)
    assert [(v.step, v.ok) for v in verdicts] == [(60, False), (40, False), (20, True)]
    assert "empty shard" in verdicts[1].why and "names step 59" in verdicts[0].why
    best, rejected = pick(tmp_path)
    assert best is not None and best.step == 20 and [v.step for v in rejected] == [60, 40]


def test_missing_directory_and_foreign_files_are_ignored(tmp_path: Path) -> None:
    assert newest(tmp_path / "absent") is None
    (tmp_path / "notes.txt").write_text("hi")
    (tmp_path / "step_12").mkdir()  # not 8 digits: not this layout
    assert scan(tmp_path) == []

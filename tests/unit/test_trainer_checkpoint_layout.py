"""trainer.checkpoint_layout: the completeness rule, resume choice and retention."""

from __future__ import annotations

from pathlib import Path

import pytest

from trainer import checkpoint_layout as layout
from wire.errors import CheckpointMismatch, UsageError
from wire.files import checkpoint_name, step_of

SHAPE = {"hidden_size": 64}


def meta(step: int, **changes: object) -> layout.TrainerMeta:
    fields = {"step": step, "consumed_samples": step * 8, "world_size": 2, "model": "tiny",
              "model_shape": SHAPE, "config_digest": "abc", "last_loss": 1.5}
    fields.update(changes)
    return layout.TrainerMeta(**fields)  # type: ignore[arg-type]


def make_checkpoint(root: Path, step: int, *, dcp: bool = True, trainer: bool = True,
                    name: str | None = None) -> Path:
    path = root / (name or checkpoint_name(step))
    path.mkdir(parents=True)
    (path / "__0_0.distcp").write_bytes(b"shard")
    if dcp:
        (path / ".metadata").write_bytes(b"dcp")
    if trainer:
        meta(step).write(path)
    return path


def test_names() -> None:
    assert checkpoint_name(20) == "step_00000020"
    assert step_of("step_00000020") == 20
    for not_a_checkpoint in ("step_20", "step_000000200", ".tmp-step_00000020", "x"):
        assert step_of(not_a_checkpoint) is None


def test_completeness_rule(tmp_path: Path) -> None:
    assert layout.is_complete(make_checkpoint(tmp_path, 10))
    assert not layout.is_complete(make_checkpoint(tmp_path, 20, dcp=False))
    assert not layout.is_complete(make_checkpoint(tmp_path, 30, trainer=False))
    assert not layout.is_complete(make_checkpoint(tmp_path, 40, name=".tmp-step_00000040"))
    assert not layout.is_complete(make_checkpoint(tmp_path, 50, name="step_50"))
    assert layout.complete_checkpoints(tmp_path) == [(10, tmp_path / "step_00000010")]


def test_resume_choice(tmp_path: Path) -> None:
    assert layout.resolve_resume("auto", tmp_path / "absent") is None
    make_checkpoint(tmp_path, 10)
    newest = make_checkpoint(tmp_path, 20)
    make_checkpoint(tmp_path, 30, dcp=False)  # incomplete: never chosen
    assert layout.resolve_resume("auto", tmp_path) == newest
    assert layout.resolve_resume("none", tmp_path) is None
    assert layout.resolve_resume(str(tmp_path / "step_00000010"), tmp_path) == (
        tmp_path / "step_00000010")
    with pytest.raises(UsageError, match="not a complete checkpoint"):
        layout.resolve_resume(str(tmp_path / "step_00000030"), tmp_path)


def test_commit_renames_and_replaces_an_abandoned_checkpoint_of_the_same_step(
        tmp_path: Path) -> None:
    old = make_checkpoint(tmp_path, 20)
    (old / "stale-marker").write_text("from an abandoned trajectory")
    tmp = make_checkpoint(tmp_path, 20, name=".tmp-step_00000020")
    final = layout.commit(tmp, 20)
    assert final == old and layout.is_complete(final)
    assert not (final / "stale-marker").exists()
    assert not tmp.exists()


def test_prune_keeps_the_newest_k_and_drops_leftovers(tmp_path: Path) -> None:
    for step in (10, 20, 30, 40):
        make_checkpoint(tmp_path, step)
    incomplete = make_checkpoint(tmp_path, 35, dcp=False)
    leftover = make_checkpoint(tmp_path, 50, name=".tmp-step_00000050", dcp=False)
    deleted = layout.prune(tmp_path, keep=2, committed_step=40)
    assert sorted(p.name for p in deleted) == ["step_00000010", "step_00000020"]
    assert [s for s, _ in layout.complete_checkpoints(tmp_path)] == [30, 40]
    assert not leftover.exists()
    assert incomplete.exists()  # not ours to judge: neither complete nor a .tmp- entry


def test_prune_drops_checkpoints_of_an_abandoned_future(tmp_path: Path) -> None:
    for step in (10, 20, 30, 40):
        make_checkpoint(tmp_path, step)
    # The run rolled back to step 10 and has just committed step 15.
    make_checkpoint(tmp_path, 15)
    layout.prune(tmp_path, keep=3, committed_step=15)
    assert [s for s, _ in layout.complete_checkpoints(tmp_path)] == [10, 15]


def test_meta_round_trip_and_compatibility(tmp_path: Path) -> None:
    written = meta(20)
    written.write(tmp_path)
    read = layout.TrainerMeta.read(tmp_path)
    assert read == written
    read.check_compatible(world_size=2, model="tiny", model_shape=SHAPE, reshard=False)
    read.check_compatible(world_size=4, model="tiny", model_shape=SHAPE, reshard=True)
    with pytest.raises(CheckpointMismatch, match="written by 2 ranks, this run has 4"):
        read.check_compatible(world_size=4, model="tiny", model_shape=SHAPE, reshard=False)
    with pytest.raises(CheckpointMismatch, match="holds model 'tiny'"):
        read.check_compatible(world_size=2, model="llama2-7b", model_shape=SHAPE, reshard=True)
    (tmp_path / layout.META_FILE).write_text("{not json")
    with pytest.raises(CheckpointMismatch, match="unreadable"):
        layout.TrainerMeta.read(tmp_path)

"""supervisor/user_files.py: how the daemon touches files in directories a run's user owns."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from supervisor import user_files
from supervisor.users import RunAs
from tests.conftest import require_root


def test_the_users_files_are_read_as_regular_files_only(tmp_path: Path) -> None:
    """The primitives themselves: a FIFO, a device link and an oversized file are refused
    at once (never blocking), a link below a trusted directory is never followed."""
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    (tmp_path / "zero").symlink_to("/dev/zero")
    (tmp_path / "big").write_bytes(b"x" * 100)
    for path in (fifo, tmp_path / "zero"):
        with pytest.raises(user_files.UnsafePath):
            user_files.read_text(path, 10)
    with pytest.raises(user_files.UnsafePath, match="more than the 10"):
        user_files.read_text(tmp_path / "big", 10)
    (tmp_path / "real").mkdir()
    (tmp_path / "hop").symlink_to(tmp_path / "real")
    with pytest.raises(user_files.UnsafePath, match="not a directory"):
        user_files.write_atomic(tmp_path, tmp_path / "hop" / "f.json", b"{}")
    assert not (tmp_path / "real" / "f.json").exists()


def test_a_hand_over_through_a_link_gives_nothing_away(tmp_path: Path) -> None:
    """A link where a directory to hand over should be fails the hand-over; its target keeps
    its owner (here: the link's target is not chowned, even to the same uid: nothing done)."""
    (tmp_path / "run").mkdir()
    target = tmp_path / "elsewhere"
    target.mkdir()
    (tmp_path / "run" / "attempts").symlink_to(target)

    class Nobody:
        uid, gid = 65534, 65534

    with pytest.raises(user_files.UnsafePath):
        user_files.hand_over(tmp_path, Nobody(), tmp_path / "run" / "attempts")
    assert target.stat().st_uid == os.geteuid()


def test_a_move_into_a_linked_set_aside_moves_nothing(tmp_path: Path) -> None:
    ck, outside = tmp_path / "ck", tmp_path / "outside"
    (ck / "step_20").mkdir(parents=True)
    outside.mkdir()
    (ck / ".set-aside").symlink_to(outside)
    with pytest.raises(user_files.UnsafePath):
        user_files.move_into(ck, ck / "step_20", ck / ".set-aside" / "attempt-2")
    assert (ck / "step_20").is_dir() and not any(outside.iterdir())


def test_a_planted_temporary_file_is_never_written_through(tmp_path: Path) -> None:
    """write_atomic's temporary file is its own (O_EXCL): one planted as a link is removed,
    never written through."""
    victim = tmp_path / "victim"
    victim.write_text("keep")
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / f".f.json.{os.getpid()}.tmp").symlink_to(victim)
    user_files.write_atomic(tmp_path, tmp_path / "d" / "f.json", b"{}")
    assert victim.read_text() == "keep" and (tmp_path / "d" / "f.json").read_text() == "{}"


def test_what_a_move_makes_in_a_users_tree_is_the_users(tmp_path: Path) -> None:
    """A medium of issue 37: .set-aside/ was root's in the user's tree, so its user could
    neither read nor delete what the daemon set aside there."""
    require_root("giving a directory away")
    owner = RunAs(name="someone", uid=4242, gid=4343, groups=(4343,), home="/")
    (tmp_path / "ck" / "step_10").mkdir(parents=True)
    moved = user_files.move_into(tmp_path, tmp_path / "ck" / "step_10", tmp_path / "ck" / ".set-aside" / "a", owner)
    assert moved.exists()
    for made in (tmp_path / "ck" / ".set-aside", tmp_path / "ck" / ".set-aside" / "a"):
        assert (made.stat().st_uid, made.stat().st_gid) == (4242, 4343), made
    assert (tmp_path / "ck").stat().st_uid == os.geteuid(), "what was there stays as it was"


def test_a_hard_link_below_the_daemons_directory_is_neither_read_nor_appended_to(tmp_path: Path) -> None:
    """A rank log that is a second name of another file (a hard link: where
    fs.protected_hardlinks is off, of any file at all) is not another file to the daemon."""
    base, logs = tmp_path / "runs", tmp_path / "runs" / "run-1" / "attempts" / "1"
    logs.mkdir(parents=True)
    secret = tmp_path / "shadow"
    secret.write_text("root's\n")
    os.link(secret, logs / "rank-0.log")
    with pytest.raises(user_files.UnsafePath, match="hard link"):
        user_files.read_bytes(logs / "rank-0.log", 100, base=base)
    with pytest.raises(user_files.UnsafePath, match="hard link"):
        user_files.open_append(base, logs / "rank-0.log")
    assert secret.read_text() == "root's\n"

"""wire/private_dir.py: what a rank keeps in /dev/shm (the memory tier's shards, the
node's slot file) is in a directory of its user's alone, which another user of the node
cannot make first (issue 26, item 11). The other user is a real second process, running
as nobody."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import require_root
from wire.errors import UsageError
from wire.private_dir import private_dir
from wire.slots import NodeSlots

NOBODY = 65534


@pytest.fixture
def shm() -> Iterator[Path]:
    """A directory every user may write, like /dev/shm (mode 1777)."""
    path = Path(tempfile.mkdtemp(prefix="tsup-shm-"))
    path.chmod(0o1777)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def as_nobody(*argv: str) -> None:
    require_root("starting a process of another user")
    subprocess.run(list(argv), check=True, user=NOBODY, group=NOBODY, capture_output=True)


def test_a_missing_directory_is_made_0700(shm: Path) -> None:
    made = private_dir(shm / f"tsup-memory-{os.geteuid()}" / "run-key")
    assert stat.S_IMODE(made.stat().st_mode) == 0o700
    assert stat.S_IMODE(made.parent.stat().st_mode) == 0o700


def test_a_directory_another_user_made_first_is_refused(shm: Path) -> None:
    """Before: the memory tier wrote the user's shards into it (readable by its maker), and
    the slot file was opened in a directory the other user controls."""
    squatted = shm / f"tsup-memory-{os.geteuid()}"
    as_nobody("mkdir", "-m", "0777", str(squatted))
    with pytest.raises(UsageError, match="owned by uid 65534"):
        private_dir(squatted / "run-key")
    assert not (squatted / "run-key").exists()


def test_a_link_another_user_planted_is_refused(shm: Path, tmp_path: Path) -> None:
    as_nobody("ln", "-s", str(tmp_path), str(shm / "tsup-slots-0"))
    with pytest.raises(UsageError, match="a link"):
        private_dir(shm / "tsup-slots-0")


def test_a_slot_file_in_a_squatted_directory_is_not_opened(shm: Path) -> None:
    """Another user pre-makes the node's slot directory and file, to write phases (a
    two-hour compile allowance) into the ranks' reports. The rank refuses it (its
    telemetry then publishes per rank)."""
    squatted = shm / f"tsup-slots-{os.geteuid()}"
    as_nobody("mkdir", "-m", "0777", str(squatted))
    as_nobody("sh", "-c", f"umask 0; : > {squatted}/tsup-run-1-1-n0.slots")
    with pytest.raises(PermissionError, match="owned by uid 65534"):
        NodeSlots(squatted / "tsup-run-1-1-n0.slots", rank=0, local_rank=0, local_world_size=1)


def test_an_own_directory_with_the_default_umask_is_made_private(shm: Path) -> None:
    old = shm / "mine"
    old.mkdir(mode=0o755)
    old.chmod(0o755)
    assert stat.S_IMODE(private_dir(old).stat().st_mode) == 0o700

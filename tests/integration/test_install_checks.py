"""scripts/only-root-writes, which install-controller and install-node run first: the
daemon (root, or its user with node rights) and the root node probe run the checkout's
code, so whoever may change it is root (issue 37, item 7)."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import REPO, require_root

CHECK = REPO / "scripts" / "only-root-writes"
NOBODY = 65534


@pytest.fixture
def tree() -> Iterator[Path]:
    """A checkout-like tree of root's, in a directory of root's (pytest's own are too)."""
    require_root("making files of root's and of others")
    base = Path(tempfile.mkdtemp(prefix="tsup-install-"))
    base.chmod(0o755)
    (base / "checkout" / "supervisor").mkdir(parents=True)
    (base / "checkout" / "supervisor" / "daemon.py").write_text("")
    (base / "checkout" / ".venv" / "bin").mkdir(parents=True)
    (base / "checkout" / ".venv" / "bin" / "python").symlink_to("/usr/bin/python3")
    try:
        yield base / "checkout"
    finally:
        shutil.rmtree(base)


def check(path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(CHECK), str(path)], capture_output=True, text=True, check=False, timeout=60)


def test_a_tree_of_roots_alone_passes_even_below_a_sticky_world_writable_directory(tree: Path) -> None:
    assert check(tree).returncode == 0, check(tree).stderr
    assert Path(tempfile.gettempdir()).stat().st_mode & 0o1002 == 0o1002, "the test needs /tmp sticky"


@pytest.mark.parametrize("change", ["file-of-another", "world-writable-file", "group-writable-dir",
                                    "parent-of-another", "parent-world-writable"])
def test_code_another_user_could_change_is_refused_and_named(tree: Path, change: str) -> None:
    target = {"file-of-another": tree / "supervisor" / "daemon.py",
              "world-writable-file": tree / "supervisor" / "daemon.py",
              "group-writable-dir": tree / "supervisor",
              "parent-of-another": tree.parent,
              "parent-world-writable": tree.parent}[change]
    if change in ("file-of-another", "parent-of-another"):
        os.chown(target, NOBODY, -1)
    elif change == "world-writable-file":
        target.chmod(0o666)
    elif change == "group-writable-dir":
        os.chown(target, 0, NOBODY)
        target.chmod(0o775)
    else:
        target.chmod(0o777)
    done = check(tree)
    assert done.returncode == 1 and str(target) in done.stderr, done.stderr


def test_install_controller_installs_nothing_from_a_checkout_others_may_change(tree: Path) -> None:
    shutil.copytree(REPO / "scripts", tree / "scripts")
    (tree / "supervisor").chmod(0o777)
    done = subprocess.run([str(tree / "scripts" / "install-controller"), "--etc", str(tree / "etc"), "--no-start"],
                          capture_output=True, text=True, check=False, timeout=60)
    assert done.returncode == 1 and "nothing installed" in done.stderr, done.stdout + done.stderr
    assert not (tree / "etc").exists() and not (tree / ".venv" / ".installed").exists()

"""supervisor/users.py: who a run executes as, the refusal of root, and whether a user
may write a checkpoint directory (from mode bits). No process is started."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from supervisor import users
from supervisor.errors import CannotExecute, SpecError
from supervisor.users import RunAs
from tests.conftest import require_root

NOBODY = users.lookup("nobody")


def test_the_spec_names_the_user_then_the_config_then_the_daemon() -> None:
    assert users.resolve("nobody", "root", allow_root=False, run_users=["nobody"]).name == "nobody"
    with pytest.raises(SpecError, match="may not execute as nobody: uid 65534 is a service account's"):
        users.resolve("nobody", "root", allow_root=False)  # nobody is nobody's person
    assert users.resolve(None, "nobody", allow_root=False).name == "nobody"
    assert users.resolve(None, None, allow_root=True) == users.daemon_user()


def test_a_run_as_root_is_refused_unless_the_config_allows_it() -> None:
    require_root("a daemon that runs as root")
    with pytest.raises(SpecError) as e:
        users.resolve(None, None, allow_root=False)
    assert str(e.value).startswith("user: this run would execute as root (the daemon runs as root and neither")
    with pytest.raises(SpecError, match=r"^user: this run would execute as root \(user names root\)"):
        users.resolve("root", None, allow_root=False)
    with pytest.raises(SpecError, match=r"\(run_as \(config\) names root\)"):
        users.resolve(None, "root", allow_root=False)
    assert users.resolve("root", None, allow_root=True).is_root


def test_an_unknown_user_is_named() -> None:
    with pytest.raises(SpecError, match=r"^user: no user 'no-such-user-x' on this host$"):
        users.resolve("no-such-user-x", None, allow_root=False)
    with pytest.raises(CannotExecute, match="cannot start the trainer as no-such-user-x"):
        users.for_launch("no-such-user-x")


def test_a_daemon_not_running_as_root_starts_runs_as_itself_only(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: NOBODY.uid)
    assert users.resolve(None, None, allow_root=False).name == "nobody"
    with pytest.raises(SpecError, match=r"^user: this daemon runs as nobody and can start trainers as nobody "
                                        r"only, not as root"):
        users.resolve("root", None, allow_root=True)
    assert users.popen_ids(users.lookup("nobody")) == (None, None, None), "nothing to switch"


def test_popen_ids_and_login_env_switch_to_another_user(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    assert users.popen_ids(NOBODY) == (NOBODY.uid, NOBODY.gid, list(NOBODY.groups))
    assert users.login_env(NOBODY) == {"HOME": NOBODY.home, "USER": "nobody", "LOGNAME": "nobody"}
    assert users.popen_ids(None) == (None, None, None) and users.login_env(None) == {}


@pytest.fixture
def open_dir() -> Iterator[Path]:
    """A directory every user can search (pytest's own are root's alone: 0700)."""
    path = Path(tempfile.mkdtemp(prefix="tsup-users-"))
    path.chmod(0o755)
    yield path
    shutil.rmtree(path)


def test_writable_by_reads_the_mode_bits_of_the_nearest_existing_directory(open_dir: Path) -> None:
    other = RunAs(name="other", uid=54321, gid=54321, groups=(54321,), home="/")
    member = RunAs(name="member", uid=54322, gid=54322, groups=(54322, 4242), home="/")
    tmp_path = open_dir
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o775)
    os.chown(shared, 0, 4242)
    shared.chmod(0o775)
    assert users.writable_by(shared / "ck" / "deeper", member), "its group may create there"
    assert not users.writable_by(shared / "ck", other), "others may not"
    shared.chmod(0o777)
    assert users.writable_by(shared / "ck", other)
    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    (private / "inner").mkdir(mode=0o777)
    assert not users.writable_by(private / "inner", other), "a directory on the way it cannot search"
    (tmp_path / "file").write_text("")
    assert users.writable_by(tmp_path / "private" / "inner", users.lookup("root")), "root may, always"
    assert not users.writable_by(tmp_path / "file", other), "not a directory"


def test_hand_over_gives_the_users_directories_and_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    require_root("chown")
    (tmp_path / "config.json").write_text("{}")
    users.hand_over(NOBODY, tmp_path, tmp_path / "run", tmp_path / "run" / "checkpoints", tmp_path / "config.json")
    for p in (tmp_path / "run", tmp_path / "run" / "checkpoints", tmp_path / "config.json"):
        assert (p.stat().st_uid, p.stat().st_gid) == (NOBODY.uid, NOBODY.gid), p


def test_a_spec_may_name_a_persons_account_or_one_run_users_lists(tmp_path: Path) -> None:
    person = RunAs(name="root", uid=1500, gid=1500, groups=(1500,), home="/")  # root's shell: a login one
    service = RunAs(name="root", uid=105, gid=105, groups=(105,), home="/")
    nobody = RunAs(name="root", uid=65534, gid=65534, groups=(), home="/")
    assert users.may_run_as(person, None) == ""
    assert "service account" in users.may_run_as(service, None)
    assert "service account" in users.may_run_as(nobody, None)
    assert users.may_run_as(service, ["root"]) == ""
    assert "not in run_users" in users.may_run_as(person, ["alice"])
    defs = tmp_path / "login.defs"
    defs.write_text("# comment\nUID_MIN\t\t 5000\n")
    assert users.uid_min(defs) == 5000
    assert users.uid_min(tmp_path / "missing") == 1000


def test_an_administrator_is_no_runs_user_unless_run_users_names_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """A medium of issue 37: members of sudo, wheel or docker, and the cloud images' default
    accounts, were accepted as a run's user: a write-token holder was root on every node."""
    import grp
    import pwd

    sudo = grp.getgrnam("sudo").gr_gid  # Debian's; the suite's machine has it
    admin = RunAs(name="root", uid=1500, gid=1500, groups=(1500, sudo), home="/")
    assert "it is in sudo" in users.may_run_as(admin, None)
    assert users.may_run_as(admin, ["root"]) == ""
    cloud = RunAs(name="ubuntu", uid=1000, gid=1000, groups=(1000,), home="/")
    real = pwd.getpwnam
    monkeypatch.setattr(pwd, "getpwnam", lambda name: real("root") if name == "ubuntu" else real(name))
    assert "cloud image's administrator account" in users.may_run_as(cloud, None)
    assert users.may_run_as(cloud, ["ubuntu"]) == ""


def test_a_run_may_not_execute_as_a_daemon_user_that_holds_node_admin_rights() -> None:
    """With slurm_admin_prefix, the daemon's user may drain nodes through sudo: a trainer
    running as it would inherit that (issue 26, item 4)."""
    me = users.daemon_user()
    with pytest.raises(SpecError, match="the daemon's own user, which may drain"):
        users.resolve(None, None, allow_root=True, admin_rights=True)
    assert users.resolve(None, None, allow_root=True, admin_rights=False) == me

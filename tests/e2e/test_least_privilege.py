"""Least privilege, with real users of this host: `serve` refuses a run that would
execute as root, starts a run as the user its spec names (the trainer processes are
that user's, read from /proc), and refuses a checkpoint directory that user cannot
write. On the Slurm box, the daemon itself runs as an unprivileged user: its runs
execute as that user, and it drains a lost node through the `sudo` rule the README
gives for a cluster without Slurm accounting."""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from slurmbox import box as box_mod
from slurmbox.box import Box
from supervisor import users
from supervisor.slurm import parse
from supervisor.users import RunAs
from tests.conftest import REPO, free_port, require, require_root, wait_for
from tests.e2e.conftest import EXAMPLE, Serve, serve_config, slurm, spec_for_slurm, trainer_processes

pytestmark = pytest.mark.e2e


@pytest.fixture
def open_dir() -> Iterator[Path]:
    """A directory other users can reach (pytest's own are root's alone: 0700)."""
    path = Path(tempfile.mkdtemp(prefix="tsup-lp-"))
    path.chmod(0o755)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def system_user(name: str, home_in: Path, *, service: bool = False) -> RunAs:
    """A real user of this host: a person's account (uid from UID_MIN, a login shell), or
    with ``service`` a service account (``useradd --system``, nologin)."""
    require("useradd", shutil.which("useradd") is not None)
    require_root("creating users")
    gone(name)  # one a killed run left
    kind = ["--system", "--shell", "/usr/sbin/nologin"] if service else ["--shell", "/bin/sh"]
    subprocess.run(["useradd", *kind, "--create-home", "--home-dir", str(home_in / name), name],
                   check=True, capture_output=True)
    return users.lookup(name)


def _dead(p: psutil.Process) -> bool:
    try:
        return p.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def remove_user(user: RunAs) -> None:
    gone(user.name)


def gone(name: str) -> None:
    """No user ``name`` on this host: its processes killed and reaped first (userdel
    refuses a user that still runs one), then the user deleted."""
    try:
        uid = pwd.getpwnam(name).pw_uid
    except KeyError:
        return
    procs = [p for p in psutil.process_iter(["uids"]) if p.info["uids"] and p.info["uids"].real == uid]
    for p in procs:
        with contextlib.suppress(psutil.Error):
            p.kill()
    # Dead, not reaped: psutil.wait_procs would wait out its timeout on a zombie that is not
    # this process's child (a worker the daemon started as the user, reaped by the daemon).
    wait_for(lambda: all(_dead(p) for p in procs), 20, f"{name}'s processes to die")
    deadline = time.monotonic() + 20  # a killed process's parent may take a moment to reap it
    while (done := subprocess.run(["userdel", name], capture_output=True, text=True, check=False)).returncode:
        assert time.monotonic() < deadline, f"userdel {name}: {done.stderr.strip()}"
        time.sleep(0.2)


@pytest.fixture
def alice(open_dir: Path) -> Iterator[RunAs]:
    user = system_user("tsup-alice", open_dir)
    try:
        yield user
    finally:
        remove_user(user)


def spec_as(spec: Path, user: str, out: Path, checkpoint_dir: Path | None = None) -> Path:
    """``spec`` with ``user = USER`` (and a checkpoint directory), written to ``out``."""
    text = spec.read_text().replace('name = "tiny-llama"\n', f'name = "tiny-llama"\nuser = "{user}"\n', 1)
    if checkpoint_dir is not None:
        text = text.replace("[trainer.checkpoint]\n", f'[trainer.checkpoint]\ndir = "{checkpoint_dir}"\n', 1)
    out.write_text(text)
    return out


def uids_of(procs: list[psutil.Process]) -> set[int]:
    return {p.uids().real for p in procs} | {p.uids().effective for p in procs}


def test_serve_refuses_root_runs_and_starts_a_run_as_the_user_its_spec_names(
        tmp_path: Path, open_dir: Path, alice: RunAs, fault_free: dict[str, Any]) -> None:
    state, port, shared = tmp_path / "state", free_port(), open_dir / "shared"
    shared.mkdir(mode=0o755)
    conf = serve_config(tmp_path / "config.toml", state, port, shared_dir=str(shared))
    daemon = Serve(state, port, config=conf, extra_env={"TSUP_ALLOW_ROOT_RUNS": "false"})
    try:
        refused = daemon.ctl("submit", str(EXAMPLE))
        assert refused.returncode != 0 and "this run would execute as root" in refused.stderr, refused.stderr
        private = state / "ck"  # under the daemon's state directory: root's alone
        elsewhere = spec_as(EXAMPLE, alice.name, tmp_path / "private-ck.toml", checkpoint_dir=private)
        refused = daemon.ctl("submit", str(elsewhere))
        assert refused.returncode != 0, refused.stdout
        assert f"trainer.checkpoint.dir: {private} is not writable by tsup-alice" in refused.stderr, refused.stderr

        spec = spec_as(EXAMPLE, alice.name, tmp_path / "alice.toml")
        run_id = daemon.ctl_json("submit", str(spec))["run_id"]
        wait_for(lambda: (daemon.read("status", run_id)["step"] or 0) >= 5, 120, "training as alice")
        ranks = trainer_processes(shared)
        assert len(ranks) == 4 and uids_of(ranks) == {alice.uid}, "every rank is alice's, none root's"
        final = wait_for(lambda: (d := daemon.read("status", run_id))["state"] in ("SUCCEEDED", "FAILED") and d,
                         240, "the run to end", interval_s=1.0)
        assert final["state"] == "SUCCEEDED" and final["model_digest"] == fault_free["model_digest"], final
        saved = list((shared / "runs" / run_id / "checkpoints").rglob("*"))
        assert saved and {p.stat().st_uid for p in saved} == {alice.uid}, "alice's checkpoints, in shared_dir"
        assert not (state / "runs").exists(), "nothing of the run in the daemon's private state"
    finally:
        daemon.kill(15)


# The shipped rule for a cluster without Slurm accounting: the daemon's user may run one
# root-owned helper (systemd/node-admin), which takes the daemon's node commands alone.
SUDOERS_FILE = REPO / "systemd" / "sudoers.training-supervisor"
SHIPPED_HELPER = "/usr/local/libexec/training-supervisor/node-admin"


class Helper:
    """systemd/node-admin installed root's in a directory of its own, as install-controller
    does, with the node-admin.conf the box needs (``configure``)."""

    def __init__(self, user: str) -> None:
        self.path = Path(f"/usr/local/libexec/tsup-test-{user}/node-admin")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.parent.chmod(0o755)
        shutil.copy(REPO / "systemd" / "node-admin", self.path)
        self.path.chmod(0o755)
        self.configure(None)

    def configure(self, slurm_conf: Path | None) -> None:
        scontrol = shutil.which("scontrol") or "/usr/bin/scontrol"
        conf = self.path.with_name("node-admin.conf")
        conf.write_text(f"scontrol = {scontrol}\nslurm_conf = {slurm_conf or ''}\n")
        conf.chmod(0o644)

    def rule(self, user: str) -> str:
        return "".join(line.replace("training-supervisor ALL", f"{user} ALL").replace(SHIPPED_HELPER, str(self.path))
                       if not line.startswith("#") else line
                       for line in SUDOERS_FILE.read_text().splitlines(keepends=True))


@pytest.fixture
def operator(open_dir: Path) -> Iterator[tuple[RunAs, Helper]]:
    """A dedicated user for the daemon, with the sudo rule for the node-admin helper."""
    require("sudo", shutil.which("sudo") is not None and shutil.which("visudo") is not None)
    user = system_user("tsup-op", open_dir)
    helper = Helper(user.name)
    rule = Path("/etc/sudoers.d/tsup-test-op")
    try:
        rule.write_text(helper.rule(user.name))
        rule.chmod(0o440)
        subprocess.run(["visudo", "-cf", str(rule)], check=True, capture_output=True)
        yield user, helper
    finally:
        rule.unlink(missing_ok=True)
        shutil.rmtree(helper.path.parent, ignore_errors=True)
        remove_user(user)


def test_on_the_box_the_daemon_runs_as_its_own_user_and_drains_through_sudo(
        slurm_box: Box, open_dir: Path, operator: tuple[RunAs, Helper], tmp_path: Path,
        fault_free: dict[str, Any]) -> None:
    """The daemon as `tsup-op` (not root), on the multi-host box: its run executes as
    tsup-op on the nodes (from /proc), survives a node killed mid-run (the drain goes
    through `sudo -n node-admin scontrol ...`), and ends with the fault-free model."""
    user, helper = operator
    helper.configure(slurm_box.conf)
    state, shared, port = open_dir / "state", open_dir / "shared", free_port()
    for d in (state, shared):
        d.mkdir()
        os.chown(d, user.uid, user.gid)
    conf = serve_config(open_dir / "config.toml", state, port, shared_dir=str(shared), launcher="slurm",
                        slurm_conf=str(slurm_box.conf), slurm_admin_prefix=["sudo", "-n", str(helper.path)],
                        runs_share_admin_rights=True)  # its runs execute as itself: one tenant
    daemon = Serve(state, port, config=conf, user=user, extra_env={"TSUP_ALLOW_ROOT_RUNS": "false"})
    try:
        assert psutil.Process(daemon.proc.pid).uids().real == user.uid, "the daemon is not root"
        run_id = daemon.ctl_json("submit", str(spec_for_slurm(tmp_path)))["run_id"]
        status = wait_for(lambda: (d := daemon.read("status", run_id))["step"] and d["step"] >= 20 and d,
                          240, "step 20 on the box")
        ranks = trainer_processes(shared)
        assert len(ranks) == 4 and uids_of(ranks) == {user.uid}, "every rank is tsup-op's, none root's"
        victim = status["attempt_history"][-1]["nodes"][1]
        assert box_mod.kill_node(slurm_box, victim)

        final = wait_for(lambda: (d := daemon.read("status", run_id))["state"] in ("SUCCEEDED", "FAILED") and d,
                         300, "the run to end", interval_s=1.0)
        assert final["state"] == "SUCCEEDED" and final["model_digest"] == fault_free["model_digest"], final
        assert final["drained_nodes"] == [victim]
        node = parse.parse_nodes(slurm(slurm_box, "scontrol", "-o", "show", "node", victim))[victim]
        assert "DRAIN" in node.flags and node.reason.startswith("training-supervisor:"), node
    finally:
        daemon.kill(15)


def may_sudo(user: RunAs, *argv: str) -> bool:
    """Whether ``user``'s sudo rules let it run ``argv`` as root (sudo -l: nothing runs)."""
    done = subprocess.run(["sudo", "-n", "-l", *argv], user=user.uid, group=user.gid, capture_output=True,
                          check=False, env={"PATH": "/usr/bin:/bin", "HOME": user.home})
    return done.returncode == 0


def as_user(user: RunAs, *argv: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(argv), user=user.uid, group=user.gid, capture_output=True, text=True, timeout=60,
                          check=False, env={"PATH": "/usr/bin:/bin", "HOME": user.home, **(env or {})})


def test_the_sudo_rule_admits_the_helper_alone_and_the_helper_the_daemons_node_commands_alone(
        slurm_box: Box, operator: tuple[RunAs, Helper], tmp_path: Path) -> None:
    """H3 of issue 37: the rule kept SLURM_CONF, and a root scontrol loads plugins from its
    slurm.conf's PluginDir (a planted auth_munge.so ran as uid 0); its regexes admitted
    NodeName=ALL State=RESUME, a MAINT reservation of every node for any user for 999999999
    minutes, and arguments after Reason=. Now sudo admits one root-owned helper, with no
    variable of the caller's, and the helper each of the daemon's forms whole, against the
    box's real scontrol. Before that, issue 26: the rule was all of scontrol."""
    user, helper = operator
    helper.configure(slurm_box.conf)
    scontrol = shutil.which("scontrol") or "/usr/bin/scontrol"
    assert may_sudo(user, str(helper.path), "scontrol", "update", "NodeName=node1", "State=RESUME")
    for direct in (["update", "NodeName=node1", "State=RESUME"], ["write", "batch_script", "5", "/etc/passwd"]):
        assert not may_sudo(user, scontrol, *direct), direct
    assert not may_sudo(user, shutil.which("scancel") or "/usr/bin/scancel", "5")
    planted = tmp_path / "slurm.conf"
    planted.write_text(slurm_box.conf.read_text() + "PluginDir=/nowhere\n")
    smuggled = as_user(user, "sudo", "-n", f"SLURM_CONF={planted}", str(helper.path), "scontrol", "update",
                       "NodeName=node1", "State=RESUME")
    assert smuggled.returncode != 0 and "not allowed to set" in smuggled.stderr, smuggled.stderr
    kept = as_user(user, "sudo", "-n", str(helper.path), "scontrol", "-o", "show", "node", "node1",
                   env={"SLURM_CONF": str(planted)})
    assert kept.returncode == 2 and "refused" in kept.stderr, "not a node command: refused"

    def helper_says(*argv: str) -> subprocess.CompletedProcess[str]:
        return as_user(user, "sudo", "-n", str(helper.path), "scontrol", *argv, env={"SLURM_CONF": str(planted)})

    for refused in (["update", "NodeName=ALL", "State=RESUME"], ["update", "NodeName=node[1-3]", "State=RESUME"],
                    ["update", "NodeName=node9", "State=RESUME"],
                    ["create", "reservation", "ReservationName=tsup-0a1b2c3d-probe", "Nodes=ALL", "Users=root",
                     "StartTime=now", "Duration=999999999", "Flags=MAINT,IGNORE_JOBS"],
                    ["create", "reservation", "ReservationName=tsup-0a1b2c3d-probe", "Nodes=node1", "Users=root",
                     "StartTime=now", "Duration=3", "Flags=MAINT,IGNORE_JOBS"],
                    ["update", "NodeName=node1", "State=DRAIN", "Reason=x", "NodeAddr=10.6.6.6"],
                    ["update", "NodeName=node1", "State=DRAIN", "Reason=x Weight=1"],
                    ["update", "NodeName=node1", "State=RESUME", "NodeAddr=1.2.3.4"],
                    ["update", "PartitionName=debug", "State=DOWN"], ["delete", "ReservationName=someone-elses"],
                    ["write", "batch_script", "5", "/etc/passwd"], ["cancel", "5"], ["shutdown"]):
        done = helper_says(*refused)
        assert done.returncode == 2 and "node-admin: refused" in done.stderr, (refused, done.stderr)
    drained = helper_says("update", "NodeName=node3", "State=DRAIN", "Reason=training-supervisor: a test")
    assert drained.returncode == 0, drained.stderr
    node = parse.parse_nodes(slurm(slurm_box, "scontrol", "-o", "show", "node", "node3"))["node3"]
    assert "DRAIN" in node.flags and node.reason == "training-supervisor: a test", node
    made = helper_says("create", "reservation", "ReservationName=tsup-0a1b2c3d-probe", "Nodes=node3",
                       f"Users={user.name}", "StartTime=now", "Duration=3", "Flags=MAINT,IGNORE_JOBS")
    assert made.returncode == 0, made.stderr
    assert helper_says("delete", "ReservationName=tsup-0a1b2c3d-probe").returncode == 0
    assert helper_says("update", "NodeName=node3", "State=RESUME").returncode == 0


def test_on_the_box_a_root_daemon_starts_the_run_as_the_user_its_spec_names(
        slurm_box: Box, open_dir: Path, alice: RunAs, tmp_path: Path, fault_free: dict[str, Any]) -> None:
    """sbatch and srun run as alice: the allocation is hers in Slurm, and so are the ranks."""
    state, shared, port = tmp_path / "state", open_dir / "shared", free_port()
    shared.mkdir(mode=0o755)
    conf = serve_config(tmp_path / "config.toml", state, port, shared_dir=str(shared), launcher="slurm",
                        slurm_conf=str(slurm_box.conf))
    daemon = Serve(state, port, config=conf, extra_env={"TSUP_ALLOW_ROOT_RUNS": "false"})
    try:
        spec = spec_as(spec_for_slurm(tmp_path), alice.name, tmp_path / "alice.toml")
        run_id = daemon.ctl_json("submit", str(spec))["run_id"]
        wait_for(lambda: (daemon.read("status", run_id)["step"] or 0) >= 5, 240, "training as alice")
        owners = slurm(slurm_box, "squeue", "-h", "-o", "%u").split()
        assert owners == [alice.name], owners
        ranks = trainer_processes(shared)
        assert len(ranks) == 4 and uids_of(ranks) == {alice.uid}, "every rank is alice's, none root's"
        final = wait_for(lambda: (d := daemon.read("status", run_id))["state"] in ("SUCCEEDED", "FAILED") and d,
                         240, "the run to end", interval_s=1.0)
        assert final["state"] == "SUCCEEDED" and final["model_digest"] == fault_free["model_digest"], final
        wait_for(lambda: slurm(slurm_box, "squeue", "-h") == "", 60, "alice's allocation given back")
    finally:
        daemon.kill(15)


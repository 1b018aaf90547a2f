"""The README's install, followed on the multi-host Slurm box.

scripts/install-controller on the controller (this host) with a config of the box's,
scripts/install-node --check on each node (in its network namespace), then the daemon
started as the installed unit starts it. systemd does not run here, so the test starts
the unit's ExecStart itself, as systemd would: as its User=, in a mount namespace of its
own where the whole file system is read-only but for its ReadWritePaths= (what
ProtectSystem=strict does), with its EnvironmentFile=. Not emulated: PrivateTmp= (the
box keeps its Slurm configuration and munge socket in /tmp), the watchdog and the other
Protect*= settings, which no step of the install touches.

A train.sh job (the FSDP test case's stand-in) keeps its checkpoints under a
checkpoint root outside shared_dir. It survives a node killed mid-run (drained in Slurm
through the sudo rule the script installed), then an operator's rollback (pause, then
resume --from-step) sets the newer checkpoints aside, which only the drop-in's
ReadWritePaths allows, and the run ends with the weights of a run that never failed.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from slurmbox import box as box_mod
from slurmbox.box import NETNS_DIR, Box
from supervisor import users
from supervisor.slurm import parse
from tests.chaos.test_slurm import train_sh_spec
from tests.conftest import REPO, free_port, require, require_root, wait_for
from tests.e2e.conftest import assert_same_weights, command_spec, ctl, db_rows, port_open, slurm
from tests.e2e.test_least_privilege import gone, remove_user, system_user

pytestmark = pytest.mark.e2e

USER = "tsup-inst"
HELPER = Path(f"/usr/local/libexec/{USER}/node-admin")  # the drains' helper, root's (systemd/node-admin)


@pytest.fixture
def place() -> Iterator[Path]:
    """Where the install's directories go: outside /tmp, as /var/lib and /fsx are, and
    reachable by the daemon's user."""
    require_root("installing a service")
    require("useradd, setpriv, unshare, visudo", all(shutil.which(t) for t in ("useradd", "setpriv", "unshare",
                                                                               "visudo")))
    Path("/srv").mkdir(exist_ok=True)
    path = Path(tempfile.mkdtemp(prefix="tsup-install-", dir="/srv"))
    path.chmod(0o755)
    try:
        yield path
    finally:
        gone(USER)
        Path(f"/etc/sudoers.d/{USER}").unlink(missing_ok=True)
        shutil.rmtree(HELPER.parent, ignore_errors=True)
        shutil.rmtree(path, ignore_errors=True)


def unit_settings(unit: Path) -> dict[str, list[str]]:
    """Each setting of the unit and its drop-ins, as systemd reads them: lines continued
    by a backslash, a later drop-in after an earlier one, an empty value resetting a list."""
    settings: dict[str, list[str]] = {}
    dropins = sorted(unit.with_name(unit.name + ".d").glob("*.conf"))
    for path in (unit, *dropins):
        text = re.sub(r"\\\n", " ", path.read_text())
        for line in text.splitlines():
            if line.startswith(("#", "[")) or "=" not in line:
                continue
            key, value = line.split("=", 1)
            if value == "":
                settings[key] = []
            else:
                settings.setdefault(key, []).append(value.strip())
    return settings


def start_as_the_unit(unit: Path, log: Path) -> subprocess.Popen[bytes]:
    """The unit's ExecStart, as systemd would start it (see the module docstring)."""
    s = unit_settings(unit)
    writable = [p for value in s["ReadWritePaths"] for p in value.split()]
    environment = dict(os.environ)
    for value in s.get("EnvironmentFile", []):
        path = Path(value.removeprefix("-"))
        if path.exists():
            environment |= dict(line.split("=", 1) for line in path.read_text().splitlines()
                                if line.strip() and not line.startswith("#"))
    user = users.lookup(s["User"][-1])
    sandbox = ('mount -o remount,bind,ro / && for p; do case $p in -*) p=${p#-}; [ -e "$p" ] || continue;; esac; '
               'mount --bind "$p" "$p" && mount -o remount,bind,rw "$p" || exit 1; done && '
               f'exec setpriv --reuid={user.uid} --regid={user.gid} --init-groups -- {s["ExecStart"][-1]}')
    return subprocess.Popen(["unshare", "--mount", "--propagation", "private", "sh", "-c", sandbox, "sandbox",
                             *writable], stdout=log.open("ab"), stderr=subprocess.STDOUT, env=environment)


def stop_the_unit(daemon: subprocess.Popen[bytes]) -> None:
    daemon.terminate()
    try:
        daemon.wait(30)
    except subprocess.TimeoutExpired:
        daemon.kill()


def unit_ctl(url: str, token: dict[str, str], log: Path) -> Callable[..., Any]:
    """`supervisorctl --json ARGS` against the installed daemon, its JSON; a failure shows
    the daemon's log."""
    def supervisorctl(*args: str) -> Any:
        proc = ctl(url, "--json", *args, extra_env=token)
        assert proc.returncode == 0, proc.stderr + log.read_text()[-3000:]
        return json.loads(proc.stdout)

    return supervisorctl


def test_the_readme_install_on_the_multi_host_box(
        slurm_box: Box, place: Path, tmp_path: Path, fsdp_never_failed: dict[str, Any]) -> None:
    state, shared, fsx, etc = place / "state", place / "shared", place / "fsx", place / "etc"
    port = free_port()
    config = place / "config.toml"
    config.write_text("".join(f"{k} = {json.dumps(v)}\n" for k, v in {
        "state_dir": str(state), "api_bind": f"127.0.0.1:{port}", "launcher": "slurm", "tick_s": 0.25,
        "sweep_every_s": 0, "shared_dir": str(shared), "checkpoint_roots": [str(fsx)],
        "slurm_admin_prefix": ["sudo", "-n", str(HELPER)], "slurm_conf": str(slurm_box.conf),
        "runs_share_admin_rights": True}.items()))
    done = subprocess.run([str(REPO / "scripts" / "install-controller"), "--config", str(config), "--user", USER,
                           "--etc", str(etc), "--no-start"], capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"writable: {state} {shared} -{fsx}" in done.stdout, done.stdout
    unit = etc / "systemd" / "system" / "training-supervisor.service"
    s = unit_settings(unit)
    assert s["User"] == [USER] and s["ExecStart"][-1].startswith(f"{REPO}/.venv/bin/training-supervisor serve")
    assert s["ReadWritePaths"] == [f"{state} {shared} -{fsx}"] and s["NoNewPrivileges"][-1] == "no"
    assert (shared.stat().st_mode & 0o777, shared.owner()) == (0o755, USER)
    assert Path(f"/etc/sudoers.d/{USER}").exists(), "the drain rights are part of the install"
    assert HELPER.stat().st_uid == 0 and f"slurm_conf = {slurm_box.conf}" in (HELPER.parent / "node-admin.conf").read_text()

    for node in slurm_box.nodes:  # each node, as its own host: the same interpreter at the same path
        done = subprocess.run(["nsenter", f"--net={NETNS_DIR / slurm_box.netns(node)}", "env",
                               f"SLURMD_NODENAME={node}", str(REPO / "scripts" / "install-node"), "--check"],
                              capture_output=True, text=True, timeout=300, check=False)
        assert done.returncode == 0 and f"install-node ({node}): ready" in done.stdout, done.stdout + done.stderr

    fsx.mkdir()
    daemon_user = users.lookup(USER)
    os.chown(fsx, daemon_user.uid, daemon_user.gid)  # the run's user (the daemon's) keeps checkpoints there
    with (etc / "training-supervisor" / "environment").open("a") as f:
        f.write(f"SLURM_CONF={slurm_box.conf}\n")  # the README's place for it
    log = place / "daemon.log"
    daemon = start_as_the_unit(unit, log)
    try:
        wait_for(lambda: port_open(port) or daemon.poll() is not None, 60, "the API to listen")
        assert daemon.poll() is None, log.read_text()
        token = {"TSUP_API_TOKEN_FILE": str(state / "api-token")}
        url = f"http://127.0.0.1:{port}"

        supervisorctl = unit_ctl(url, token, log)

        elsewhere = place / "elsewhere"  # the run's user may write it; the unit keeps the daemon out
        elsewhere.mkdir()
        os.chown(elsewhere, daemon_user.uid, daemon_user.gid)
        refused = ctl(url, "--json", "submit", str(command_spec(
            tmp_path / "elsewhere.toml", "elsewhere", ["/bin/true"], resources={"launcher": "slurm", "nodes": 1},
            checkpoint_dir=str(elsewhere / "ck"))), extra_env=token)
        assert refused.returncode != 0 and "not writable by the daemon" in refused.stderr, refused.stderr
        assert "checkpoint_roots" in refused.stderr

        spec = train_sh_spec(tmp_path)  # 60 steps, a checkpoint every 10; 0.3 s a step, to pause in time
        text = spec.read_text().replace('"{run_dir}/checkpoints"', json.dumps(str(fsx / "ck")))
        spec.write_text(text.replace('"--step_sleep", "0.1"', '"--step_sleep", "0.3"'))
        assert str(fsx / "ck") in spec.read_text() and '"0.3"' in spec.read_text()
        run_id = supervisorctl("submit", str(spec))["run_id"]
        status = wait_for(lambda: (d := supervisorctl("status", run_id))["step"] and d["step"] >= 15 and d,
                          240, "step 15 on the box")
        victim = status["attempt_history"][-1]["nodes"][1]
        assert box_mod.kill_node(slurm_box, victim)
        wait_for(lambda: (d := supervisorctl("status", run_id))["attempts"] >= 2 and (d["step"] or 0) >= 31,
                 300, "training again after the node's loss, past step 30", interval_s=0.5)
        node = parse.parse_nodes(slurm(slurm_box, "scontrol", "-o", "show", "node", victim))[victim]
        assert "DRAIN" in node.flags and node.reason.startswith("training-supervisor:"), node

        supervisorctl("pause", run_id)
        wait_for(lambda: supervisorctl("status", run_id)["state"] == "PAUSED", 120, "the run paused")
        newer = sorted(p.name for p in (fsx / "ck").iterdir() if p.name != ".set-aside")
        assert "llama_v3-30steps" in newer, newer
        supervisorctl("resume", run_id, "--from-step", "20")
        final = wait_for(lambda: (d := supervisorctl("status", run_id))["state"] in ("SUCCEEDED", "FAILED") and d,
                         300, "the run to end", interval_s=1.0)
        assert final["state"] == "SUCCEEDED", final
        aside = [p.name for p in (fsx / "ck" / ".set-aside").glob("resume-*/*")]
        assert "llama_v3-30steps" in aside, f"the rollback's set-aside under the unit's ReadWritePaths: {aside}"
        assert final["attempt_history"][-1]["resume_step"] == 20
        assert_same_weights(shared / "runs" / "run-1" / "final.pt", fsdp_never_failed)
    finally:
        stop_the_unit(daemon)


HP_USER = "tsup-hp"  # the run user, as HyperPod's "ubuntu": an account every node has


def test_the_hyperpod_profile_on_the_multi_host_box(
        slurm_box4: Box, place: Path, tmp_path: Path, fsdp_never_failed: dict[str, Any]) -> None:
    """README "On HyperPod": the node side from one venv on the shared file system, made
    once (install-node --venv: the checkout's path and the `node` extra, no torch), each
    node only checked with it; a root daemon whose runs execute as run_as; the broker's
    port pinned (mqtt_bind) and dropped on node2 alone, as a security group would. The
    preflight names node2 (the broker, from the node), it never trains; the link test,
    which cannot import torch from the slim venv, blames no node; a node killed mid-run
    gives way to the spare, and the run ends with the weights of a run that never failed."""
    box = slurm_box4
    fsx, shared, state, etc = place / "fsx", place / "shared", place / "state", place / "etc"
    node_venv = fsx / "training-supervisor" / "node"
    fsx.mkdir()
    person = system_user(HP_USER, place)
    try:
        made = subprocess.run([str(REPO / "scripts" / "install-node"), "--venv", str(node_venv)], timeout=300,
                              capture_output=True, text=True, check=False,
                              env={**os.environ, "PYTHON": "/usr/bin/python3"})
        assert made.returncode == 0 and "ready" in made.stdout, made.stdout + made.stderr
        assert not list(node_venv.glob("lib/python*/site-packages/torch")), "the node side needs no torch"
        broker_port, port = free_port(), free_port()
        config = place / "hyperpod.toml"
        config.write_text("".join(f"{k} = {json.dumps(v)}\n" for k, v in {
            "state_dir": str(state), "api_bind": f"127.0.0.1:{port}", "launcher": "slurm", "tick_s": 0.25,
            "sweep_every_s": 0, "shared_dir": str(shared), "checkpoint_roots": [str(fsx)],
            "slurm_conf": str(box.conf), "hyperpod": True, "run_as": HP_USER,
            "node_python": str(node_venv / "bin" / "python"),
            "mqtt_bind": f"{box.controller_addr}:{broker_port}"}.items()))
        done = subprocess.run([str(REPO / "scripts" / "install-controller"), "--config", str(config), "--user",
                               "root", "--etc", str(etc), "--no-start"], capture_output=True, text=True,
                              timeout=600, check=False)
        assert done.returncode == 0 and "root's own (Slurm's operator)" in done.stdout, done.stdout + done.stderr
        unit = etc / "systemd" / "system" / "training-supervisor.service"
        assert unit_settings(unit)["User"] == ["root"]
        for node in box.nodes:  # nothing installed on a node: each one checked with the shared venv
            done = subprocess.run(["nsenter", f"--net={NETNS_DIR / box.netns(node)}", "env", f"SLURMD_NODENAME={node}",
                                   str(REPO / "scripts" / "install-node"), "--check", "--venv", str(node_venv),
                                   "--run-user", HP_USER], capture_output=True, text=True, timeout=300, check=False)
            assert done.returncode == 0 and f"install-node ({node}): ready" in done.stdout, done.stdout + done.stderr
            assert f"the run's user {HP_USER} is uid {person.uid} here" in done.stdout

        os.chown(fsx, person.uid, person.gid)  # the run's user keeps its checkpoints there
        with (etc / "training-supervisor" / "environment").open("a") as f:
            f.write(f"SLURM_CONF={box.conf}\n")
        box_mod.block_port(box, "node2", broker_port)
        log = place / "daemon.log"
        daemon = start_as_the_unit(unit, log)
        try:
            wait_for(lambda: port_open(port) or daemon.poll() is not None, 60, "the API to listen")
            assert daemon.poll() is None, log.read_text()
            url, token = f"http://127.0.0.1:{port}", {"TSUP_API_TOKEN_FILE": str(state / "api-token")}

            supervisorctl = unit_ctl(url, token, log)

            spec = train_sh_spec(tmp_path)
            text = spec.read_text().replace('"{run_dir}/checkpoints"', json.dumps(str(fsx / "ck")))
            spec.write_text(text + "[health]\npreflight = true\ntimeout_s = 30\n")
            run_id = supervisorctl("submit", str(spec))["run_id"]
            try:
                status = wait_for(lambda: (d := supervisorctl("status", run_id))["step"] and d["step"] >= 15 and d,
                                  300, "step 15 on the box")
            except AssertionError:
                events = ctl(url, "events", run_id, extra_env=token).stdout
                raise AssertionError(f"{events[-6000:]}\n{log.read_text()[-4000:]}") from None
            first = status["attempt_history"][-1]["nodes"]
            assert "node2" not in first, first
            nodes = {n["name"]: n for n in supervisorctl("nodes")}
            assert nodes["node2"]["state"] == "DRAINED", nodes["node2"]
            assert f":{broker_port} from this node: no connection in 5 s" in nodes["node2"]["reason"], nodes["node2"]
            probes = db_rows(state, "SELECT node, kind, status FROM probes ORDER BY id")
            assert probes.count(("node2", "preflight", "unhealthy")) == 2, "confirmed by a second probe"
            assert [p for p in probes if p[0] != "node2" and p[2] != "healthy"] == [], probes
            ours = str(shared / "runs" / run_id)  # other tests' daemons and agents share this host
            agents = [p for p in psutil.process_iter(["cmdline", "environ"])
                      if (p.info["cmdline"] or [])[1:3] == ["-m", "node.agent"]
                      and (p.info["environ"] or {}).get("TSUP_MARKER", "").startswith(ours)]
            assert agents and {p.info["cmdline"][0] for p in agents} == {str(node_venv / "bin" / "python")}
            ranks = [p for p in psutil.process_iter(["environ", "uids"]) if (p.info["environ"] or {}).get(
                "TSUP_MARKER", "").startswith(ours) and (p.info["environ"] or {}).get("RANK") is not None]
            assert ranks and {p.info["uids"].real for p in ranks} == {person.uid}, "the run executes as run_as"

            victim = first[1]
            assert box_mod.kill_node(box, victim)
            final = wait_for(lambda: (d := supervisorctl("status", run_id))["state"] in ("SUCCEEDED", "FAILED")
                             and d, 400, "the run to end", interval_s=1.0)
            assert final["state"] == "SUCCEEDED", final
            assert final["attempts"] >= 2 and all("node2" not in a["nodes"] for a in final["attempt_history"])
            assert_same_weights(shared / "runs" / "run-1" / "final.pt", fsdp_never_failed)
        finally:
            stop_the_unit(daemon)
    finally:
        remove_user(person)

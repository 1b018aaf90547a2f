"""People with tokens of their own (supervisor/people.py, cli/tokens.py): real Unix
accounts, tokens issued by the operator command into their homes, `supervisorctl` run
as each person against a root daemon. One cannot read or cancel another's run (403), an
operator can; a token file others may read is refused; a revoked token opens nothing."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from supervisor.people import TOKEN_PATH
from supervisor.users import RunAs
from tests.conftest import REPO, wait_for
from tests.e2e.conftest import Serve, command_spec, env
from tests.e2e.test_hostile_user import daemon  # noqa: F401 - the fixture
from tests.e2e.test_least_privilege import open_dir, remove_user, system_user  # noqa: F401 - fixtures

pytestmark = pytest.mark.e2e


@pytest.fixture
def people(open_dir: Path) -> Iterator[dict[str, RunAs]]:  # noqa: F811
    made: dict[str, RunAs] = {}
    try:
        for name in ("alice", "bob", "carol"):
            made[name] = system_user(f"tsup-{name}", open_dir)
        yield made
    finally:
        for user in made.values():
            remove_user(user)


def token(serve: Serve, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "cli.daemon", "token", *args, "--state-dir", str(serve.state)],
                          capture_output=True, text=True, cwd=REPO, env=env(), timeout=60, check=False)


def as_person(serve: Serve, person: RunAs, *args: str) -> subprocess.CompletedProcess[str]:
    """`supervisorctl ARGS` as ``person``, from their own account: no token but their own file."""
    environ = {k: v for k, v in env().items() if not k.startswith("TSUP_")}
    environ.update(HOME=person.home, USER=person.name, LOGNAME=person.name, TSUP_URL=serve.url)
    environ.pop("XDG_CONFIG_HOME", None)
    return subprocess.run([sys.executable, "-m", "cli.ctl", *args], capture_output=True, text=True, cwd=REPO,
                          env=environ, user=person.uid, group=person.gid, extra_groups=list(person.groups),
                          timeout=60, check=False)


def test_each_person_reads_and_acts_on_their_own_runs_and_an_operator_on_all(
        daemon: Serve, people: dict[str, RunAs], open_dir: Path) -> None:  # noqa: F811
    alice, bob, carol = people["alice"], people["bob"], people["carol"]
    for person, extra in ((alice, ()), (bob, ()), (carol, ("--operator",))):
        issued = token(daemon, "issue", person.name, *extra, "--json")
        assert issued.returncode == 0, issued.stderr
        path = Path(json.loads(issued.stdout)["token_file"])
        assert path == Path(person.home) / TOKEN_PATH
        st = path.stat()
        assert (st.st_uid, stat.S_IMODE(st.st_mode)) == (person.uid, 0o600), "the person's own, 0600"
    listed = json.loads(token(daemon, "list", "--json").stdout)["people"]
    assert [(p["user"], p["operator"]) for p in listed] == [("tsup-alice", False), ("tsup-bob", False),
                                                            ("tsup-carol", True)]

    spec = command_spec(open_dir / "alice.toml", "alices", ["sh", "-c", "echo alice-only-line; sleep 120"],
                        resources={"launcher": "local", "nodes": 1, "ranks_per_node": 1})
    spec.chmod(0o644)
    submitted = as_person(daemon, alice, "--json", "submit", str(spec))
    assert submitted.returncode == 0, submitted.stderr
    run_id = json.loads(submitted.stdout)["run_id"]
    wait_for(lambda: "alice-only-line" in as_person(daemon, alice, "logs", run_id).stdout, 60,
             "alice reads her run's log")
    [rank] = [p for p in os.listdir("/proc") if p.isdigit() and _is_alices_sleep(int(p), alice.uid)]
    assert rank, "the run executes as alice, who submitted it without a user"

    # bob: nothing of alice's, and he cannot submit as her.
    for args in (("logs", run_id), ("status", run_id), ("cancel", run_id)):
        refused = as_person(daemon, bob, *args)
        assert refused.returncode == 4, (args, refused.stdout, refused.stderr)
        assert f"{run_id} is tsup-alice's" in refused.stderr and "alice-only-line" not in refused.stdout
    assert json.loads(as_person(daemon, bob, "--json", "runs").stdout) == [], "he lists his own runs only"
    assert as_person(daemon, bob, "drain", "node0", "--reason", "x").returncode == 4, "a node's command: operators"
    as_alice = command_spec(open_dir / "as-alice.toml", "as-alice", ["true"],
                            resources={"launcher": "local", "nodes": 1, "ranks_per_node": 1})
    as_alice.write_text(as_alice.read_text().replace('name = "as-alice"\n',
                                                     f'name = "as-alice"\nuser = "{alice.name}"\n'))
    as_alice.chmod(0o644)
    forged = as_person(daemon, bob, "submit", str(as_alice))
    assert forged.returncode == 4 and "submits runs as tsup-bob only" in forged.stderr, forged.stderr

    # carol, an operator: reads it and cancels it.
    assert "alice-only-line" in as_person(daemon, carol, "logs", run_id).stdout
    assert as_person(daemon, carol, "cancel", run_id).returncode == 0
    wait_for(lambda: daemon.read("status", run_id)["state"] == "CANCELLED", 60, "alice's run cancelled")

    # A token file others may read is refused, not used; a revoked token opens nothing.
    (Path(alice.home) / TOKEN_PATH).chmod(0o644)
    open_to_all = as_person(daemon, alice, "runs")
    assert open_to_all.returncode == 2 and "open to others" in open_to_all.stderr, open_to_all.stderr
    assert token(daemon, "revoke", bob.name).returncode == 0
    revoked = as_person(daemon, bob, "runs")
    assert revoked.returncode == 4 and "nor a person's it issued" in revoked.stderr, revoked.stderr


def _is_alices_sleep(pid: int, uid: int) -> bool:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False
    uid_line = next(line for line in status.splitlines() if line.startswith("Uid:"))
    return int(uid_line.split()[1]) == uid and cmdline.startswith(b"sleep")


def test_issuing_a_token_to_no_such_account_or_to_root_is_refused(daemon: Serve) -> None:  # noqa: F811
    nobody = token(daemon, "issue", "tsup-no-such-person")
    assert nobody.returncode == 2 and "no user 'tsup-no-such-person'" in nobody.stderr, nobody.stderr
    root = token(daemon, "issue", "root")
    assert root.returncode == 1 and "root holds the daemon's own API token" in root.stderr, root.stderr

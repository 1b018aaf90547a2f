"""A run's user as an attacker of the root daemon that starts their run (issue 26, items
1 and 7). The daemon runs as root and the run as a real user of this host, whose own
trainer (a `[command]`, the real second process) plants links, FIFOs and files in the
directories the user owns. Whatever it plants, the daemon gives nothing of its own away,
writes nowhere else, and its tick goes on."""

from __future__ import annotations

import json
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from supervisor.users import RunAs
from tests.conftest import free_port, wait_for
from tests.e2e.conftest import Serve, command_spec, serve_config
from tests.e2e.test_least_privilege import open_dir, remove_user, system_user  # noqa: F401 - fixtures

pytestmark = pytest.mark.e2e


@pytest.fixture
def eve(open_dir: Path) -> Iterator[RunAs]:  # noqa: F811 - the fixture imported above
    user = system_user("tsup-eve", open_dir)
    try:
        yield user
    finally:
        remove_user(user)


@pytest.fixture
def daemon(tmp_path: Path, open_dir: Path) -> Iterator[Serve]:  # noqa: F811
    """A root daemon whose runs live in a shared directory their users can reach."""
    state, shared = tmp_path / "state", open_dir / "shared"
    shared.mkdir(mode=0o755)
    port = free_port()
    conf = serve_config(tmp_path / "config.toml", state, port, shared_dir=str(shared))
    serve = Serve(state, port, config=conf, extra_env={"TSUP_ALLOW_ROOT_RUNS": "false"})
    try:
        yield serve
    finally:
        serve.kill(15)


def submit_as(daemon: Serve, user: RunAs, tmp_path: Path, script: str, *, command: dict[str, Any] | None = None,
              **policy: Any) -> str:
    """A one-rank `[command]` run of ``script`` (sh, with {run_dir} filled in) as ``user``,
    with ``command``'s keys in its [command] table."""
    spec = command_spec(tmp_path / "hostile.toml", "hostile", ["sh", "-c", script],
                        resources={"launcher": "local", "nodes": 1, "ranks_per_node": 1},
                        policy={"backoff_base_s": 0.1, "backoff_max_s": 0.1, **policy}, **(command or {}))
    spec.write_text(spec.read_text().replace('name = "hostile"\n', f'name = "hostile"\nuser = "{user.name}"\n', 1))
    return str(daemon.ctl_json("submit", str(spec))["run_id"])


def ended(daemon: Serve, run_id: str, timeout_s: float = 120) -> dict[str, Any]:
    return wait_for(lambda: (d := daemon.read("status", run_id))["state"] in ("SUCCEEDED", "FAILED") and d,
                    timeout_s, f"{run_id} to end", interval_s=0.5)


def test_a_link_planted_as_the_next_attempt_does_not_give_the_state_directory_away(
        daemon: Serve, eve: RunAs, tmp_path: Path) -> None:
    """Attempt 1 links attempts/2 to the daemon's state directory and fails. Before: attempt
    2 wrote its trainer.json there and chowned the state directory to the user (who could
    then replace api-token, telemetry-secret, supervisor.db)."""
    run_id = submit_as(daemon, eve, tmp_path, f"ln -s {daemon.state} {{run_dir}}/attempts/2; exit 3")
    final = ended(daemon, run_id)
    assert daemon.state.stat().st_uid == 0, "the state directory is still root's"
    assert not (daemon.state / "trainer.json").exists(), "nothing written through the link"
    assert {p.stat().st_uid for p in daemon.state.iterdir() if not p.is_symlink()} == {0}
    assert final["state"] == "FAILED", final
    assert "symbolic link" in json.dumps(final) or "not a directory" in json.dumps(final), final


def test_a_rank_log_linked_to_a_root_file_is_not_handed_to_the_rank(
        daemon: Serve, eve: RunAs, tmp_path: Path, open_dir: Path) -> None:  # noqa: F811
    """Attempt 1 makes attempts/2 itself and puts its rank's log name there as a link to a
    file only root may write. Before: the root daemon opened the target for appending and
    gave the descriptor to the rank, which wrote into it."""
    victim = open_dir / "root-only"
    victim.write_text("root's\n")
    victim.chmod(0o600)
    script = ("if [ \"$TSUP_ATTEMPT\" = 1 ]; then mkdir {run_dir}/attempts/2 && "
              f"ln -s {victim} {{run_dir}}/attempts/2/rank-0000.$TSUP_NODE.log; exit 3; fi; echo written-by-the-rank")
    run_id = submit_as(daemon, eve, tmp_path, script)
    final = ended(daemon, run_id)
    assert victim.read_text() == "root's\n", "the rank wrote into a file of root's"
    assert victim.stat().st_uid == 0 and stat.S_IMODE(victim.stat().st_mode) == 0o600
    assert final["state"] == "FAILED" and "symbolic link" in json.dumps(final), final


def test_a_fifo_among_the_rank_logs_does_not_wedge_the_tick(
        daemon: Serve, eve: RunAs, tmp_path: Path) -> None:
    """The trainer makes a FIFO named like a rank's log in its attempt directory, then
    finishes. Before: the daemon's log reader opened it and blocked for ever (no writer),
    so the run never ended."""
    run_id = submit_as(daemon, eve, tmp_path,
                       "mkfifo {run_dir}/attempts/$TSUP_ATTEMPT/rank-0007.$TSUP_NODE.log; sleep 2; exit 0")
    final = ended(daemon, run_id, timeout_s=60)
    assert final["state"] == "SUCCEEDED", final


def test_a_fifo_as_a_checkpoints_marker_does_not_wedge_the_resume(
        daemon: Serve, eve: RunAs, tmp_path: Path) -> None:
    """A save whose trainer_meta.json is a FIFO (a link to /dev/zero would exhaust memory
    the same way a FIFO blocks). Before: choosing the next attempt's checkpoint blocked the
    tick for ever. After: the save is judged unreadable and the run starts over."""
    script = ("if [ \"$TSUP_ATTEMPT\" = 1 ]; then d={run_dir}/checkpoints/step_00000010; mkdir -p $d && "
              "echo x > $d/.metadata && mkfifo $d/trainer_meta.json; exit 3; fi; exit 0")
    run_id = submit_as(daemon, eve, tmp_path, script)
    final = ended(daemon, run_id, timeout_s=60)
    assert final["state"] == "SUCCEEDED", final
    assert final["attempt_history"][-1]["resume_from"] is None, final


def test_links_and_fifos_planted_where_the_precompile_manifest_was_change_nothing(
        daemon: Serve, eve: RunAs, tmp_path: Path) -> None:
    """H2 of issue 37: the precompile pass's manifest was a file of the daemon's in the run's
    directory. A link at set-aside-N.json.tmp made root overwrite supervisor.db; a FIFO
    as the manifest wedged the daemon for good. The moves are the store's now: the pass
    plants both, changes its input so that a second pass is due, and the run goes on
    through both passes to its end, the store untouched."""
    db = daemon.state / "supervisor.db"
    # (a directory of root's in the run's directory is renamed away by the run's user)
    plant = (f"mv {{run_dir}}/precompile {{run_dir}}/precompile.was; mkdir -p {{run_dir}}/precompile; "
             f"for n in 1 2 3 4; do "
             f"ln -sf {db} {{run_dir}}/precompile/set-aside-$n.json.tmp; "
             "rm -f {run_dir}/precompile/set-aside-$n.json; mkfifo {run_dir}/precompile/set-aside-$n.json; done")
    script = (f'if [ "$COMPILE" = 1 ]; then {plant}; exit 0; fi; '
              'if [ "$TSUP_ATTEMPT" = 2 ]; then echo changed >> {run_dir}/input.txt; exit 3; fi; exit 0')
    run_id = submit_as(daemon, eve, tmp_path, script, command={
        "env": {"COMPILE": "0"}, "precompile_env": {"COMPILE": "1"}, "cwd": "{run_dir}",
        "precompile_inputs": ["input.txt"]})
    final = ended(daemon, run_id, timeout_s=120)
    assert final["state"] == "SUCCEEDED", final
    assert [a["precompile"] for a in final["attempt_history"]] == [True, False, True, False], final
    assert db.stat().st_uid == 0 and not db.is_symlink()
    assert daemon.ctl_json("runs"), "the store still answers"


def test_a_spec_naming_a_service_account_is_refused(daemon: Serve, tmp_path: Path, open_dir: Path) -> None:  # noqa: F811
    """A write-token holder names a service account (munge reads the key that signs every
    Slurm credential). Before: the run was accepted and its trainer ran as that account."""
    service = system_user("tsup-svc", open_dir, service=True)
    try:
        for name in ("munge", "daemon", service.name):
            spec = command_spec(tmp_path / "svc.toml", "svc", ["true"])
            spec.write_text(spec.read_text().replace('name = "svc"\n', f'name = "svc"\nuser = "{name}"\n', 1))
            refused = daemon.ctl("submit", str(spec))
            if "no user" in refused.stderr:
                continue  # no munge on this host
            assert refused.returncode != 0 and f"may not execute as {name}" in refused.stderr, refused.stderr
    finally:
        remove_user(service)


def test_run_users_lets_the_operator_allow_an_account(tmp_path: Path, open_dir: Path) -> None:  # noqa: F811
    """The config's run_users is the whole list: a service account it names may run, a
    person's account it does not name may not."""
    service = system_user("tsup-svc", open_dir, service=True)
    person = system_user("tsup-eve", open_dir)
    state, shared, port = tmp_path / "state", open_dir / "shared", free_port()
    shared.mkdir(mode=0o755)
    conf = serve_config(tmp_path / "config.toml", state, port, shared_dir=str(shared), run_users=[service.name])
    serve = Serve(state, port, config=conf)
    try:
        run_id = submit_as(serve, service, tmp_path, "exit 0")
        assert ended(serve, run_id)["state"] == "SUCCEEDED"
        spec = command_spec(tmp_path / "eve.toml", "eve", ["true"])
        spec.write_text(spec.read_text().replace('name = "eve"\n', f'name = "eve"\nuser = "{person.name}"\n', 1))
        refused = serve.ctl("submit", str(spec))
        assert refused.returncode != 0 and "not in run_users" in refused.stderr, refused.stderr
    finally:
        serve.kill(15)
        remove_user(service)
        remove_user(person)


def test_trainer_text_cannot_write_escape_sequences_to_the_operators_terminal(
        daemon: Serve, eve: RunAs, tmp_path: Path) -> None:
    """The trainer prints a device error carrying a terminal escape (clear the screen, set
    the window title) and fails. Before: `supervisorctl events` printed the bytes as they
    came, so the operator's terminal obeyed them."""
    line = r"uncorrectable ECC error encountered \033]0;pwned\007\033[2J forged"
    run_id = submit_as(daemon, eve, tmp_path, f"printf '{line}\\n'; exit 1", crash_loop_attempts=2)
    ended(daemon, run_id)
    shown = daemon.ctl("events", run_id)
    assert shown.returncode == 0, shown.stderr
    assert "uncorrectable ECC error" in shown.stdout, shown.stdout
    assert "\x1b" not in shown.stdout and "\x07" not in shown.stdout
    assert r"\x1b[2J" in shown.stdout, shown.stdout
    raw = daemon.ctl_json("events", run_id)
    assert any("\x1b[2J" in e["message"] for e in raw), "--json keeps the text exact (JSON escapes it)"


def test_a_device_error_printed_on_every_node_drains_none_of_them(
        daemon: Serve, eve: RunAs, tmp_path: Path) -> None:
    """Every rank of a four-node run prints a device error and exits (trainer text, or a
    fault of the network, not of four nodes at once). Before: all four were drained, and
    with HyperPod each would have been an instance replacement. After: none, and they are
    probed instead (issue 26, item 9)."""
    spec = command_spec(tmp_path / "flood.toml", "flood",
                        ["sh", "-c", "echo 'uncorrectable ECC error encountered'; exit 1"],
                        resources={"launcher": "local", "nodes": 4, "ranks_per_node": 1},
                        policy={"backoff_base_s": 0.1, "backoff_max_s": 0.1, "crash_loop_attempts": 2})
    spec.write_text(spec.read_text().replace('name = "flood"\n', f'name = "flood"\nuser = "{eve.name}"\n', 1))
    run_id = str(daemon.ctl_json("submit", str(spec))["run_id"])
    final = ended(daemon, run_id)
    assert final["drained_nodes"] == [], final
    events = daemon.ctl_json("events", run_id)
    held = [e for e in events if e["kind"] == "drain.held"]
    assert held and "over the drain budget" in held[0]["message"], [e["message"] for e in events]

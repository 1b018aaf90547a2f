"""supervisorctl without a daemon: where it finds its settings and token, its shell
completion (run in a real bash), server-sent events, and its exit codes."""

from __future__ import annotations

import contextlib
import io
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from cli.client import _sse
from cli.ctl import _parser, completion, main
from cli.ctl_settings import daemon_settings
from supervisor.token_file import ensure_token, read_token
from tests.conftest import free_port


def run(argv: list[str], environ: dict[str, str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(argv, environ)
        except SystemExit as e:
            code = int(e.code or 0)
    return code, out.getvalue(), err.getvalue()


def settings(argv: list[str], environ: dict[str, str]) -> dict[str, object]:
    return daemon_settings(_parser().parse_args([*argv, "runs"]), environ)


def test_the_token_comes_from_the_flag_then_the_environment_then_the_config(tmp_path: Path) -> None:
    files = {}
    for name in ("flag", "env", "config"):
        files[name] = tmp_path / name
        ensure_token(files[name])
    config = tmp_path / "ctl.toml"
    config.write_text(f'url = "http://10.0.0.5:8470"\ntoken_file = "{files["config"]}"\n')
    base = {"TSUP_CTL_CONFIG": str(config), "HOME": str(tmp_path)}
    assert settings([], base)["token"] == read_token(files["config"])
    assert settings([], base)["url"] == "http://10.0.0.5:8470"
    with_env = {**base, "TSUP_API_TOKEN_FILE": str(files["env"]), "TSUP_URL": "http://h:1"}
    assert settings([], with_env)["token"] == read_token(files["env"]) and settings([], with_env)["url"] == "http://h:1"
    assert settings(["--token-file", str(files["flag"]), "--url", "http://x:2"], with_env)["token"] == read_token(
        files["flag"])
    assert settings([], {**with_env, "TSUP_API_TOKEN": "literal-token-0123456789"})["token"] == \
        "literal-token-0123456789"


def test_a_token_file_others_can_read_is_refused(tmp_path: Path) -> None:
    token = tmp_path / "api-token"
    ensure_token(token)
    assert (token.stat().st_mode & 0o777) == 0o600
    assert ensure_token(token) == read_token(token), "made once, then read"
    token.chmod(0o644)
    with pytest.raises(ValueError, match="open to others"):
        ensure_token(token)


@pytest.mark.parametrize(("text", "complaint"), [
    ("url = 5\n", "url: expected a string"),
    ("uri = 'x'\n", "uri: unknown key"),
    ("[broken\n", "not valid TOML"),
])
def test_a_bad_config_file_is_a_usage_error(tmp_path: Path, text: str, complaint: str) -> None:
    config = tmp_path / "ctl.toml"
    config.write_text(text)
    code, _, err = run(["runs"], {"TSUP_CTL_CONFIG": str(config)})
    assert code == 2 and complaint in err


def test_a_daemon_that_is_down_is_exit_1_with_a_readable_message(tmp_path: Path) -> None:
    url = f"http://127.0.0.1:{free_port()}"
    code, _, err = run(["--url", url, "runs"], {"TSUP_CTL_CONFIG": os.devnull, "HOME": str(tmp_path)})
    assert code == 1 and f"cannot reach training-supervisor at {url}" in err and "is the daemon running?" in err


@pytest.mark.parametrize("argv", [["status", "run-1/../x"], ["probe", "a?b"], ["drain", "..", "--reason", "x"]])
def test_ids_that_would_change_the_path_are_refused(tmp_path: Path, argv: list[str]) -> None:
    code, _, err = run(argv, {"TSUP_CTL_CONFIG": os.devnull, "HOME": str(tmp_path)})
    assert code == 2 and "is not a run id or node name" in err


def test_server_sent_events_are_parsed_as_the_standard_says() -> None:
    lines = [": keepalive", "", "id: 4", 'data: {"id": 4}', "", "event: end", "data: {}", "", "data: a", "data: b", ""]
    assert list(_sse(iter(lines))) == [("message", '{"id": 4}'), ("end", "{}"), ("message", "a\nb")]


def complete(script: str, words: str, fake_runs: str, tmp_path: Path) -> list[str]:
    """What bash offers for the command line ``words`` (the cursor at its end)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    fake = bin_dir / "supervisorctl"  # the daemon's answers to `runs -q` and `nodes -q`
    fake.write_text(f'#!/bin/sh\ncase "$1" in runs) echo "{fake_runs}" ;; nodes) echo "node1 node2" ;; esac\n')
    fake.chmod(0o755)
    (tmp_path / "completion.bash").write_text(script)
    cwords = words.split(" ")
    program = (f'source {tmp_path / "completion.bash"}\nCOMP_WORDS=({" ".join(repr(w) for w in cwords)})\n'
               f"COMP_CWORD={len(cwords) - 1}\n_supervisorctl\nprintf '%s\\n' \"${{COMPREPLY[@]}}\"\n")
    out = subprocess.run(["bash", "-c", program], capture_output=True, text=True, check=True, timeout=30,
                         env={"PATH": f"{bin_dir}:{os.environ['PATH']}"})
    return sorted(w for w in out.stdout.split("\n") if w)


def test_bash_completion_offers_commands_options_and_the_daemons_runs(tmp_path: Path) -> None:
    assert shutil.which("bash")
    script = completion("bash")
    assert "restart" in complete(script, "supervisorctl re", "", tmp_path)
    assert complete(script, "supervisorctl re", "", tmp_path) == ["restart", "resume"]
    assert complete(script, "supervisorctl status run-", "run-1 run-2", tmp_path) == ["run-1", "run-2"]
    assert complete(script, "supervisorctl --json drain n", "", tmp_path) == ["node1", "node2"]
    assert complete(script, "supervisorctl drain node1 --re", "", tmp_path) == ["--reason"]
    assert complete(script, "supervisorctl completion ", "", tmp_path) == ["bash", "zsh"]
    assert completion("zsh").startswith("autoload -U +X bashcompinit && bashcompinit\n")


def test_every_command_takes_json(tmp_path: Path) -> None:
    parser = _parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    for name, p in sub.choices.items():  # type: ignore[attr-defined]
        if name != "completion":
            assert "--json" in {o for a in p._actions for o in a.option_strings}, name


def test_the_nodes_table_shows_each_nodes_newest_link_figure_against_its_own_median() -> None:
    from supervisor import report
    from supervisor.domain import Node, NodeState
    from supervisor.views import node_view

    drifting = node_view(Node(name="node2", state=NodeState.IDLE), link_figures=[0.21, 0.5, 0.52, 0.49])
    never = node_view(Node(name="node3", state=NodeState.IDLE))
    assert drifting.link is not None and (drifting.link.newest_gbps, drifting.link.samples) == (0.21, 4)
    lines = report.nodes_table([drifting, never]).splitlines()
    assert "LINK" in lines[0]
    assert "0.21 GB/s (median of 4: 0.495)" in lines[1] and " - " in lines[2]

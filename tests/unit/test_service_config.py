"""The daemon's config file, environment overrides and flags; sd_notify; JSON logs."""

from __future__ import annotations

import json
import logging
import socket
from pathlib import Path

import pytest

from cli.daemon import _parser, serve_settings
from supervisor.config import load_service_config
from supervisor.errors import SpecError
from supervisor.logs import JsonFormatter
from supervisor.sdnotify import Notifier


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "config.toml"
    path.write_text(text)
    return path


def test_file_then_environment_then_flags(tmp_path: Path) -> None:
    path = write(tmp_path, 'api_bind = "127.0.0.1:9000"\nlauncher = "slurm"\nsweep_every_s = 60\n'
                           f'state_dir = "{tmp_path / "state"}"\n')
    env = {"TSUP_API_BIND": "127.0.0.1:9100", "TSUP_SWEEP_ARGS": '["--instance-type", "trn1.32xlarge"]',
           "TSUP_RUN_ID": "run-1"}  # a trainer's variable: not a config key, ignored
    config = load_service_config(path, env)
    assert (config.api_bind, config.launcher, config.sweep_every_s) == ("127.0.0.1:9100", "slurm", 60)
    assert config.sweep_args == ["--instance-type", "trn1.32xlarge"]

    args = _parser().parse_args(["serve", "--config", str(path), "--api-bind", "127.0.0.1:9200"])
    settings, log_format = serve_settings(args, env)
    assert (settings.api_host, settings.api_port, settings.launcher) == ("127.0.0.1", 9200, "slurm")
    assert settings.state_dir == tmp_path / "state" and settings.sweep_every_s == 60 and log_format == "text"
    no_api, _ = serve_settings(_parser().parse_args(["serve", "--config", str(path), "--no-api"]), {})
    assert no_api.api_port is None
    via_env, _ = serve_settings(_parser().parse_args(["serve"]), {"TSUP_CONFIG": str(path)})
    assert via_env.api_port == 9000


@pytest.mark.parametrize(("text", "env", "complaint"), [
    ("api_bnd = '1'\n", {}, "config.toml: api_bnd: unknown key (known: allow_root_runs, api_bind,"),
    ("api_bind = '8470'\n", {}, "config.toml: api_bind: expected HOST:PORT"),
    ("tick_s = -1\n", {}, "config.toml: tick_s: Input should be greater than 0"),
    ("launcher = 'slurm'\n", {"TSUP_LAUNCHER": "pbs"}, "environment TSUP_LAUNCHER: launcher: Input should be"),
    ("mqtt_url = 'http://x'\n", {}, "config.toml: mqtt_url: expected mqtt://HOST:PORT"),
    ("[broken\n", {}, "config.toml: not valid TOML"),
    ("api_bind = '0.0.0.0:8470'\n", {}, "api_bind: 0.0.0.0:8470 is reachable from the network"),
    ("api_bind = 'ctl.example:8470'\n", {}, "tokens would cross the network in clear"),
    ("slurm_bin_dir = 'opt/slurm/bin'\n", {}, "slurm_bin_dir: expected an absolute path"),
])
def test_a_bad_setting_is_named_with_where_it_came_from(tmp_path: Path, text: str, env: dict[str, str],
                                                        complaint: str) -> None:
    with pytest.raises(SpecError) as caught:
        load_service_config(write(tmp_path, text), env)
    assert complaint in str(caught.value)


def test_a_bad_flag_is_named(tmp_path: Path) -> None:
    with pytest.raises(SpecError, match="--api-bind: expected HOST:PORT"):
        serve_settings(_parser().parse_args(["serve", "--api-bind", "nowhere"]), {})
    with pytest.raises(SpecError, match="cannot read the config"):
        serve_settings(_parser().parse_args(["serve", "--config", str(tmp_path / "absent.toml")]), {})


def test_sd_notify_sends_ready_watchdog_and_stopping_to_the_socket(tmp_path: Path) -> None:
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as systemd:
        systemd.bind(str(tmp_path / "notify"))
        systemd.settimeout(2)
        n = Notifier({"NOTIFY_SOCKET": str(tmp_path / "notify"), "WATCHDOG_USEC": "4000000"})
        assert n.enabled and n.watchdog_s == 4.0
        assert n.ready("reconciling")
        assert systemd.recv(4096) == b"READY=1\nSTATUS=reconciling"
        assert n.watchdog() and not n.watchdog(), "at most four pings per watchdog interval"
        assert systemd.recv(4096) == b"WATCHDOG=1"
        assert n.stopping("bye")
        assert systemd.recv(4096) == b"STOPPING=1\nSTATUS=bye"


def test_sd_notify_is_silent_outside_systemd_and_for_another_pids_watchdog() -> None:
    assert not Notifier({}).ready("x")
    assert Notifier({"NOTIFY_SOCKET": "@x", "WATCHDOG_USEC": "1000", "WATCHDOG_PID": "1"}).watchdog_s is None
    assert Notifier({"NOTIFY_SOCKET": "@abstract"}).address == "\0abstract"


def test_json_log_lines_keep_their_fields_apart() -> None:
    record = logging.LogRecord("supervisor.daemon", logging.WARNING, __file__, 1, "tick failed: %s", ("disk",),
                               None)
    record.run_id = "run-3"
    doc = json.loads(JsonFormatter().format(record))
    assert doc["level"] == "warning" and doc["message"] == "tick failed: disk" and doc["run_id"] == "run-3"
    assert doc["logger"] == "supervisor.daemon" and isinstance(doc["ts"], float)


def test_sd_notify_never_blocks_on_a_receiver_that_stopped_reading(tmp_path: Path) -> None:
    """A datagram socket's queue holds a few messages (net.unix.max_dgram_qlen, 10 by
    default); a blocking send past that would wedge the reconciler that sends them."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as systemd:
        systemd.bind(str(tmp_path / "notify"))
        n = Notifier({"NOTIFY_SOCKET": str(tmp_path / "notify")})
        sent = [n.notify("WATCHDOG=1") for _ in range(2000)]
        assert sent[0] and not all(sent), "the queue fills up and later messages are dropped"


def test_healthz_says_stalled_once_no_tick_finished_for_the_limit(tmp_path: Path) -> None:
    """The daemon's health: unhealthy before the first tick, and once the last tick that
    finished is older than _STALLED_AFTER_S (a wedged reconciler); the link is reported."""
    import time

    from supervisor import daemon as daemon_mod

    d = daemon_mod.Daemon(daemon_mod.DaemonSettings(state_dir=tmp_path, api_port=None))
    assert not d.health().ok and d.health().last_tick_age_s is None
    d._last_tick_at = time.monotonic() - (daemon_mod._STALLED_AFTER_S - 1)
    assert d.health().ok
    d._last_tick_at = time.monotonic() - (daemon_mod._STALLED_AFTER_S + 1)
    h = d.health()
    assert not h.ok and h.last_tick_age_s is not None and h.last_tick_age_s > daemon_mod._STALLED_AFTER_S
    assert h.mqtt_connected is False


def test_the_api_beyond_loopback_needs_tls(tmp_path: Path) -> None:
    """Before: api_bind = 0.0.0.0 without TLS started, and every token crossed the network
    in clear (issue 26, item 12)."""
    with pytest.raises(SpecError, match=r"^api_bind: 10\.0\.0\.5:8470 is reachable from the network"):
        serve_settings(_parser().parse_args(["serve", "--api-bind", "10.0.0.5:8470"]), {})
    for loopback in ("127.0.0.1:8470", "[::1]:8470", "localhost:8470"):
        serve_settings(_parser().parse_args(["serve", "--api-bind", loopback]), {})
    cert, key = tmp_path / "tls.crt", tmp_path / "tls.key"
    with_tls = write(tmp_path, f"api_bind = '0.0.0.0:8470'\ntls_cert = '{cert}'\ntls_key = '{key}'\n")
    assert load_service_config(with_tls, {}).api_bind == "0.0.0.0:8470"


def test_the_daemons_text_log_escapes_control_characters(capsys: pytest.CaptureFixture[str]) -> None:
    """Trainer text in a log line: no forged line, no escape sequence (issue 26, item 12)."""
    import logging

    from supervisor import logs

    logs.configure("text", logging.INFO)
    logging.getLogger("t").warning("rank said %s", "boom\n2026-11-26 INFO forged\x1b[2J")
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "\x1b" not in err and "boom\\n2026-11-26 INFO forged\\x1b[2J" in err


def test_the_example_config_names_every_key_and_loads(tmp_path: Path) -> None:
    """systemd/config.example.toml is what an install starts from: every key of the daemon's
    config is in it (set, or commented out with its meaning); it loads as shipped, and with
    every commented-out key set as shown."""
    from supervisor.config import ServiceConfig
    from tests.conftest import REPO

    text = (REPO / "systemd" / "config.example.toml").read_text()
    settings = [line.lstrip("# ") for line in text.splitlines()
                if " = " in line.split("#  ")[0] or line.lstrip("# ").startswith("[[")]
    named = {line.split(" =", 1)[0] for line in settings} | {line.strip("[]") for line in settings
                                                             if line.startswith("[[")}
    assert set(ServiceConfig.model_fields) - named == set()
    assert load_service_config(write(tmp_path, text), {}).launcher == "slurm"
    # An external broker (mqtt_url) and the embedded one's mqtt_bind exclude each other.
    every = "\n".join(line.split(" #", 1)[0] for line in settings if not line.startswith("mqtt_url"))
    config = load_service_config(write(tmp_path, every), {})
    assert config.slurm_bin_dir == Path("/opt/slurm/bin") and config.mqtt_ca_file is not None
    assert [h.name for h in config.notify] == ["oncall"], "the tables come last: their keys are theirs"


def test_slurms_commands_run_from_slurm_bin_dir_also_behind_sudo(tmp_path: Path) -> None:
    from supervisor.slurm.commands import SlurmCommands

    (tmp_path / "squeue").write_text("#!/bin/sh\necho from-bin-dir \"$@\"\n")
    (tmp_path / "squeue").chmod(0o755)
    reply = SlurmCommands(bin_dir=tmp_path).run(["squeue", "--json"])
    assert reply.ok and reply.stdout.strip() == "from-bin-dir --json"
    admin = SlurmCommands(bin_dir=tmp_path, admin_prefix=("env",))
    assert admin.admin(["squeue", "-h"]).stdout.strip() == "from-bin-dir -h", "the prefix's command is found by name"
    assert SlurmCommands(bin_dir=tmp_path)._located(["/usr/bin/srun", "x"]) == ["/usr/bin/srun", "x"]
    assert SlurmCommands(bin_dir=tmp_path)._located(["sudo", "-n"]) == ["sudo", "-n"], "not Slurm's"

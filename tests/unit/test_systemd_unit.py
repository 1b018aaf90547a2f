"""The systemd unit: systemd's own checker accepts it, and it keeps the settings the
daemon relies on. The example config it names loads."""

from __future__ import annotations

import configparser
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

from supervisor.config import load_service_config
from tests.conftest import REPO, require

UNIT = REPO / "systemd" / "training-supervisor.service"
INSTALLED_EXE = "/opt/training-supervisor/.venv/bin/training-supervisor"


def parsed() -> configparser.ConfigParser:
    unit = configparser.ConfigParser(strict=True, interpolation=None)
    unit.optionxform = str  # type: ignore[assignment,method-assign]  # keys are case-sensitive
    unit.read_string(UNIT.read_text().replace("\\\n", " "))
    return unit


def verify(text: str, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    """systemd-analyze verify on the unit, with ExecStart pointing at this checkout's
    executable (the check insists that it exists)."""
    exe = Path(sys.executable).with_name("training-supervisor")
    unit = tmp_path / UNIT.name
    unit.write_text(text.replace(INSTALLED_EXE, str(exe)))
    return subprocess.run(["systemd-analyze", "verify", "--man=no", str(unit)],
                          capture_output=True, text=True, timeout=60)


def test_systemd_analyze_verify_accepts_the_unit(tmp_path: Path) -> None:
    require("systemd-analyze (Debian's systemd package)", shutil.which("systemd-analyze") is not None)
    ok = verify(UNIT.read_text(), tmp_path)
    assert (ok.returncode, ok.stderr) == (0, ""), ok.stderr
    # the check can fail: a misspelt setting is reported
    bad = verify(UNIT.read_text().replace("Type=notify", "Type=notifyy"), tmp_path)
    assert "Failed to parse service type" in bad.stderr


def test_unit_is_a_notify_service_with_a_watchdog_that_leaves_trainers_alive_on_restart() -> None:
    unit = parsed()
    service = unit["Service"]
    argv = shlex.split(service["ExecStart"])
    assert argv[0] == INSTALLED_EXE and argv[1] == "serve"
    assert argv[argv.index("--config") + 1] == "/etc/training-supervisor/config.toml"
    assert argv[argv.index("--state-dir") + 1] == "/var/lib/training-supervisor"
    assert (service["Type"], service["NotifyAccess"], service["WatchdogSec"]) == ("notify", "main", "30")
    assert service["StateDirectory"] == "training-supervisor"
    assert service["KillMode"] == "process", "a daemon restart must not kill the trainers it supervises"
    assert service["Restart"] == "on-failure"
    assert service["ProtectSystem"] == "strict" and service["NoNewPrivileges"] == "yes"
    assert "/var/lib/training-supervisor" in service["ReadWritePaths"].split()
    assert unit["Install"]["WantedBy"] == "multi-user.target"


def test_the_daemon_runs_as_its_own_user_and_may_write_the_example_shared_dir() -> None:
    service = parsed()["Service"]
    assert (service["User"], service["Group"]) == ("training-supervisor", "training-supervisor")
    config = load_service_config(REPO / "systemd" / "config.example.toml", {})
    assert str(config.shared_dir) in [p.lstrip("-") for p in service["ReadWritePaths"].split()]
    assert config.allow_root_runs is False


def test_the_example_config_loads() -> None:
    config = load_service_config(REPO / "systemd" / "config.example.toml", {})
    assert config.launcher == "slurm" and config.api_bind == "127.0.0.1:8470" and config.log_format == "json"

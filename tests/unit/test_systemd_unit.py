"""The systemd unit parses and keeps the settings the daemon relies on."""

from __future__ import annotations

import configparser
import shlex

from tests.conftest import REPO


def test_unit_runs_serve_and_leaves_trainers_alive_on_restart() -> None:
    text = (REPO / "systemd" / "training-supervisor.service").read_text().replace("\\\n", " ")
    unit = configparser.ConfigParser(strict=True, interpolation=None)
    unit.optionxform = str  # type: ignore[assignment,method-assign]  # keys are case-sensitive
    unit.read_string(text)
    service = unit["Service"]
    argv = shlex.split(service["ExecStart"])
    assert argv[0].endswith("/training-supervisor") and argv[1] == "serve"
    assert argv[argv.index("--state-dir") + 1] == "/var/lib/training-supervisor"
    assert service["StateDirectory"] == "training-supervisor"
    assert service["KillMode"] == "process", "a daemon restart must not kill the trainers it supervises"
    assert service["Restart"] == "on-failure"
    assert unit["Install"]["WantedBy"] == "multi-user.target"

"""The Prometheus alert rules shipped beside the unit (systemd/training-supervisor.rules.yml),
checked by Prometheus's own promtool: valid, and each alert firing on the series a
daemon's /metrics shows and quiet before (tests/prometheus/rules_test.yml). And each
metric the rules read is one the daemon exports."""

from __future__ import annotations

import re
import shutil
import subprocess

from tests.conftest import REPO, require

RULES = REPO / "systemd" / "training-supervisor.rules.yml"


def promtool(*args: str) -> subprocess.CompletedProcess[str]:
    tool = shutil.which("promtool") or "/usr/bin/promtool"
    require("promtool (Debian's prometheus package)", shutil.which(tool) is not None)
    return subprocess.run([tool, *args], capture_output=True, text=True, timeout=120, check=False,
                          cwd=REPO / "tests" / "prometheus")


def test_promtool_checks_the_shipped_rules_and_their_unit_tests_pass() -> None:
    checked = promtool("check", "rules", str(RULES))
    assert checked.returncode == 0 and "SUCCESS: 6 rules found" in checked.stdout, checked.stdout + checked.stderr
    tested = promtool("test", "rules", "rules_test.yml")
    assert tested.returncode == 0 and "SUCCESS" in tested.stdout, tested.stdout + tested.stderr


def test_every_metric_the_rules_read_is_exported_by_the_daemon() -> None:
    source = (REPO / "supervisor" / "metrics.py").read_text()
    read = set(re.findall(r"\b(tsup_[a-z_]+)", RULES.read_text()))
    exported = set(re.findall(r'"(tsup_[a-z_]+)"', source))
    assert read, "the rules read the daemon's metrics"
    assert {m.removesuffix("_count") for m in read} <= exported, read - exported

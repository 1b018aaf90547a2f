"""Dependencies point one way (DESIGN.md, "Top level"); checked on real imports."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.conftest import REPO


def loaded_after(*modules: str) -> set[str]:
    code = ("import json, sys\n" + "".join(f"import {m}\n" for m in modules)
            + "print(json.dumps(sorted({n.split('.')[0] for n in sys.modules})))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, check=True)
    return set(json.loads(out.stdout))


def test_the_daemon_and_the_clis_never_import_torch() -> None:
    assert "torch" not in loaded_after("supervisor.cli", "supervisor.daemon", "api.app", "api.ctl")


def test_the_decision_core_does_no_io() -> None:
    loaded = loaded_after("supervisor.policy", "supervisor.domain")
    assert not loaded & {"sqlalchemy", "aiomqtt", "psutil", "fastapi", "torch", "paho", "subprocess"}


@pytest.mark.parametrize(("package", "forbidden"), [
    ("health.__main__", {"supervisor", "trainer", "api"}),
    ("trainer.train", {"supervisor", "api", "health"}),
    ("trainer.protocol", {"supervisor", "api", "health", "torch"}),
])
def test_standalone_packages_import_nothing_of_the_others(package: str, forbidden: set[str]) -> None:
    assert not loaded_after(package) & forbidden

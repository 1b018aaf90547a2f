"""Dependencies point one way (docs/ARCHITECTURE.md, "Layers"): checked on real imports, and by the
import-linter contracts in pyproject.toml that ``make lint`` runs (each shown to fail on a
forbidden import)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO


def loaded_after(*modules: str) -> set[str]:
    code = ("import json, sys\n" + "".join(f"import {m}\n" for m in modules)
            + "print(json.dumps(sorted({n.split('.')[0] for n in sys.modules})))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, check=True)
    return set(json.loads(out.stdout))


def test_the_daemon_and_the_clis_never_import_torch() -> None:
    assert "torch" not in loaded_after("cli.daemon", "supervisor.daemon", "api.app", "cli.ctl")


def test_the_decision_core_does_no_io() -> None:
    loaded = loaded_after("supervisor.policy", "supervisor.domain")
    assert not loaded & {"sqlalchemy", "aiomqtt", "psutil", "fastapi", "torch", "paho", "subprocess"}


@pytest.mark.parametrize(("package", "forbidden"), [
    ("health.__main__", {"supervisor", "trainer", "api"}),
    ("trainer.train", {"supervisor", "api", "health"}),
    ("node.agent", {"sqlalchemy", "aiomqtt", "fastapi", "torch", "api", "health", "supervisor"}),
])
def test_standalone_packages_import_nothing_of_the_others(package: str, forbidden: set[str]) -> None:
    assert not loaded_after(package) & forbidden


def test_the_wire_package_imports_only_the_standard_library() -> None:
    modules = sorted(f"wire.{p.stem}" for p in (REPO / "wire").glob("*.py") if p.stem != "__init__")
    assert len(modules) >= 10, modules
    assert loaded_after(*modules) - loaded_after() - set(sys.stdlib_module_names) == {"wire"}


def test_the_daemon_and_the_api_load_no_trainer_module() -> None:
    assert not loaded_after("supervisor.daemon", "cli.daemon", "api.app", "cli.ctl") & {"trainer", "node"}


LINTED = ("cli", "supervisor", "api", "trainer", "health", "wire", "node", "slurmbox")


def lint_copy(tmp_path: Path, edit: tuple[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """``lint-imports`` (make lint's layering check) on a copy of the packages, with one
    line appended to one module."""
    for package in LINTED:
        shutil.copytree(REPO / package, tmp_path / package, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(REPO / "pyproject.toml", tmp_path / "pyproject.toml")
    if edit is not None:
        path, line = edit
        with open(tmp_path / path, "a") as f:
            f.write(f"\n{line}\n")
    lint = Path(sys.executable).with_name("lint-imports")
    return subprocess.run([str(lint), "--no-cache"], cwd=tmp_path, capture_output=True, text=True, check=False)


@pytest.mark.parametrize(("path", "line", "contract"), [
    ("supervisor/policy/detection.py", "import subprocess", "The decision core imports no I/O library"),
    ("supervisor/domain/records.py", "import psutil", "The decision core imports no I/O library"),
    ("supervisor/daemon.py", "import api.app", "The whole: the command lines, the API, the daemon"),
    ("supervisor/store/runs.py", "import supervisor.reconciler", "Layers of the daemon"),
    # observe, execute, probes and recorder are independent siblings (what they share is below them)
    ("supervisor/effects/runs.py", "import supervisor.gathering.observe", "Layers of the daemon"),
    ("supervisor/gathering/observe.py", "import supervisor.probes", "Layers of the daemon"),
    ("supervisor/recorder.py", "import supervisor.effects", "Layers of the daemon"),
    ("supervisor/probes.py", "import supervisor.recorder", "Layers of the daemon"),
    ("supervisor/gathering/observed.py", "import supervisor.gathering.run_memory", "Layers of the daemon"),
    ("supervisor/effects/nodes.py", "import supervisor.gathering.observe", "Layers of the daemon"),
    ("trainer/train.py", "import supervisor.spec", "The trainer stands alone"),
    ("supervisor/service.py", "import cli.completion", "The whole: the command lines, the API, the daemon"),
    ("api/app.py", "import cli.daemon", "The whole: the command lines, the API, the daemon"),
    ("trainer/train.py", "import node.compile_cache", "The node side: the node programs, the trainer"),
    ("supervisor/telemetry/outbox.py", "import sqlalchemy", "Only the store speaks SQL"),
    ("api/app.py", "from sqlalchemy import select", "Only the store speaks SQL"),
    ("supervisor/service.py", "import torch", "The daemon and the API never import torch"),
    ("health/wire.py", "import wire.codec", "The node probes stand alone"),
    ("wire/routes.py", "import uvicorn", "The wire package imports only the standard library"),
    ("supervisor/recorder.py", "import trainer.checkpoint_layout", "The daemon and the API reach the trainer through wire only"),
    ("cli/ctl.py", "import node.agent", "The daemon and the API reach the trainer through wire only"),
    ("supervisor/launchers/local.py", "import slurmbox.box", "The product never imports the development Slurm box"),
    ("node/agent.py", "import supervisor.store", "The node-side programs stand alone"),
    ("node/compile_cache.py", "import supervisor.slurm", "The node-side programs stand alone"),
])
def test_make_lint_fails_on_a_forbidden_import(tmp_path: Path, path: str, line: str, contract: str) -> None:
    out = lint_copy(tmp_path, (path, line))
    assert out.returncode != 0, out.stdout
    broken = [ln for ln in out.stdout.splitlines() if ln.endswith("BROKEN") or " BROKEN (" in ln]
    assert len(broken) == 1 and broken[0].startswith(contract), out.stdout


def test_the_tree_keeps_every_layering_contract(tmp_path: Path) -> None:
    out = lint_copy(tmp_path)
    assert out.returncode == 0 and "BROKEN" not in out.stdout, out.stdout

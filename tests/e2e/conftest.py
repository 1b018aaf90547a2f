"""End-to-end helpers: the real CLIs in subprocesses, real training, real signals."""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from tests.conftest import REPO

EXAMPLE = REPO / "examples" / "tiny-llama.toml"


def env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1"}


def tsup(*args: str | Path, timeout_s: float = 400) -> subprocess.CompletedProcess[str]:
    """`training-supervisor ARGS`, waited for."""
    return subprocess.run([sys.executable, "-m", "supervisor.cli", *map(str, args)], capture_output=True,
                          text=True, timeout=timeout_s, env=env(), cwd=REPO, check=False)


def ctl(url: str, *args: str, timeout_s: float = 60) -> subprocess.CompletedProcess[str]:
    """`supervisorctl --url URL ARGS`, waited for."""
    return subprocess.run([sys.executable, "-m", "api.ctl", "--url", url, *args], capture_output=True,
                          text=True, timeout=timeout_s, env=env(), cwd=REPO, check=False)


def summary_of(proc: subprocess.CompletedProcess[str]) -> dict[str, Any]:
    assert proc.stdout.strip(), f"no summary; exit {proc.returncode}; stderr:\n{proc.stderr[-3000:]}"
    data: dict[str, Any] = json.loads(proc.stdout)
    return data


def db_rows(state_dir: Path, query: str) -> list[tuple[Any, ...]]:
    conn = sqlite3.connect(state_dir / "supervisor.db")
    try:
        return conn.execute(query).fetchall()
    finally:
        conn.close()


def trainer_processes(marker: Path) -> list[psutil.Process]:
    """Live `python -m trainer` processes whose command line mentions ``marker`` (a state directory)."""
    found = []
    for p in psutil.process_iter(["cmdline", "status"]):
        try:
            cmdline = p.info["cmdline"] or []
            if (p.info["status"] != psutil.STATUS_ZOMBIE and cmdline[1:3] == ["-m", "trainer"]
                    and any(str(marker) in a for a in cmdline)):
                found.append(p)
        except psutil.Error:
            continue
    return found


@pytest.fixture(scope="session")
def fault_free(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """The example run with no fault: the reference every faulty run must match."""
    state = tmp_path_factory.mktemp("fault-free")
    proc = tsup("run", EXAMPLE, "--state-dir", state, "--json")
    assert proc.returncode == 0, proc.stderr[-3000:]
    yield summary_of(proc)

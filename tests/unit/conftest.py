"""Fixtures the unit tests of the accelerator probes share (test_health_nvidia.py,
test_health_neuron.py)."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture
def tools(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A folder of stand-in tools the probes find first (TSUP_HEALTH_TOOLS), with a PATH
    that holds sh and cat and never a real Neuron or NVIDIA tool."""
    directory = tmp_path / "tools"
    directory.mkdir()
    empty = tmp_path / "empty-path"
    empty.mkdir()
    monkeypatch.setenv("TSUP_HEALTH_TOOLS", str(directory))
    monkeypatch.setenv("PATH", f"{empty}:/usr/bin:/bin")
    return directory


def write_tool(tools: Path, name: str, body: str) -> None:
    """A stand-in tool ``name`` in ``tools``: a shell script of ``body``."""
    tools.mkdir(exist_ok=True)
    path = tools / name
    path.write_text(f"#!/bin/sh\n{body}\n")
    path.chmod(0o755)

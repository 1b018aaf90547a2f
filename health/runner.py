"""Run a probe's tool: an argv list, a timeout, never a shell, never an exception.

``run_tool`` tells the three outcomes apart: the tool is not installed (``missing``:
the node has no such devices), it ran (``ok`` with its exit code and output), or it
could not be run or timed out (``why``). Parsers look at the output, not at the exit
code alone: several tools print their verdict and exit non-zero on failure.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass

DEFAULT_TIMEOUT_S = 20.0  # Slurm gives a HealthCheckProgram 60 s in all


@dataclass(frozen=True, slots=True)
class ToolResult:
    argv: tuple[str, ...]
    missing: bool
    ran: bool
    returncode: int | None
    stdout: str
    stderr: str
    why: str  # empty when it ran


def find_tool(name: str) -> str | None:
    """The tool on PATH, or None. ``TSUP_HEALTH_TOOLS`` (a directory) is searched first,
    so that tests and drills can stand in for hardware tools per node."""
    extra = os.environ.get("TSUP_HEALTH_TOOLS")
    if extra:
        candidate = os.path.join(extra, name)
        if os.access(candidate, os.X_OK):
            return candidate
    return shutil.which(name)


def run_tool(argv: Sequence[str], timeout_s: float = DEFAULT_TIMEOUT_S) -> ToolResult:
    path = find_tool(argv[0])
    if path is None:
        return ToolResult(tuple(argv), True, False, None, "", "", f"{argv[0]} not installed")
    full = [path, *argv[1:]]
    try:
        done = subprocess.run(full, capture_output=True, text=True, errors="replace", timeout=timeout_s,
                              check=False, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        why = f"{argv[0]} timed out after {timeout_s:g} s"
        return ToolResult(tuple(argv), False, False, None, "", "", why)
    except OSError as e:
        return ToolResult(tuple(argv), False, False, None, "", "", f"cannot run {argv[0]}: {e}")
    return ToolResult(tuple(argv), False, True, done.returncode, done.stdout, done.stderr, "")

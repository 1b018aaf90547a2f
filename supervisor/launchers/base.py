"""The launcher port: how the reconciler starts, watches and stops an attempt's processes.

A launcher owns one kind of cluster (local processes today, Slurm steps next). Every
method is called from the reconciler's tick and must return quickly; none may treat a
failed observation as a dead process (it reports ProcState.UNKNOWN instead).

``launch_info`` is the launcher's own handle for a started attempt, serialized as a
string so that the store can keep it and a restarted daemon can re-adopt the attempt.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from supervisor.domain import ProcState


@dataclass(frozen=True, slots=True, kw_only=True)
class LaunchSpec:
    run_id: str
    attempt: int
    nodes: tuple[str, ...]
    ranks_per_node: int
    argv: tuple[str, ...]  # the trainer command, identical on every rank
    env: Mapping[str, str]  # added to every rank's environment
    log_dir: Path
    # A string found in every process's command line of this attempt and in no other
    # process (the attempt's config path): how a restarted daemon finds processes it
    # launched but had not yet recorded.
    marker: str


@dataclass(frozen=True, slots=True, kw_only=True)
class RankProc:
    rank: int
    node: str
    proc: ProcState
    exit_code: int | None = None  # negative: killed by that signal


class Launcher(Protocol):
    def allocate(self, count: int, idle: Sequence[str], known: set[str]) -> list[str]:
        """Nodes for a run: idle ones first, then new ones; may return fewer than asked."""
        ...

    def start(self, spec: LaunchSpec) -> str:
        """Start every rank; returns launch_info. Raises LaunchError."""
        ...

    def find(self, spec: LaunchSpec) -> str | None:
        """launch_info for processes of ``spec`` that exist but were never recorded."""
        ...

    def observe(self, launch_info: str) -> list[RankProc]: ...

    def stop(self, launch_info: str, *, force: bool) -> None:
        """SIGTERM every rank (SIGKILL when force); idempotent."""
        ...

    def forget(self, launch_info: str) -> None:
        """The attempt has ended: release whatever was kept to observe it."""
        ...

    def drain(self, node: str, reason: str) -> None: ...

    # Fault injection for --chaos: real signals to real processes.
    def kill_rank(self, launch_info: str, rank: int) -> str: ...

    def kill_node(self, launch_info: str, node: str) -> str: ...

"""Warm standby processes for the local launcher ([resources] standby = true).

After an attempt starts, and ``REFILL_AFTER_S`` later (so that their start does not
compete with the attempt's own), the pool keeps one standby process
(``python -m trainer --standby``, trainer/standby.py) per rank slot on each of the run's
healthy nodes, spares included: interpreter up and torch imported, waiting on a pipe.
The next attempt takes a node's standbys for its ranks there, and starts the rest cold;
what it used is replaced at the next refill.

A standby belongs to no attempt until it is assigned: its assignment (rank, world size,
master, the attempt's telemetry key) goes down its stdin, and only then does it join the
attempt, in its own process group. A node lost takes its standbys with it; a run that
ends, or a node no longer the run's, has its standbys stopped. A daemon that dies
closes every standby's pipe, and a standby whose input ends before an assignment exits:
none outlives the daemon that started it.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from supervisor import user_files, users
from supervisor.errors import CannotExecute
from supervisor.launchers.base import LaunchSpec
from wire import KEY_ENV
from wire.standby import SLOT_ENV, Assignment

# After an attempt starts, its ranks' own start-up has the cores first. On a real node
# (dozens of cores for a handful of ranks) nothing competes; on this 2-core machine the
# standbys' import slows the attempt's first seconds a little.
REFILL_AFTER_S = 5.0


def reference_args(argv: tuple[str, ...]) -> list[str] | None:
    """The arguments after ``python -m trainer`` when ``argv`` runs the reference trainer
    (what a standby can become), else None."""
    if len(argv) > 3 and argv[0] == sys.executable and argv[1:3] == ("-m", "trainer") and "--config" in argv:
        return list(argv[3:])
    return None


@dataclass
class _Standby:
    proc: subprocess.Popen[bytes]
    node: str
    slot: int  # the local rank it was warmed for


@dataclass
class _RunPool:
    spec: LaunchSpec  # the latest attempt's: nodes, user, environment
    refill_at: float
    waiting: list[_Standby] = field(default_factory=list)


class StandbyPool:
    def __init__(self, refill_after_s: float = REFILL_AFTER_S) -> None:
        self.refill_after_s = refill_after_s
        self._runs: dict[str, _RunPool] = {}

    def take(self, run_id: str, node: str, slot: int) -> subprocess.Popen[bytes] | None:
        """A live standby of the run waiting on ``node``, now no longer waiting: the one
        warmed for local rank ``slot`` (its device), else another of the node's."""
        pool = self._runs.get(run_id)
        if pool is None:
            return None
        mine = sorted((s for s in pool.waiting if s.node == node), key=lambda s: s.slot != slot)
        for s in mine:
            pool.waiting.remove(s)
            if s.proc.poll() is None:
                return s.proc
        return None

    @staticmethod
    def assign(proc: subprocess.Popen[bytes], a: Assignment) -> None:
        """Hand ``proc`` its assignment; raises OSError if it is gone."""
        assert proc.stdin is not None
        try:
            proc.stdin.write(a.encode())
            proc.stdin.flush()
        finally:
            with contextlib.suppress(OSError):
                proc.stdin.close()

    def plan(self, spec: LaunchSpec) -> None:
        """The attempt ``spec`` started: keep standbys for the next one on its
        ``standby_nodes`` (none: the run keeps none), from ``refill_after_s`` on."""
        if not spec.standby_nodes or reference_args(spec.argv) is None or spec.launch != "rank":
            self.release(spec.run_id)
            return
        pool = self._runs.setdefault(spec.run_id, _RunPool(spec=spec, refill_at=0.0))
        pool.spec, pool.refill_at = spec, time.monotonic() + self.refill_after_s

    def refill(self) -> int:
        """Start what is missing, where a refill is due; stop standbys on nodes no longer
        the run's and reap the dead. Returns how many were started."""
        now, started = time.monotonic(), 0
        for pool in self._runs.values():
            pool.waiting = [s for s in pool.waiting if s.proc.poll() is None]
            keep = set(pool.spec.standby_nodes)
            for s in [s for s in pool.waiting if s.node not in keep]:
                _stop(s.proc, signal.SIGKILL)
                pool.waiting.remove(s)
            if now < pool.refill_at:
                continue
            for node in pool.spec.standby_nodes:
                have = {s.slot for s in pool.waiting if s.node == node}
                for slot in (k for k in range(pool.spec.ranks_per_node) if k not in have):
                    proc = _spawn(pool.spec, node, slot)
                    if proc is None:
                        break
                    pool.waiting.append(_Standby(proc, node, slot))
                    started += 1
            pool.refill_at = float("inf")  # until the next attempt starts
        return started

    def signal_node(self, node: str, sig: signal.Signals) -> int:
        """``sig`` to the standbys waiting on ``node`` (chaos: the node dies or freezes)."""
        hit = 0
        for pool in self._runs.values():
            for s in pool.waiting:
                if s.node == node and s.proc.poll() is None:
                    _stop(s.proc, sig)
                    hit += 1
        return hit

    def release(self, run_id: str) -> None:
        pool = self._runs.pop(run_id, None)
        for s in pool.waiting if pool else []:
            _stop(s.proc, signal.SIGKILL)

    def waiting(self) -> dict[str, dict[str, int]]:
        """Live standbys waiting, per run and node (for /metrics; any thread may ask)."""
        out: dict[str, dict[str, int]] = {}
        for run_id, pool in list(self._runs.items()):
            for s in list(pool.waiting):
                if s.proc.poll() is None:
                    per_node = out.setdefault(run_id, {})
                    per_node[s.node] = per_node.get(s.node, 0) + 1
        return out


def _spawn(spec: LaunchSpec, node: str, slot: int) -> subprocess.Popen[bytes] | None:
    """A standby for ``spec``'s run on ``node``, for local rank ``slot``, as the run's
    user, with the run's environment but none of an attempt's (its ids, its telemetry key)."""
    try:
        run_as = users.for_launch(spec.user)
    except CannotExecute:  # the user is gone: no standbys; the cold start says why
        return None
    uid, gid, groups = users.popen_ids(run_as)
    logs = spec.log_dir.parent  # <run_dir>/attempts
    env = {**users.inherited_env(), **users.login_env(run_as),
           **{k: v for k, v in spec.env.items() if not k.startswith("TSUP_") and k != KEY_ENV},
           "TSUP_STANDBY": spec.run_id, "TSUP_NODE": node, SLOT_ENV: str(slot)}
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("PYTHONUNBUFFERED", "1")
    try:
        with os.fdopen(user_files.open_append(spec.log_base, logs / "standby.log"), "ab") as log:
            return subprocess.Popen(
                [sys.executable, "-m", "trainer", "--standby", str(logs.parent)], env=env,
                stdin=subprocess.PIPE, stdout=log, stderr=subprocess.STDOUT, process_group=0,
                close_fds=True, user=uid, group=gid, extra_groups=groups, cwd=spec.cwd)
    except (OSError, ValueError):
        return None


def _stop(proc: subprocess.Popen[bytes], sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(proc.pid, sig)
    if sig == signal.SIGKILL:
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=5)


def assignment_for(spec: LaunchSpec, env: dict[str, str], log: Path, argv: list[str]) -> Assignment:
    """What turns a standby into the rank that ``argv`` (the reference trainer's command,
    its placeholders filled) and ``env`` (what it lacks of the rank's environment) say."""
    args = reference_args(tuple(argv))
    if args is None:
        raise OSError(f"not the reference trainer: {argv[:3]}")
    return Assignment(argv=args, env=env, log=str(log), cwd=str(spec.cwd) if spec.cwd else None)

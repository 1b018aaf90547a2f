"""The one module that runs Slurm's commands: argv lists, a timeout each, never a shell.

Every call returns a ``Reply`` instead of raising: a command that cannot be started,
times out or exits non-zero is a failed reply with the reason, and the caller decides
what that means (for a poll: "state unknown", never "job failed").

``srun`` for a trainer step is the exception that outlives a call: ``start_step``
starts it in a session of its own, so that it survives the daemon (a restarted daemon
re-adopts the step by its name), and returns the ``Popen``.

Slurm's privileged calls (drain, resume, reservations) go through ``admin``, which puts
the config's ``slurm_admin_prefix`` (``sudo -n``) before them when the daemon's user is
no Slurm operator. ``user`` starts a command as a run's user (supervisor/users.py): the
allocation's ``sbatch`` and a step's ``srun``, so that its processes are that user's.

Commands that need not be awaited (``scancel`` of a step whose node is dead can block
for Slurm's MessageTimeout) go through ``fire``: started now, reaped by later calls.
"""

from __future__ import annotations

import logging
import os
import subprocess
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from supervisor import user_files, users
from supervisor.users import RunAs, popen_ids

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 10.0


@dataclass(frozen=True, slots=True)
class Reply:
    argv: tuple[str, ...]
    ok: bool
    stdout: str
    stderr: str
    why: str  # empty when ok: "timed out after 10 s", "exit 1: <stderr>"

    def describe(self) -> str:
        return f"{' '.join(self.argv[:2])}: {self.why}"


SLURM_COMMANDS = frozenset({"sbatch", "srun", "scontrol", "squeue", "scancel", "sinfo", "sacct", "salloc"})


class SlurmCommands:
    def __init__(self, *, slurm_conf: str | None = None, timeout_s: float = DEFAULT_TIMEOUT_S,
                 admin_prefix: tuple[str, ...] = (), bin_dir: Path | None = None) -> None:
        self.timeout_s = timeout_s
        self.admin_prefix = admin_prefix
        # Where Slurm's commands are (HyperPod: /opt/slurm/bin); None: the daemon's PATH.
        # An absolute path also reaches them through sudo, whose PATH is its own.
        self.bin_dir = bin_dir
        self._env = users.inherited_env()  # srun passes it on to the job's tasks
        if slurm_conf:
            self._env["SLURM_CONF"] = slurm_conf
        self._fired: list[tuple[subprocess.Popen[bytes], float]] = []
        self._lock = threading.Lock()  # the API's submit checks run in a worker thread
        self.calls = 0  # for tests and the health view: how many commands ran

    @property
    def slurm_conf(self) -> str | None:
        return self._env.get("SLURM_CONF")

    def run(self, argv: Sequence[str], *, timeout_s: float | None = None, stdin: str | None = None,
            user: RunAs | None = None) -> Reply:
        self._reap()
        self.calls += 1
        limit = timeout_s or self.timeout_s
        uid, gid, groups = popen_ids(user)
        argv = self._located(argv)
        try:
            # errors="replace": what Slurm prints (a Reason someone wrote) never stops a poll
            done = subprocess.run(list(argv), env=self._env, capture_output=True, text=True, input=stdin,
                                  errors="replace", timeout=limit, check=False, user=uid, group=gid,
                                  extra_groups=groups)
        except subprocess.TimeoutExpired:
            return Reply(tuple(argv), False, "", "", f"timed out after {limit:g} s")
        except (OSError, ValueError) as e:  # ValueError: an argument Popen cannot pass (a NUL byte)
            return Reply(tuple(argv), False, "", "", f"cannot run: {e}")
        if done.returncode != 0:
            err = " ".join(done.stderr.split())[:400] or "(no message)"
            return Reply(tuple(argv), False, done.stdout, done.stderr, f"exit {done.returncode}: {err}")
        return Reply(tuple(argv), True, done.stdout, done.stderr, "")

    def admin(self, argv: Sequence[str], *, timeout_s: float | None = None) -> Reply:
        """A call that needs Slurm operator rights, after ``admin_prefix``."""
        return self.run([*self.admin_prefix, *self._located(argv)], timeout_s=timeout_s)

    def _located(self, argv: Sequence[str]) -> Sequence[str]:
        """``argv`` with its command in ``bin_dir`` when that is set and it is one of Slurm's
        (an admin prefix's own command, sudo, is left to its PATH)."""
        if self.bin_dir is None or not argv or argv[0] not in SLURM_COMMANDS:
            return argv
        return [str(self.bin_dir / argv[0]), *argv[1:]]

    def fire(self, argv: Sequence[str], *, user: RunAs | None = None) -> None:
        """Start a command (as ``user``) and do not wait for it (its outcome is observed later)."""
        self._reap()
        self.calls += 1
        uid, gid, groups = popen_ids(user)
        try:
            p = subprocess.Popen(list(self._located(argv)), env=self._env, stdin=subprocess.DEVNULL,
                                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, user=uid, group=gid,
                                 extra_groups=groups)
        except (OSError, ValueError) as e:
            log.warning("cannot run %s: %s", argv[0], e)
            return
        with self._lock:
            self._fired.append((p, time.monotonic()))

    def start_step(
        self, argv: Sequence[str], *, env: Mapping[str, str], log_path: Path, user: RunAs | None = None,
        log_base: Path | None = None, input_pipe: bool = False,
    ) -> subprocess.Popen[bytes]:
        """Start ``srun`` for a step (as ``user``), its output appended to ``log_path``, a
        regular file reached from ``log_base`` without following a link (the directory is
        the run's user's: supervisor/user_files.py); ``input_pipe``: its input a pipe from
        here (else nothing). Raises OSError when it cannot be started, ValueError when an
        argument or variable cannot be passed (a NUL byte)."""
        self.calls += 1
        uid, gid, groups = popen_ids(user)
        stdin = subprocess.PIPE if input_pipe else subprocess.DEVNULL
        with os.fdopen(user_files.open_append(log_base or log_path.parent, log_path), "ab") as out:
            return subprocess.Popen(list(self._located(argv)), env={**self._env, **env}, stdin=stdin,
                                    stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                    close_fds=True, user=uid, group=gid, extra_groups=groups)

    def _reap(self) -> None:
        with self._lock:
            self._reap_locked()

    def _reap_locked(self) -> None:
        keep = []
        for p, started in self._fired:
            if p.poll() is not None:
                continue
            if time.monotonic() - started > 10 * self.timeout_s:
                p.kill()  # a command stuck this long will not help any more
                p.wait()
                continue
            keep.append((p, started))
        self._fired = keep

"""The one door into a run's tree: what the daemon reads, writes and moves among a run's
checkpoints and results is done by a process of the run's user.

A run's checkpoint directory, its output directory, its attempts' logs and the job's
scripts are the run's user's. Anything found there may have been put there to mislead a reader with more
rights: a link to another user's directory, a FIFO, a 1 GiB sparse file. Refusing each
trick where it is met (supervisor/user_files.py) is a list that can miss one; here the
whole class goes. Every scan, move, write and hash in a user's tree is a request to a
worker running as that user (its uid, its gid, its groups, no capability), so the most a
planted link can reach is what the user could reach alone. The daemon keeps its own
records (which checkpoints it moved, what it fingerprinted) in the store, never there.

- ``Tree`` is what the daemon asks: ``scan``, ``pick``, ``move_into``, ``set_aside``,
  ``keep_aside``, ``bring_back``, ``write_atomic``, ``read_text``, ``fingerprint``, and
  for the attempts' logs ``listdir``, ``size_of``, ``read_bytes`` (a
  ``user_files.Reader``). Each is one of ``OPS`` (or made of them): JSON in, JSON out,
  the same code whoever runs it.
- ``Local`` runs the ops in the daemon: for a run of the daemon's own user, where no
  right is to be dropped.
- ``Worker`` runs them in ``python -m supervisor.runfiles.user_tree`` started as the run's user,
  one per user, a request and its answer a JSON line each over a pipe. A request
  unanswered within ``REQUEST_TIMEOUT_S`` (a hung file system, a worker stopped by its
  user) kills the worker and raises ``TreeStalled``: the tick goes on. For
  ``STALLED_PAUSE_S`` after, that user's requests fail at once (``TreeStalled`` again),
  so that a user who stops her worker each time delays no other run's tick; then a new
  worker starts. An answer over ``ANSWER_MAX_BYTES`` or not JSON is a dead worker too.
- ``of(user)`` is the tree of a run's user (``users.for_launch``'s name); ``of_present``
  the same, None for a user gone from this host.

The worker has its user's rights and no more, so whatever it answers (its user may
ptrace it) can mislead only that user's own run.

Nothing else in the supervisor reaches into a run's checkpoint directory: an
import-linter contract (pyproject.toml) keeps the observer, the executor, the moves and
the API from importing the scanner or ``user_files`` themselves.
"""

from __future__ import annotations

import base64
import binascii
import errno
import json
import logging
import os
import selectors
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Collection, Sequence
from pathlib import Path
from typing import Any

from supervisor import user_files, users
from supervisor.errors import CannotExecute
from supervisor.runfiles import checkpoint_scan, precompile
from supervisor.runfiles.checkpoint_scan import SET_ASIDE, Verdict
from supervisor.user_files import TreeStalled, UnsafePath

__all__ = ["LOCAL", "SET_ASIDE", "Local", "Tree", "TreeStalled", "UnsafePath", "Verdict", "Worker", "of"]

log = logging.getLogger(__name__)

REQUEST_TIMEOUT_S = 5.0  # a request the worker has not answered by then: the worker is killed
STALLED_PAUSE_S = 60.0  # then no worker of that user for this long: its requests fail at once
START_TIMEOUT_S = 20.0  # a fresh worker's first answer (its interpreter and imports included)
ANSWER_MAX_BYTES = 8 << 20
REQUEST_MAX_BYTES = 1 << 20
READ_MAX_BYTES = 4 << 20  # of a file, a request (its answer base64: a third more)

Moves = precompile.Moves


def _str(path: Path | None) -> str | None:
    return None if path is None else str(path)


# --- the ops: what a worker does, JSON in and JSON out --------------------------------

def _scan(directory: str, layout: str | None) -> dict[str, Any]:
    out_of_range: list[Path] = []
    found = checkpoint_scan.scan(Path(directory), layout, out_of_range)
    return {"verdicts": [[v.step, str(v.path), v.ok, v.why, v.layout] for v in found],
            "out_of_range": [str(p) for p in out_of_range]}


def _move_into(base: str, path: str, into: str) -> str:
    return str(user_files.move_into(Path(base), Path(path), Path(into)))


def _write_atomic(base: str, path: str, text: str) -> None:
    user_files.write_atomic(Path(base), Path(path), text.encode())


def _base(base: str | None) -> Path | None:
    return None if base is None else Path(base)


def _read_bytes(path: str, limit: int, base: str | None, offset: int) -> str:
    limit = min(int(limit), READ_MAX_BYTES)
    data = user_files.read_bytes(Path(path), limit, base=_base(base), offset=int(offset))
    return base64.b64encode(data).decode()


OPS: dict[str, Callable[..., Any]] = {
    "scan": _scan,
    "move_into": _move_into,
    "exists": os.path.lexists,
    "is_dir": lambda path: os.path.isdir(path) and not os.path.islink(path),
    "write_atomic": _write_atomic,
    "read_text": lambda path, limit: user_files.read_text(Path(path), int(limit)),
    "listdir": lambda base, path: user_files.listdir(_base(base), Path(path)),
    "size_of": lambda path, base: user_files.size_of(Path(path), base=_base(base)),
    "read_bytes": _read_bytes,
    "newest_mtime": lambda base, path, suffix: user_files.newest_mtime(_base(base), Path(path), str(suffix)),
    "fingerprint": lambda shape, paths: precompile.fingerprint_of(shape, [Path(p) for p in paths]),
}


def _serve(request: dict[str, Any]) -> dict[str, Any]:
    """One request's answer: ``{"ok": result}`` or ``{"error": {...}}`` (never raises)."""
    try:
        op = OPS[request["op"]]
        return {"ok": op(**request.get("args", {}))}
    except UnsafePath as e:
        return {"error": {"type": "unsafe", "errno": e.errno, "message": str(e.strerror or e)}}
    except OSError as e:
        return {"error": {"type": "os", "errno": e.errno, "message": str(e.strerror or e)
                          + (f": {e.filename}" if e.filename else "")}}
    except (ValueError, KeyError, TypeError) as e:  # UnicodeDecodeError and bad JSON are ValueErrors
        return {"error": {"type": "value", "errno": None, "message": f"{type(e).__name__}: {e}"}}


def _raise(error: dict[str, Any]) -> None:
    kind, message = error.get("type"), str(error.get("message", ""))[:2000]
    code = error.get("errno") if isinstance(error.get("errno"), int) else errno.EIO
    if kind == "unsafe":
        raise UnsafePath(code, message)
    if kind == "os":
        raise OSError(code, message)  # FileNotFoundError for ENOENT, as a local call raises
    raise ValueError(message)


# --- the tree the daemon asks ---------------------------------------------------------

class Tree:
    """What the daemon does in a run's tree, each a request (``_call``) or made of them."""

    def _call(self, op: str, **args: Any) -> Any:
        raise NotImplementedError

    def scan(self, directory: Path, layout: str | None = None,
             out_of_range: list[Path] | None = None) -> list[Verdict]:
        """checkpoint_scan.scan, as the run's user."""
        found = self._call("scan", directory=str(directory), layout=layout)
        if out_of_range is not None:
            out_of_range.extend(Path(str(p)) for p in found["out_of_range"])
        return [Verdict(step=int(step), path=Path(str(path)), ok=bool(ok), why=str(why), layout=str(lay))
                for step, path, ok, why, lay in found["verdicts"]]

    def pick(self, directory: Path, layout: str | None = None, before_step: int | None = None,
             exclude: Collection[int] = (), out_of_range: list[Path] | None = None,
             ) -> tuple[Verdict | None, list[Verdict]]:
        """checkpoint_scan.pick, as the run's user."""
        return checkpoint_scan.pick_from(self.scan(directory, layout, out_of_range), before_step, exclude)

    def move_into(self, base: Path, path: Path, into: Path) -> Path:
        """user_files.move_into, as the run's user (what it makes is the user's)."""
        return Path(str(self._call("move_into", base=str(base), path=str(path), into=str(into))))

    def exists(self, path: Path) -> bool:
        """Whether anything (a link included) is at ``path``, as the run's user sees it."""
        return bool(self._call("exists", path=str(path)))

    def is_dir(self, path: Path) -> bool:
        """Whether ``path`` is a directory (not a link to one), as the run's user sees it."""
        return bool(self._call("is_dir", path=str(path)))

    def write_atomic(self, base: Path, path: Path, text: str) -> None:
        """user_files.write_atomic, as the run's user."""
        self._call("write_atomic", base=str(base), path=str(path), text=text)

    def read_text(self, path: Path, limit: int) -> str:
        """user_files.read_text, as the run's user."""
        return str(self._call("read_text", path=str(path), limit=limit))

    def listdir(self, base: Path | None, path: Path) -> list[str]:
        """user_files.listdir, as the run's user (a ``user_files.Reader``: a run's logs)."""
        return [str(name) for name in self._call("listdir", base=_str(base), path=str(path))]

    def size_of(self, path: Path, *, base: Path | None = None) -> int:
        """user_files.size_of, as the run's user."""
        return int(self._call("size_of", path=str(path), base=_str(base)))

    def read_bytes(self, path: Path, limit: int, *, base: Path | None = None, offset: int = 0) -> bytes:
        """user_files.read_bytes, as the run's user (at most ``READ_MAX_BYTES`` a request)."""
        text = self._call("read_bytes", path=str(path), limit=limit, base=_str(base), offset=offset)
        try:
            return base64.b64decode(str(text), validate=True)
        except binascii.Error:
            raise OSError(errno.EIO, f"{path}: the file worker's answer is not base64") from None

    def newest_mtime(self, base: Path | None, path: Path, suffix: str) -> float | None:
        """user_files.newest_mtime, as the run's user."""
        t = self._call("newest_mtime", base=_str(base), path=str(path), suffix=suffix)
        return None if t is None else float(t)

    def fingerprint(self, shape: str, paths: Sequence[Path]) -> str:
        """precompile.fingerprint_of, as the run's user (who can read the job's scripts)."""
        return str(self._call("fingerprint", shape=shape, paths=[str(p) for p in paths]))

    # --- moves made of the ops above -----------------------------------------------

    def set_aside(self, directory: Path, layout: str | None, keep: Path | None, keep_step: int,
                  into: Path) -> Moves:
        """Move every checkpoint of ``directory`` at ``keep_step`` or later, except ``keep``,
        into ``into``: for a trainer that searches the directory itself, so that it finds
        the one the supervisor chose (a newer one may be unreadable, or past a rollback).
        Nothing is deleted. Returns the moves made, (from, to)."""
        moved: Moves = []
        for v in self.scan(directory, layout):
            if v.step < keep_step or (keep is not None and v.path == keep):
                continue
            try:
                moved.append((v.path, self.move_into(directory, v.path, into)))
            except FileNotFoundError:
                continue  # the trainer deleted it meanwhile
        return moved

    def keep_aside(self, directory: Path, layout: str | None, attempt: int,
                   record: Callable[[Moves], None]) -> Moves:
        """Move every checkpoint of ``directory`` into ``.set-aside/before-precompile-N/``
        (supervisor/runfiles/precompile.py), recording the moves first (``record``: into the
        store), then each as it is made."""
        into = directory / SET_ASIDE / f"before-precompile-{attempt}"
        moved: Moves = []
        record(moved)  # even with nothing to move: the pass's own saves are set aside when it ends
        for v in self.scan(directory, layout):
            try:
                moved.append((v.path, self.move_into(directory, v.path,
                                                     into / v.path.parent.relative_to(directory))))
            except FileNotFoundError:
                continue
            record(moved)
        return moved

    def bring_back(self, directory: Path, layout: str | None, attempt: int,
                   moves: Moves) -> tuple[list[Path], list[Path]]:
        """After precompile attempt ``attempt``, whose ``moves`` kept the run's checkpoints
        aside: what it saved, into ``.set-aside/precompile-N/``, then the run's own back
        where they were. Returns (the pass's, those back); the caller then records that
        nothing is aside. Run again after a crash half way, it moves only what is still
        to move."""
        into = directory / SET_ASIDE / f"precompile-{attempt}"
        back_already = {src for src, dst in moves if not self.exists(dst)}
        saved: list[Path] = []
        for v in self.scan(directory, layout):
            if v.path in back_already:
                continue
            try:
                self.move_into(directory, v.path, into / v.path.parent.relative_to(directory))
            except FileNotFoundError:
                continue
            saved.append(v.path)
        back: list[Path] = []
        for src, dst in moves:
            if self.exists(dst) and not self.exists(src):
                self.move_into(directory, dst, src.parent)  # (dst's name is src's)
                back.append(src)
        return saved, back


class Local(Tree):
    """The ops run in the daemon itself: a run of the daemon's own user."""

    def _call(self, op: str, **args: Any) -> Any:
        # The same JSON round trip as a worker's, so that both answer alike.
        answer = _serve(json.loads(json.dumps({"op": op, "args": args})))
        if "error" in answer:
            _raise(answer["error"])
        return answer["ok"]


LOCAL = Local()


class Worker(Tree):
    """The ops run by ``python -m supervisor.runfiles.user_tree`` as ``user``; see the module docstring."""

    def __init__(self, user: users.RunAs, *, timeout_s: float = REQUEST_TIMEOUT_S,
                 pause_s: float = STALLED_PAUSE_S) -> None:
        self.user = user
        self.timeout_s = timeout_s
        self.pause_s = pause_s
        self._paused_until = 0.0  # after a stall: when a worker may start again (time.monotonic)
        self._proc: subprocess.Popen[bytes] | None = None
        self._lock = threading.Lock()  # the tick and the API's threads share a worker
        self.started = 0  # workers started, for tests and the log

    @property
    def pid(self) -> int | None:
        return None if self._proc is None else self._proc.pid

    def _start(self) -> subprocess.Popen[bytes]:
        uid, gid, groups = users.popen_ids(self.user)
        env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", **users.login_env(self.user)}
        # -I: no PYTHONPATH, no user site, no script directory: the daemon's own code only.
        self._proc = subprocess.Popen(
            [sys.executable, "-I", "-m", "supervisor.runfiles.user_tree"], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, cwd="/", env=env, user=uid, group=gid,
            extra_groups=groups, close_fds=True, start_new_session=True)
        os.set_blocking(self._proc.stdout.fileno(), False)  # type: ignore[union-attr]
        self.started += 1
        log.debug("started the file worker of %s (pid %d)", self.user.name, self._proc.pid)
        return self._proc

    def close(self) -> None:
        with self._lock:
            self._kill()

    def _kill(self) -> None:
        proc, self._proc = self._proc, None
        if proc is None:
            return
        proc.kill()
        proc.wait()
        for pipe in (proc.stdin, proc.stdout):
            if pipe is not None:
                pipe.close()

    def _call(self, op: str, **args: Any) -> Any:
        request = json.dumps({"op": op, "args": args}).encode() + b"\n"
        if len(request) > REQUEST_MAX_BYTES:
            raise ValueError(f"a request of {len(request)} bytes to the file worker: too big")
        with self._lock:
            if (wait := self._paused_until - time.monotonic()) > 0:
                raise TreeStalled(errno.ETIMEDOUT, f"the file worker of {self.user.name} stalled; "
                                                   f"none for another {wait:.0f} s")
            fresh = self._proc is None or self._proc.poll() is not None
            if fresh:
                self._kill()
                proc = self._start()
            else:
                assert self._proc is not None
                proc = self._proc
            wait = START_TIMEOUT_S if fresh else self.timeout_s
            try:
                assert proc.stdin is not None
                proc.stdin.write(request)
                proc.stdin.flush()
                answer = self._answer(proc, time.monotonic() + wait)
            except TreeStalled:
                self._kill()
                self._paused_until = time.monotonic() + self.pause_s
                raise
            except (OSError, ValueError) as e:  # a broken pipe, a worker that died or spoke nonsense
                self._kill()
                raise OSError(errno.EIO, f"the file worker of {self.user.name} failed: {e}") from None
        if "error" in answer:
            _raise(answer["error"])
        return answer["ok"]

    def _answer(self, proc: subprocess.Popen[bytes], deadline: float) -> dict[str, Any]:
        assert proc.stdout is not None
        buf = bytearray()
        with selectors.DefaultSelector() as sel:
            sel.register(proc.stdout, selectors.EVENT_READ)
            while b"\n" not in buf:
                left = deadline - time.monotonic()
                if left <= 0 or not sel.select(left):
                    raise TreeStalled(errno.ETIMEDOUT, f"the file worker of {self.user.name} did not answer "
                                                       f"within {self.timeout_s:g} s (killed)")
                chunk = os.read(proc.stdout.fileno(), 1 << 16)
                if not chunk:
                    raise ValueError("it exited")
                buf += chunk
                if len(buf) > ANSWER_MAX_BYTES:
                    raise ValueError(f"an answer over {ANSWER_MAX_BYTES} bytes")
        line, _, rest = bytes(buf).partition(b"\n")
        if rest:
            raise ValueError("more than one answer to a request")
        answer = json.loads(line)
        if not isinstance(answer, dict) or not ("ok" in answer or isinstance(answer.get("error"), dict)):
            raise ValueError("an answer of the wrong form")
        return answer


_workers: dict[tuple[int, int, tuple[int, ...]], Worker] = {}
_workers_lock = threading.Lock()


def of(user: str | None) -> Tree:
    """The tree of a run whose ``user`` is this (None: the daemon's own): ``LOCAL`` where
    the daemon runs as that user already, else that user's worker. CannotExecute when the
    user is gone from this host."""
    run_as = users.for_launch(user)
    if run_as is None or run_as.is_me:
        return LOCAL
    key = (run_as.uid, run_as.gid, run_as.groups)
    with _workers_lock:
        worker = _workers.get(key)
        if worker is None:
            worker = _workers[key] = Worker(run_as)
        return worker


def of_present(user: str | None) -> Tree | None:
    """``of``, or None when the user is gone from this host: nothing of theirs is read,
    and the run's next launch fails for that reason (``CannotExecute``)."""
    try:
        return of(user)
    except CannotExecute:
        return None


def close_all() -> None:
    """Stop every worker (the daemon's stop; a worker also ends when its pipe closes)."""
    with _workers_lock:
        workers = list(_workers.values())
        _workers.clear()
    for worker in workers:
        worker.close()


def main() -> None:
    """The worker: a JSON request a line on stdin, its answer a line on stdout, until EOF."""
    if os.geteuid() == 0:
        sys.exit("supervisor.runfiles.user_tree: the file worker runs as a run's user, never as root")
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    while line := stdin.readline(REQUEST_MAX_BYTES + 1):
        try:
            request = json.loads(line)
            answer = _serve(request) if isinstance(request, dict) else {
                "error": {"type": "value", "message": "a request is a JSON object"}}
        except ValueError as e:
            answer = {"error": {"type": "value", "message": f"not a request: {e}"}}
        stdout.write(json.dumps(answer).encode() + b"\n")
        stdout.flush()


if __name__ == "__main__":
    main()

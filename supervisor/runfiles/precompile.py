"""The job's precompile pass: whether one is due before the next attempt.

A Neuron job compiles its graphs before it trains. NxD Training's ``train.sh`` does it as
a pass of its own: run once with ``COMPILE=1``, it runs the training script under
``neuron_parallel_compile`` (which traces the first steps, then compiles every graph in
parallel into the compile cache) and exits; the real run then loads the graphs from the
cache instead of compiling them one by one, for hours. The seeds submit it as a job of its
own before the training job (seed 000).

A ``[command]`` with ``precompile_env`` gets that pass from the supervisor: the run's first
attempt is the command with those variables over its ``env``, and once it exits 0 the
training attempts follow. Before each later launch the pass is due again only when its
inputs changed, as this fingerprint says:

- the spec's command section and the nodes' shape (what the graphs are compiled for);
- the content of each file of ``precompile_inputs`` (default: ``argv[0]`` when it is a
  path, the job's script), relative to the command's ``cwd``, read on the controller as
  the run's user (supervisor/runfiles/user_tree.py) from the shared file system the nodes run it
  from. A file that cannot be read counts as
  its error, so that it becoming readable (or changing) makes the pass due again.

The fingerprint is taken on the tick, so its cost is bounded whatever the spec names
(a sparse file named 300 ways took 13 s a tick): at most ``MAX_PRECOMPILE_INPUTS`` files
(the spec refuses more), each read once per version (its device, inode, size and mtime:
a file under many names is read once), and a file over ``READ_MAX_BYTES`` counts by that
version alone, unread. Scripts and configs are far smaller.

A precompile attempt is an attempt like the others for faults, drains and the budget; it
differs in what it is not: it resumes from no checkpoint, its steps are not training (they
count for neither goodput nor a resume check, nor spikes nor stragglers), and its hang
limit is the compile allowance throughout.

Its checkpoints are not the run's. neuron_parallel_compile's trial run computes nothing
real (its outputs, "loss, checkpoints", are to be ignored, as it says itself), yet the job
saves as it always does: under the names of the run's own checkpoints, over them, or as a
newer one the next attempt would resume from. So the run's checkpoints are moved out of
the pass's way before it starts (``user_tree.Tree.keep_aside``, into ``.set-aside/before-precompile-N/``
of the checkpoint directory, each at its own relative path, the moves recorded with the
attempt in the store: ``Attempt.set_aside``, never a file in the user's tree, which its
user could replace by a link or a FIFO); once it has ended, whatever it saved is moved
into ``.set-aside/precompile-N/`` and the run's own come back (``Tree.bring_back``) before
anything else is launched (the policy waits on ``RunView.precompile_aside``). A daemon
killed in between finds the moves in the store and finishes the job on its next tick.
Nothing is deleted.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import stat
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Protocol

from supervisor.domain import Attempt, AttemptOutcome
from supervisor.spec import RunSpec
from supervisor.spec_command import MAX_PRECOMPILE_INPUTS


class Reader(Protocol):
    """Who reads the inputs: the run's user's door (supervisor/runfiles/user_tree.py's ``Tree``)."""

    def fingerprint(self, shape: str, paths: Sequence[Path]) -> str: ...

READ_MAX_BYTES = 1 << 20  # an input over this size counts by its version (stat), unread
_DIGESTS_KEPT = 256
_digests: dict[tuple[int, int, int, int], bytes] = {}  # a file's version: its digest


def inputs(spec: RunSpec, cwd: Path | None) -> list[Path]:
    """The files whose content the pass depends on, as the controller reads them."""
    assert spec.command is not None
    names = spec.command.precompile_inputs
    if names is None:
        first = spec.command.argv[0]
        names = [first] if "/" in first else []
    base = cwd if cwd is not None else Path("/")
    return [base / name for name in names]  # an absolute name stays as it is


def fingerprint(spec: RunSpec, cwd: Path | None, tree: Reader | None = None) -> str:
    """What the precompile pass compiles, as one hex digest (see the module docstring);
    its files read by ``tree`` (supervisor/runfiles/user_tree.py: as the run's user; None: here)."""
    assert spec.command is not None
    shape = json.dumps({"command": spec.command.model_dump(mode="json"),
                        "nodes": spec.resources.nodes, "ranks_per_node": spec.resources.ranks_per_node,
                        "accelerator": spec.resources.accelerator}, sort_keys=True)
    paths = inputs(spec, cwd)
    return fingerprint_of(shape, paths) if tree is None else tree.fingerprint(shape, paths)


def fingerprint_of(shape: str, paths: Sequence[Path]) -> str:
    """The digest of the pass's ``shape`` (its command and nodes, as JSON) and of the
    files ``paths``, each read once per version."""
    h = hashlib.sha256(shape.encode())
    for path in paths[:MAX_PRECOMPILE_INPUTS]:
        h.update(b"\0" + str(path).encode() + b"\0")
        try:  # read again only once it changed: a launch may be decided every tick
            st = os.stat(path)
        except OSError as e:
            h.update(_error(e))
            continue
        version = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
        if st.st_size > READ_MAX_BYTES:
            h.update(b"unread: %d bytes, modified %d" % (st.st_size, st.st_mtime_ns))
            continue
        digest = _digests.get(version)
        if digest is None:
            digest = _file_digest(path)
            if len(_digests) >= _DIGESTS_KEPT:
                del _digests[next(iter(_digests))]
            _digests[version] = digest
        h.update(digest)
    return h.hexdigest()


def due(fingerprint_now: str, attempts: Iterable[Attempt]) -> str | None:
    """``fingerprint_now`` unless an attempt already precompiled those inputs."""
    done = any(a.precompile == fingerprint_now and a.outcome is AttemptOutcome.SUCCEEDED for a in attempts)
    return None if done else fingerprint_now


def _file_digest(path: Path) -> bytes:
    """The file's SHA-256 (its first ``READ_MAX_BYTES``), or its error's name. Opened
    without blocking (a FIFO planted in its place would hang the daemon) and read only as
    a regular file."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        return _error(e)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return b"unreadable: not a regular file"
        h, left = hashlib.sha256(), READ_MAX_BYTES
        while left > 0 and (chunk := os.read(fd, left)):
            h.update(chunk)
            left -= len(chunk)
        return h.digest()
    except OSError as e:
        return _error(e)
    finally:
        os.close(fd)


def _error(e: OSError) -> bytes:
    return f"unreadable: {errno.errorcode.get(e.errno or 0, 'error')}".encode()


# --- the run's checkpoints, kept out of the pass's way ---------------------------------


Moves = list[tuple[Path, Path]]  # (where a checkpoint was, where it is now)


def moves_json(moves: Moves) -> str:
    return json.dumps([[str(src), str(dst)] for src, dst in moves])


def moves_of(text: str) -> Moves:
    return [(Path(src), Path(dst)) for src, dst in json.loads(text)]


def aside(attempts: Iterable[Attempt]) -> int | None:
    """The ended precompile attempt whose set-aside checkpoints are not back yet, if any."""
    last = next((a for a in reversed(tuple(attempts)) if a.precompile is not None), None)
    if last is None or last.outcome is None or last.set_aside is None:
        return None
    return last.number

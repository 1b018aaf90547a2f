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
  path, the job's script), relative to the command's ``cwd``, read here on the controller
  from the shared file system the nodes run it from. A file that cannot be read counts as
  its error, so that it becoming readable (or changing) makes the pass due again.

A precompile attempt is an attempt like the others for faults, drains and the budget; it
differs in what it is not: it resumes from no checkpoint and moves none aside, its steps
are not training (they count for neither goodput nor a resume check, nor spikes nor
stragglers), and its hang limit is the compile allowance throughout.
"""

from __future__ import annotations

import errno
import functools
import hashlib
import json
import os
import stat
from collections.abc import Iterable
from pathlib import Path

from supervisor.domain import Attempt, AttemptOutcome
from supervisor.spec import RunSpec

READ_MAX_BYTES = 64 << 20  # an input past this size is fingerprinted by its first 64 MiB
_CHUNK = 1 << 20


def inputs(spec: RunSpec, cwd: Path | None) -> list[Path]:
    """The files whose content the pass depends on, as the controller reads them."""
    assert spec.command is not None
    names = spec.command.precompile_inputs
    if names is None:
        first = spec.command.argv[0]
        names = [first] if "/" in first else []
    base = cwd if cwd is not None else Path("/")
    return [base / name for name in names]  # an absolute name stays as it is


def fingerprint(spec: RunSpec, cwd: Path | None) -> str:
    """What the precompile pass compiles, as one hex digest (see the module docstring)."""
    assert spec.command is not None
    h = hashlib.sha256()
    shape = {"command": spec.command.model_dump(mode="json"),
             "nodes": spec.resources.nodes, "ranks_per_node": spec.resources.ranks_per_node,
             "accelerator": spec.resources.accelerator}
    h.update(json.dumps(shape, sort_keys=True).encode())
    for path in inputs(spec, cwd):
        h.update(b"\0" + str(path).encode() + b"\0")
        try:  # read again only once it changed: a launch may be decided every tick
            st = os.stat(path)
            h.update(_file_digest(path, st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns))
        except OSError as e:
            h.update(_error(e))
    return h.hexdigest()


def due(fingerprint_now: str, attempts: Iterable[Attempt]) -> str | None:
    """``fingerprint_now`` unless an attempt already precompiled those inputs."""
    done = any(a.precompile == fingerprint_now and a.outcome is AttemptOutcome.SUCCEEDED for a in attempts)
    return None if done else fingerprint_now


@functools.lru_cache(maxsize=256)
def _file_digest(path: Path, *version: int) -> bytes:
    """The file's SHA-256, or its error's name (``version``: its stat, the cache's key).
    Opened without blocking (a FIFO planted in its place would hang the daemon) and read
    only as a regular file."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        return _error(e)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return b"unreadable: not a regular file"
        h, left = hashlib.sha256(), READ_MAX_BYTES
        while left > 0 and (chunk := os.read(fd, min(_CHUNK, left))):
            h.update(chunk)
            left -= len(chunk)
        return h.digest()
    except OSError as e:
        return _error(e)
    finally:
        os.close(fd)


def _error(e: OSError) -> bytes:
    return f"unreadable: {errno.errorcode.get(e.errno or 0, 'error')}".encode()

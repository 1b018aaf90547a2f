"""The Neuron compile cache that follows a run onto every node that joins it.

Each node compiles into a cache on its own disk (``NEURON_COMPILE_CACHE_URL``,
supervisor/runfiles/trainer_cmd.py: many nodes compiling at once into one shared directory would
contend for its locks, and reads stay local). A node that joins a run later (a hot spare,
a HyperPod replacement, the nodes of a requeued job) starts with an empty one, and would
compile every graph again while the other nodes wait in their collectives: tens of
minutes for a 70B model. So the run keeps a copy on its shared storage (the run
directory's ``neuron-compile-cache/``), and at the start of every attempt each node of it
first adds to that copy the graphs it has that the copy lacks (the precompile pass's,
those it compiled on its own), then takes from it the graphs it lacks, before its
trainer starts. The step's node wrapper runs this (supervisor/slurm/requests.py), on the
node, as the run's user: it touches only what that user may, and never the daemon.

The node's cache is in a directory anyone may create in (/var/tmp), under a name that
says whose it is: another user could make it first, and the run would load that user's
graphs. So it is used only when it is the run's user's own, a real directory no one else
may write (``own_cache``: made 0700 when missing); otherwise the sync says why and exits
``UNSAFE``, and the node wrapper starts no trainer (the attempt fails with that line).

Files are published by a rename (a reader never sees half a file), a module's ``done``
marker after the module's other files (Neuron trusts a module with one), and lock and
temporary files are never copied. Graphs compiled in the attempt just ended by a node
that is not in the next one reach the copy through the nodes that compiled them too
(every node of an SPMD job compiles the same graphs).

    python -m node.compile_cache SHARED LOCAL
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import stat
import sys
import time
from pathlib import Path

_NOT_COPIED = (".lock", ".tmp")
UNSAFE = 3  # the exit status for a node cache that is not the user's own


def own_cache(local: Path) -> str | None:
    """Why ``local`` may not be this user's compile cache (None: it may), made 0700 when
    missing."""
    local.parent.mkdir(parents=True, exist_ok=True)
    with contextlib.suppress(FileExistsError):
        os.mkdir(local, 0o700)
    st = os.lstat(local)
    if not stat.S_ISDIR(st.st_mode):
        return f"{local} is not a directory (a link or a file is there)"
    if st.st_uid != os.getuid():
        return f"{local} is uid {st.st_uid}'s, not this user's (uid {os.getuid()})"
    if st.st_mode & 0o022:
        return f"{local} may be written by others (mode {stat.filemode(st.st_mode)})"
    return None


def sync(shared: Path, local: Path) -> tuple[int, int]:
    """Make ``shared`` hold every graph file ``local`` holds, then ``local`` every one
    ``shared`` holds; (files pushed, files pulled)."""
    tag = f"{socket.gethostname()}.{os.getpid()}"
    return copy_missing(local, shared, tag), copy_missing(shared, local, tag)


def copy_missing(src: Path, dst: Path, tag: str) -> int:
    """Copy every regular file below ``src`` that ``dst`` lacks, each through a temporary
    name and a rename; links are neither followed nor copied. Returns how many."""
    copied = 0
    for where, dirs, names in os.walk(src):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        rel = Path(where).relative_to(src)
        for name in sorted(names, key=lambda n: (n.endswith("done"), n)):  # a "done" marker last
            if name.startswith(".") or name.endswith(_NOT_COPIED):
                continue
            source, target = Path(where) / name, dst / rel / name
            if target.exists() or source.is_symlink() or not source.is_file():
                continue
            target.parent.mkdir(parents=True, exist_ok=True)
            tmp = target.with_name(f".{name}.{tag}.tmp")
            try:
                shutil.copyfile(source, tmp)
                os.replace(tmp, target)
            except OSError:
                tmp.unlink(missing_ok=True)
                raise
            copied += 1
    return copied


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: python -m node.compile_cache SHARED LOCAL", file=sys.stderr)
        return 2
    shared, local = Path(argv[0]), Path(argv[1])
    began = time.monotonic()
    try:
        why = own_cache(local)
    except OSError as e:
        why = f"{local}: {e.strerror}"
    if why is not None:
        print(f"training-supervisor: compile cache: not used: {why}; remove it, or name a cache of the run's "
              "own in NEURON_COMPILE_CACHE_URL", flush=True)
        return UNSAFE
    try:
        pushed, pulled = sync(shared, local)
    except OSError as e:  # the trainer still runs: it compiles what it lacks
        print(f"training-supervisor: compile cache: cannot sync {local} with {shared}: {e}", flush=True)
        return 1
    print(f"training-supervisor: compile cache: {pulled} file(s) taken from {shared}, {pushed} added to it, "
          f"in {time.monotonic() - began:.1f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""Warm standby: a rank process made ready before a fault needs it.

    python -m trainer --standby LABEL

A standby does now what every rank of a new attempt would otherwise do after a fault:
start the interpreter and import torch with the trainer's distributed and checkpoint
modules (on this machine 6.8 s of a 10.3 s recovery, and on a real cluster the
container's and the CUDA or Neuron runtime's start). On a GPU it also creates its
device's context and warms the caching allocator with a first block
(``TSUP_STANDBY_SLOT``, the local rank it stands in for, names the device: the launcher
hands it that rank). Then it waits, doing nothing, for one line on its standard input:
its assignment, a JSON object

    {"argv": ["--config", FILE, "--resume", PATH], "env": {...}, "log": FILE, "cwd": DIR|null}

from the launcher that started it. It takes the assignment's variables (rank, world
size, master, the attempt's telemetry key: the pipe carries them, never argv or a
file), sends its output to the rank's log, and runs exactly what ``python -m trainer``
with that argv would. What depends on the rank or the resume point (the process group,
the sharded model, the restore) is done only then.

Under Slurm a generation of standbys is one srun step with ``--input=all``: srun passes
the line its launcher writes to every task. That line is then a broadcast,

    {"slots": {"NODE/LOCAL_RANK": ASSIGNMENT, ...}}

and each standby takes the assignment of its own slot (``slot_key``: its node, Slurm's
``SLURMD_NODENAME``, and its local rank, ``SLURM_LOCALID``); one whose slot is not in it
is not needed, and ends with status 0. The attempt's ranks share its telemetry key, so
no standby learns what another of its ranks does not know.

The end of its input before an assignment (the launcher gave up on it, or died) ends it
with status 0. ``LABEL`` is only for people and ``ps``: the launcher passes the run's
directory. Its name in the process table (``/proc/PID/comm``) says what it is:
``tsup-standby`` while it waits, ``tsup-a<N>`` once it is a rank of attempt N, since
its environment as ``/proc`` shows it stays the one it was started with.
"""

from __future__ import annotations

import ctypes
import os
import sys
import time
from collections.abc import Callable
from typing import IO

from wire.errors import EXIT_DO_NOT_RETRY, EXIT_OK
from wire.standby import parse_line, slot_key, slot_of

WAITING_NAME = "tsup-standby"
WARM_BYTES = 256 << 20  # a first block for the GPU's caching allocator, kept in its cache


def name_for(attempt: str) -> str:
    return f"tsup-a{attempt}"[:15]  # the kernel keeps 15 bytes of a process's name


def wait(run: Callable[[list[str]], int], stdin: IO[bytes] | None = None) -> int:
    """Get warm, wait for the assignment, then ``run(argv)`` (python -m trainer's main)."""
    started = time.monotonic()
    _set_name(WAITING_NAME)
    import torch  # noqa: F401  (the point of a standby: imported before it is needed)

    from trainer import checkpoint, train  # noqa: F401  (DCP and FSDP, and what they import)

    imported = time.monotonic()
    device = warm_device(slot_of(os.environ))
    ready = time.monotonic()
    warm_paths()
    warm = time.monotonic()
    print(f"standby: pid {os.getpid()} warm in {warm - started:.2f} s ({device} ready in "
          f"{ready - imported:.2f} s, first uses in {warm - ready:.2f} s), waiting for an assignment",
          flush=True)
    line = (stdin or sys.stdin.buffer).readline()
    if not line:
        return EXIT_OK
    key = slot_key(os.environ)
    try:
        a = parse_line(line, key)
    except ValueError as e:
        print(f"standby: error: a bad assignment: {e}", file=sys.stderr, flush=True)
        return EXIT_DO_NOT_RETRY
    if a is None:
        print(f"standby: slot {key} is not in the attempt: not needed", flush=True)
        return EXIT_OK
    _redirect_output(a.log)
    os.environ.update(a.env)
    if a.cwd is not None:
        os.chdir(a.cwd)
    _set_name(name_for(a.env.get("TSUP_ATTEMPT", "?")))
    print(f"standby: pid {os.getpid()} is rank {a.env.get('RANK', '?')} of attempt "
          f"{a.env.get('TSUP_ATTEMPT', '?')} (warm in {warm - started:.2f} s, then waited "
          f"{time.monotonic() - warm:.2f} s)", flush=True)
    return run(a.argv)


def warm_device(slot: str | None) -> str:
    """Create the GPU context of the device the slot's rank will use and give its caching
    allocator a first block, before the wait; returns the device's name ("cpu": nothing
    to warm)."""
    import torch

    if not torch.cuda.is_available():
        return "cpu"
    index = int(slot or 0) % torch.cuda.device_count()
    torch.cuda.set_device(index)
    torch.empty(WARM_BYTES, dtype=torch.uint8, device=f"cuda:{index}")  # freed into the allocator's cache
    torch.cuda.synchronize(index)
    return f"cuda:{index}"


def warm_paths() -> None:
    """Pay ahead what every rank pays the first time through its init and first step,
    whatever the model: the first tensor made on ``meta`` imports torch's reference
    decompositions (0.4 s of a 1.2 s init on this machine's CPU), and the first forward,
    backward and optimizer step set up autograd and AdamW's kernels. On the CPU, with the
    smallest shape, and thrown away: the rank builds its own model (seeded by its
    config, so nothing drawn here changes it) once it knows its place."""
    import torch

    from trainer.config import OptimizerConfig
    from trainer.model import Transformer
    from trainer.optim import build_optimizer
    from trainer.shapes import SHAPES

    shape = SHAPES["tiny"]
    with torch.device("meta"):
        Transformer(shape, rope_len=8)
    model = Transformer(shape, rope_len=8)
    optimizer = build_optimizer(model, OptimizerConfig())
    tokens = torch.zeros((1, 8), dtype=torch.long)
    logits = model(tokens)
    torch.autograd.backward(torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens.flatten()))
    optimizer.step()


def _redirect_output(path: str) -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)


_PR_SET_NAME = 15


def _set_name(name: str) -> None:
    """This process's name in /proc/PID/comm (Linux; elsewhere nothing happens)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_NAME, name.encode()[:15], 0, 0, 0)
    except (OSError, AttributeError):
        pass

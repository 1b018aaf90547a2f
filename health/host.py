"""Host probes: checkpoint filesystem space and write latency, memory, load, leftovers.

Each probe returns a ``Finding``; ``verdict`` folds findings into the node's verdict.
Thresholds are parameters with documented defaults, so an operator can tighten them.

Load and leftover trainers are the host's, not the node's, where several nodes share one
host (the local launcher's simulated nodes; a Slurm box's network namespaces): there one
node's probe would count its neighbours' load and trainers as its own. Such a node says
so (``shared`` here; ``--shared-host`` or ``TSUP_SHARED_HOST=1`` on the command line) and
those two findings are reported, not judged.
"""

from __future__ import annotations

import errno
import os
import pwd
import secrets
import time
from pathlib import Path

import psutil

from health.model import RUN_FILES, RUN_USER, Finding, Status


def disk(path: Path, *, min_free_gib: float = 10.0, degraded_free_gib: float = 50.0) -> Finding:
    try:
        usage = psutil.disk_usage(str(path))
    except OSError as e:
        return Finding(probe="disk", status=Status.UNKNOWN, evidence=f"probe failed: {path}: {e.strerror}")
    free_gib = usage.free / 2**30
    status = (Status.UNHEALTHY if free_gib < min_free_gib
              else Status.DEGRADED if free_gib < degraded_free_gib else Status.HEALTHY)
    return Finding(probe="disk", status=status,
                   evidence=f"{path}: {free_gib:.1f} GiB free of {usage.total / 2**30:.1f} GiB")


def nearest_existing(path: Path) -> Path:
    """``path``, or where it will be made: its nearest existing ancestor (a run's checkpoint
    directory does not exist before its first save)."""
    while not path.exists() and path.parent != path:
        path = path.parent
    return path


def write_latency(path: Path, *, max_ms: float = 500.0, size_bytes: int = 1 << 20,
                  runs: bool = False, ahead: Path | None = None) -> Finding:
    """Write and fsync 1 MiB where checkpoints go: a slow or hung filesystem shows here.
    The file is new, under a name nobody can guess, never through a link (O_EXCL,
    O_NOFOLLOW): the directory may be a user's, and the probe may run as root.

    ``runs``: a run's probe, as its user: a refusal to write there is the run's own (its
    checkpoint directory, the same on every node), not the node's. ``ahead``: the
    checkpoint directory ``path`` stands for until it exists."""
    probe_file = path / f".tsup-health-{os.getpid()}-{secrets.token_hex(8)}"
    created = False
    try:
        began = time.perf_counter()
        fd = os.open(probe_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        created = True
        with os.fdopen(fd, "wb") as f:
            f.write(os.urandom(size_bytes))
            f.flush()
            os.fsync(f.fileno())
        elapsed_ms = (time.perf_counter() - began) * 1000
    except OSError as e:
        refused = e.errno in (errno.EACCES, errno.EPERM) and runs
        if refused and ahead is not None:
            return Finding(probe="write_latency", status=Status.DEGRADED, evidence=(
                f"{ahead} does not exist yet, and {path}, where it will be, is not writable here: "
                "not measured"))
        if refused:
            return Finding(probe=RUN_FILES, status=Status.UNHEALTHY, evidence=(
                f"{path}: the run's checkpoint directory is not writable by uid {os.geteuid()}: "
                f"{e.strerror}"))
        return Finding(probe="write_latency", status=Status.UNHEALTHY,
                       evidence=f"{path}: cannot write: {e.strerror}")
    finally:
        if created:
            probe_file.unlink(missing_ok=True)
    status = Status.DEGRADED if elapsed_ms > max_ms else Status.HEALTHY
    where = f"{ahead} does not exist yet; at {path}" if ahead is not None else str(path)
    return Finding(probe="write_latency", status=status,
                   evidence=f"{where}: 1 MiB written and synced in {elapsed_ms:.1f} ms "
                            f"(limit {max_ms:.0f} ms)")


def memory(*, min_available_frac: float = 0.05) -> Finding:
    vm = psutil.virtual_memory()
    frac = vm.available / vm.total
    status = Status.DEGRADED if frac < min_available_frac else Status.HEALTHY
    return Finding(probe="memory", status=status,
                   evidence=f"{vm.available / 2**30:.1f} GiB available of {vm.total / 2**30:.1f} GiB")


SHARED_HOST_ENV = "TSUP_SHARED_HOST"  # "1": this node shares its host with other nodes
_NOT_JUDGED = "not judged: this node shares its host with other nodes"


def load(*, max_per_cpu: float = 4.0, shared: bool = False) -> Finding:
    one, _, _ = os.getloadavg()
    cpus = os.cpu_count() or 1
    evidence = f"load {one:.2f} on {cpus} CPUs"
    if shared:
        return Finding(probe="load", status=Status.HEALTHY, evidence=f"{evidence}: {_NOT_JUDGED}")
    status = Status.DEGRADED if one / cpus > max_per_cpu else Status.HEALTHY
    return Finding(probe="load", status=status, evidence=evidence)


# What the supervisor's launchers set in every process of an attempt, whatever its trainer
# (torchrun and its workers, a user's train.sh and what it runs), and in a node's own
# processes (its agent), which are no trainer.
_ATTEMPT_ENV, _NODE_PROCESS_ENV = "TSUP_MARKER", "TSUP_NODE_PROCESS"


def leftover_trainers(*, shared: bool = False) -> Finding:
    """Trainer processes still alive on a node that should be idle hold memory and devices:
    the reference trainer's (``python -m trainer``), and any process of an attempt (its
    environment names one), where this probe may read the environment (as root, or the
    run's user)."""
    left = trainer_pids()
    more = f" and {len(left) - 10} more" if len(left) > 10 else ""
    evidence = (f"{len(left)} trainer process(es) running: pids {', '.join(map(str, left[:10]))}{more}"
                if left else "no trainer process running")
    if shared:
        return Finding(probe="leftover_trainers", status=Status.HEALTHY,
                       evidence=f"{evidence}: {_NOT_JUDGED}")
    return Finding(probe="leftover_trainers", status=Status.DEGRADED if left else Status.HEALTHY,
                   evidence=evidence)


def trainer_pids() -> list[int]:
    """The pids ``leftover_trainers`` counts, in pid order (its evidence names ten)."""
    left = []
    for p in psutil.process_iter(["pid", "cmdline"]):
        if p.info["pid"] == os.getpid():
            continue
        cmdline = p.info["cmdline"] or []
        if cmdline[1:3] == ["-m", "trainer"] or _of_an_attempt(p):
            left.append(p.info["pid"])
    return left


def _of_an_attempt(p: psutil.Process) -> bool:
    try:
        env = p.environ()
    except (psutil.Error, OSError):  # another user's, or gone
        return False
    return bool(env.get(_ATTEMPT_ENV)) and not env.get(_NODE_PROCESS_ENV)


def run_user(name: str) -> Finding:
    """The account a run executes as, known on this node: Slurm starts a job's processes
    with the submitter's uid, and a node that cannot resolve it fails every launch."""
    try:
        pw = pwd.getpwnam(name)
    except KeyError:
        return Finding(probe=RUN_USER, status=Status.UNHEALTHY, evidence=(
            f"the run's user {name} does not exist on this node: nothing of the run can start here as "
            f"{name} (create the account on every node, on HyperPod in the cluster's lifecycle scripts, or "
            "set the daemon's run_as to an account the nodes have)"))
    return Finding(probe=RUN_USER, status=Status.HEALTHY,
                   evidence=f"the run's user {name} is uid {pw.pw_uid} here")


def required(paths: list[Path]) -> list[Finding]:
    """The files a run needs on this node (its command, its working directory: the
    supervisor names them), each there; a missing one makes the node unfit for that run,
    and says which. Missing on every node of the run, they are the run's fault, not its
    nodes' (the supervisor drains none for it: supervisor/policy/nodes.py)."""
    if not paths:
        return []
    missing = [p for p in paths if not (os.access(p, os.X_OK) if p.is_file() else p.is_dir())]
    if not missing:
        return [Finding(probe=RUN_FILES, status=Status.HEALTHY,
                        evidence=f"the run's files are here: {', '.join(map(str, paths))}")]
    return [Finding(probe=RUN_FILES, status=Status.UNHEALTHY,
                    evidence=f"{p} is missing on this node (or not executable): the run's command needs it")
            for p in missing]

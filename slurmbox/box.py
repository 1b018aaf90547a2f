"""A real Slurm cluster on one host: munged, slurmctld, and N slurmd posing as nodes.

For development and tests (``scripts/slurm-box up --nodes 3``). Everything it starts
lives in one directory of its own (config, munge key and socket, state, spool, logs,
pid files), on ports picked free at start, so that several boxes can run side by side
and ``down`` stops exactly what ``up`` started, by pid, never by name.

The recipe (Slurm 22.05 from Debian): each ``slurmd -N nodeK`` gets its own ``Port``
and ``%n`` in its spool and pid paths; ``NodeAddr`` is 127.0.0.1 and ``NodeHostname``
the real host name. Slurm reaches the box's private munged through
``AuthInfo=socket=...``, so the host's own munge, if any, is left alone.

Stdlib only: the script runs before any virtual environment exists.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

DEFAULT_DIR = Path(tempfile.gettempdir()) / "tsup-slurm-box"
SBIN = Path("/usr/sbin")


@dataclass
class Box:
    dir: str
    nodes: list[str]
    partition: str
    ctld_port: int
    node_ports: dict[str, int]
    munged_pid: int = 0
    ctld_pid: int = 0
    slurmd_pids: dict[str, int] = field(default_factory=dict)

    @property
    def conf(self) -> Path:
        return Path(self.dir) / "slurm.conf"

    @property
    def env(self) -> dict[str, str]:
        return {**os.environ, "SLURM_CONF": str(self.conf)}

    def slurmd_pid_file(self, node: str) -> Path:
        return Path(self.dir) / "run" / f"slurmd-{node}.pid"

    def spool(self, node: str) -> Path:
        return Path(self.dir) / "spool" / node


def _free_ports(count: int) -> list[int]:
    socks, ports = [], []
    try:
        for _ in range(count):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("127.0.0.1", 0))
            socks.append(s)
            ports.append(int(s.getsockname()[1]))
    finally:
        for s in socks:
            s.close()
    return ports


def _slurm_conf(box: Box, cpus: int, memory_mb: int) -> str:
    d = box.dir
    host = socket.gethostname()
    lines = [
        "# Written by scripts/slurm-box: a Slurm cluster on one host, for development and tests.",
        f"ClusterName=tsupbox{box.ctld_port}",
        f"SlurmctldHost={host}(127.0.0.1)",
        f"SlurmctldPort={box.ctld_port}",
        f"SlurmdPort={box.node_ports[box.nodes[0]]}",
        "SlurmUser=root",
        "SlurmdUser=root",
        "AuthType=auth/munge",
        f"AuthInfo=socket={d}/munge/munge.socket",
        "CredType=cred/munge",
        f"StateSaveLocation={d}/state",
        f"SlurmdSpoolDir={d}/spool/%n",
        f"SlurmctldPidFile={d}/run/slurmctld.pid",
        f"SlurmdPidFile={d}/run/slurmd-%n.pid",
        f"SlurmctldLogFile={d}/log/slurmctld.log",
        f"SlurmdLogFile={d}/log/slurmd-%n.log",
        "ProctrackType=proctrack/linuxproc",
        "TaskPlugin=task/none",
        "SchedulerType=sched/backfill",
        "SelectType=select/cons_tres",
        "SelectTypeParameters=CR_Core",
        "ReturnToService=2",
        # A lost slurmd is noticed in about 10-25 s here (300 s is Slurm's default): the
        # supervisor's own detection from heartbeats must not depend on it.
        "SlurmdTimeout=10",
        "InactiveLimit=0",
        "MinJobAge=300",
        "KillWait=5",
        "MessageTimeout=5",
        "JobAcctGatherType=jobacct_gather/none",
        "AccountingStorageType=accounting_storage/none",
        "MpiDefault=none",
        "LaunchParameters=use_interactive_step",
    ]
    for node in box.nodes:
        lines.append(
            f"NodeName={node} NodeHostname={host} NodeAddr=127.0.0.1 Port={box.node_ports[node]} "
            f"CPUs={cpus} RealMemory={memory_mb} State=UNKNOWN"
        )
    lines.append(f"PartitionName={box.partition} Nodes={','.join(box.nodes)} Default=YES "
                 "MaxTime=INFINITE State=UP")
    return "\n".join(lines) + "\n"


def _read_pid(path: Path, timeout_s: float = 10.0) -> int:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            text = path.read_text().strip()
            if text:
                return int(text)
        except (FileNotFoundError, ValueError):
            pass
        time.sleep(0.05)
    raise RuntimeError(f"{path} did not appear within {timeout_s:.0f} s")


def _run(argv: list[str], box: Box, timeout_s: float = 10.0) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, env=box.env, capture_output=True, text=True, timeout=timeout_s, check=False)


def up(directory: Path, nodes: int, *, cpus: int = 2, memory_mb: int = 4000, partition: str = "train",
       timeout_s: float = 60.0) -> Box:
    missing = [b for b in ("munged", "slurmctld", "slurmd") if not (SBIN / b).exists()]
    if missing or shutil.which("sinfo") is None:
        raise RuntimeError(f"Slurm box needs {', '.join(missing or ['slurm-client'])} "
                           "(scripts/install-system-deps installs them as root)")
    if (directory / "box.json").exists():
        raise RuntimeError(f"{directory} already holds a box: run `slurm-box down --dir {directory}` first")
    names = [f"node{k}" for k in range(1, nodes + 1)]
    ports = _free_ports(nodes + 1)
    box = Box(dir=str(directory.resolve()), nodes=names, partition=partition, ctld_port=ports[0],
              node_ports=dict(zip(names, ports[1:], strict=True)))
    for sub in ("state", "spool", "run"):  # a box from before leaves state Slurm would reuse
        shutil.rmtree(directory / sub, ignore_errors=True)
    for sub in ("munge", "state", "spool", "log", "run"):
        (directory / sub).mkdir(parents=True, exist_ok=True)
    os.chmod(directory / "munge", 0o700)
    key = directory / "munge" / "munge.key"
    key.write_bytes(secrets.token_bytes(1024))
    os.chmod(key, 0o600)
    box.conf.write_text(_slurm_conf(box, cpus, memory_mb))
    _save(box)  # from here on, `down` can clean up whatever got started
    try:
        _start(box, directory, key, timeout_s)
    except BaseException:
        down(directory)  # nothing half-started is left behind
        raise
    return box


def _start(box: Box, directory: Path, key: Path, timeout_s: float) -> None:
    m = directory / "munge"
    subprocess.run(
        [str(SBIN / "munged"), "--force", f"--socket={m}/munge.socket", f"--key-file={key}",
         f"--pid-file={m}/munged.pid", f"--log-file={directory}/log/munged.log",
         f"--seed-file={m}/munged.seed"],
        check=True, capture_output=True, timeout=timeout_s,
    )
    box.munged_pid = _read_pid(m / "munged.pid")
    _save(box)
    start_ctld(box, clear=True, timeout_s=timeout_s)
    for node in box.nodes:
        start_node(box, node, timeout_s=timeout_s)
    wait_idle(box, timeout_s)


def start_ctld(box: Box, *, clear: bool = False, timeout_s: float = 30.0) -> int:
    """Start slurmctld: with ``clear``, a new cluster; else it recovers the jobs and
    nodes from its saved state, as after a crash of the controller."""
    pid_file = Path(box.dir) / "run" / "slurmctld.pid"
    pid_file.unlink(missing_ok=True)
    subprocess.run([str(SBIN / "slurmctld"), *(["-c"] if clear else []), "-f", str(box.conf)], env=box.env,
                   check=True, capture_output=True, timeout=timeout_s)
    box.ctld_pid = _read_pid(pid_file)
    _save(box)
    return box.ctld_pid


def start_node(box: Box, node: str, *, timeout_s: float = 30.0) -> int:
    """Start (or restart) the slurmd posing as ``node``."""
    box.spool(node).mkdir(parents=True, exist_ok=True)
    pid_file = box.slurmd_pid_file(node)
    pid_file.unlink(missing_ok=True)
    subprocess.run([str(SBIN / "slurmd"), "-f", str(box.conf), "-N", node], env=box.env, check=True,
                   capture_output=True, timeout=timeout_s)
    box.slurmd_pids[node] = _read_pid(pid_file)
    _save(box)
    return box.slurmd_pids[node]


def wait_idle(box: Box, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    last = ""
    while time.monotonic() < deadline:
        try:
            out = _run(["sinfo", "-h", "-N", "-o", "%N %t"], box)
            last = out.stdout.strip() or out.stderr.strip()
            states = dict(line.split() for line in out.stdout.splitlines() if line.strip())
            if out.returncode == 0 and all(states.get(n) == "idle" for n in box.nodes):
                return
        except (subprocess.TimeoutExpired, ValueError):
            pass
        time.sleep(0.3)
    raise RuntimeError(f"nodes not idle after {timeout_s:.0f} s; sinfo says: {last}")


# --- processes ----------------------------------------------------------------------


def _ppid_map() -> dict[int, int]:
    out: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # The command name is in parentheses and may itself hold spaces or ')'.
        fields = stat[stat.rindex(")") + 2:].split()
        out[int(entry.name)] = int(fields[1])
    return out


def _descendants(roots: set[int], ppids: dict[int, int]) -> set[int]:
    found = set(roots)
    grew = True
    while grew:
        grew = False
        for pid, ppid in ppids.items():
            if ppid in found and pid not in found:
                found.add(pid)
                grew = True
    return found


def _unix_socket_paths() -> dict[str, str]:
    """socket inode -> bound path, from /proc/net/unix."""
    out: dict[str, str] = {}
    try:
        lines = Path("/proc/net/unix").read_text().splitlines()[1:]
    except OSError:
        return out
    for line in lines:
        parts = line.split()
        if len(parts) >= 8:
            out[parts[6]] = parts[7]
    return out


def stepd_pids(spool: Path) -> set[int]:
    """The slurmstepd processes serving steps of the slurmd whose spool is ``spool``.

    slurmstepd detaches from slurmd, so it is found by the unix socket it listens on in
    that node's spool directory.
    """
    paths = _unix_socket_paths()
    prefix = str(spool) + "/"
    found: set[int] = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if (entry / "comm").read_text().strip() != "slurmstepd":
                continue
            for fd in (entry / "fd").iterdir():
                target = os.readlink(fd)
                if target.startswith("socket:[") and paths.get(target[8:-1], "").startswith(prefix):
                    found.add(int(entry.name))
                    break
        except OSError:
            continue
    return found


def node_processes(box: Box, node: str) -> set[int]:
    """Every process a node of the box runs: its slurmd, its slurmstepds and their tasks."""
    roots = set(stepd_pids(box.spool(node)))
    pid = box.slurmd_pids.get(node)
    if pid and _alive(pid):
        roots.add(pid)
    return _descendants(roots, _ppid_map()) if roots else set()


def kill_node(box: Box, node: str) -> list[int]:
    """SIGKILL everything ``node`` runs at once, as a node that loses power."""
    return signal_node(box, node, signal.SIGKILL)


def signal_node(box: Box, node: str, sig: signal.Signals) -> list[int]:
    """Send ``sig`` to everything ``node`` runs (SIGSTOP: a node frozen or cut off)."""
    pids = sorted(node_processes(box, node))
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)
    return pids


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie is dead for our purposes
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def down(directory: Path, timeout_s: float = 3.0) -> list[int]:
    """Stop what ``up`` started in ``directory``, by pid; returns the pids signalled.
    SIGTERM, then SIGKILL after ``timeout_s``: a box is thrown away, and slurmctld, a
    slurmd and its slurmstepd can each wait many seconds on a node that was killed."""
    box = load(directory)
    if box is None:
        return []
    pids: set[int] = set()
    for node in box.nodes:
        pids |= node_processes(box, node)
    pids |= {p for p in (box.ctld_pid, box.munged_pid) if p}
    pids = {p for p in pids if _alive(p)}
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and any(_alive(p) for p in pids):
        time.sleep(0.1)
    for pid in [p for p in pids if _alive(p)]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    (Path(box.dir) / "box.json").unlink(missing_ok=True)
    return sorted(pids)


def _save(box: Box) -> None:
    path = Path(box.dir) / "box.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(asdict(box), indent=1))
    tmp.replace(path)


def load(directory: Path) -> Box | None:
    try:
        return Box(**json.loads((directory / "box.json").read_text()))
    except FileNotFoundError:
        return None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="slurm-box", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    u = sub.add_parser("up", help="start munged, slurmctld and N slurmd")
    u.add_argument("--nodes", type=int, default=3)
    u.add_argument("--cpus", type=int, default=2, help="CPUs each node declares")
    u.add_argument("--partition", default="train")
    d = sub.add_parser("down", help="stop what `up` started, by pid")
    k = sub.add_parser("kill-node", help="SIGKILL a node's slurmd and everything it started")
    k.add_argument("node")
    r = sub.add_parser("start-node", help="start a node's slurmd again")
    r.add_argument("node")
    sub.add_parser("env", help="print the export line for SLURM_CONF")
    for p in (u, d, k, r):
        p.add_argument("--dir", type=Path, default=DEFAULT_DIR)
    args = ap.parse_args(argv)
    directory: Path = getattr(args, "dir", DEFAULT_DIR)
    try:
        if args.cmd == "up":
            if not 1 <= args.nodes <= 64:
                raise RuntimeError("--nodes: expected 1 to 64")
            box = up(directory, args.nodes, cpus=args.cpus, partition=args.partition)
            print(f"slurm-box: {len(box.nodes)} nodes up in {box.dir}", file=sys.stderr)
            print(f"export SLURM_CONF={box.conf}")
            return 0
        if args.cmd == "down":
            pids = down(directory)
            print(f"slurm-box: stopped {len(pids)} process(es)" if pids else "slurm-box: nothing running",
                  file=sys.stderr)
            return 0
        box_or_none = load(directory)
        if box_or_none is None:
            raise RuntimeError(f"no box in {directory}")
        if args.cmd == "env":
            print(f"export SLURM_CONF={box_or_none.conf}")
        elif args.cmd == "kill-node":
            killed = kill_node(box_or_none, args.node)
            print(f"slurm-box: SIGKILL to {len(killed)} process(es) of {args.node}", file=sys.stderr)
        elif args.cmd == "start-node":
            start_node(box_or_none, args.node)
        return 0
    except (RuntimeError, OSError, subprocess.SubprocessError) as e:
        print(f"slurm-box: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())

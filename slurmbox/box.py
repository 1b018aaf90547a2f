"""A real Slurm cluster on one host: munged, slurmctld, and N slurmd posing as nodes,
each node a host of its own on a private network.

For development and tests (``scripts/slurm-box up --nodes 3``). Everything it starts
lives in one directory of its own (config, munge key and socket, state, spool, logs,
pid files), on ports picked free at start, so that several boxes can run side by side
and ``down`` stops exactly what ``up`` started, by pid, never by name.

The network: a bridge on this host is the cluster network, and the controller (slurmctld,
and the supervisor with its broker) is this host at the bridge's address ``10.77.N.1``.
Each node's slurmd runs in a network namespace of its own, with one end of a veth pair
on the bridge and the address ``10.77.N.(10+k)``: 127.0.0.1 on a node is that node
alone, as on a real cluster, so whatever a rank reaches it reaches over the network. The
process table and munge stay shared, and so does the file system but for /dev/shm and
/var/tmp: each slurmd runs in a mount namespace of its own with a tmpfs at /dev/shm, the
node's memory, which no other node and not the controller can see, and which goes with
the node when everything it runs is killed (a node started again comes back with an empty
one, as after a power loss), and a directory of the box's at /var/tmp, the node's local
disk (``Box.var_tmp``), which stays. ``partition_node`` takes a node's
link down (its processes live on, cut off) and ``heal_node`` brings it back;
``throttle_node`` slows its link both ways (``tc`` token bucket) and ``unthrottle_node``
takes that away;
``kill_node --power-loss`` takes the link down before it kills everything the node runs. Each box
picks a subnet no other address of this host uses and names its bridge, links and
namespaces after its slurmctld port; ``down`` deletes them.

The Slurm recipe (22.05 from Debian): each ``slurmd -N nodeK`` gets its own ``Port``
and ``%n`` in its spool and pid paths; ``NodeAddr`` is the node's address and
``NodeHostname`` the real host name. Slurm reaches the box's private munged through
``AuthInfo=socket=...``, so the host's own munge, if any, is left alone. slurmd starts
through ``nsenter --net=...``: ``ip netns exec`` would also remount /sys, where slurmd
finds no cgroup file system; then ``unshare --mount``, which mounts its /dev/shm and /var/tmp.

Stdlib only: the script runs before any virtual environment exists.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import ipaddress
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
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

from supervisor.ports import free_port
from supervisor.slurm.launcher import RENDEZVOUS_PORTS

DEFAULT_DIR = Path(tempfile.gettempdir()) / "tsup-slurm-box"
SBIN = Path("/usr/sbin")
NETWORK = ipaddress.ip_network("10.77.0.0/16")  # each box takes one /24 of it
NETNS_DIR = Path("/var/run/netns")
# Held while a box picks its subnet and makes its bridge: two boxes coming up at once
# must not pick the same one.
_NET_LOCK = Path(tempfile.gettempdir()) / "tsup-slurm-box.net.lock"


@dataclass
class Box:
    dir: str
    nodes: list[str]
    partition: str
    ctld_port: int
    node_ports: dict[str, int]
    subnet: str = ""  # the cluster network, "10.77.N.0/24"
    munged_pid: int = 0
    ctld_pid: int = 0
    slurmd_pids: dict[str, int] = field(default_factory=dict)

    @property
    def conf(self) -> Path:
        return Path(self.dir) / "slurm.conf"

    # --- the network: names derive from the slurmctld port, unique on this host --------

    @property
    def bridge(self) -> str:
        return f"tsb{self.ctld_port}"

    @property
    def controller_addr(self) -> str:
        """This host's address on the cluster network: what the nodes reach it by."""
        return str(ipaddress.ip_network(self.subnet)[1])

    def addr(self, node: str) -> str:
        return str(ipaddress.ip_network(self.subnet)[10 + self.nodes.index(node) + 1])

    def netns(self, node: str) -> str:
        return f"tsup-{self.ctld_port}-{node}"

    def link(self, node: str) -> str:
        """The host's end of the node's link (the node's end is its eth0)."""
        return f"tsb{self.ctld_port}n{self.nodes.index(node) + 1}"

    @property
    def env(self) -> dict[str, str]:
        return {**os.environ, "SLURM_CONF": str(self.conf)}

    def slurmd_pid_file(self, node: str) -> Path:
        return Path(self.dir) / "run" / f"slurmd-{node}.pid"

    def spool(self, node: str) -> Path:
        return Path(self.dir) / "spool" / node

    def var_tmp(self, node: str) -> Path:
        """The node's own /var/tmp (its local disk: the Neuron compile cache's place), as
        the controller sees it. It outlives the node's processes, as a disk does."""
        return Path(self.dir) / "disk" / node / "var-tmp"


def _free_ports(count: int) -> list[int]:
    """``count`` different ports, free on every address (slurmctld listens on all of them),
    none where the Slurm launcher puts a run's rendezvous (a node's slurmd holds its port)."""
    ports: list[int] = []
    while len(ports) < count:
        port = free_port("0.0.0.0")  # noqa: S104
        if port not in ports and port not in RENDEZVOUS_PORTS:
            ports.append(port)
    return ports


def _slurm_conf(box: Box, cpus: int, memory_mb: int) -> str:
    d = box.dir
    host = socket.gethostname()
    lines = [
        "# Written by scripts/slurm-box: a Slurm cluster on one host, each node in a network",
        "# namespace of its own, for development and tests.",
        f"ClusterName=tsupbox{box.ctld_port}",
        f"SlurmctldHost={host}({box.controller_addr})",
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
            f"NodeName={node} NodeHostname={host} NodeAddr={box.addr(node)} Port={box.node_ports[node]} "
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
    missing += [tool for tool in ("sinfo", "ip", "nsenter") if shutil.which(tool) is None]
    if missing:
        raise RuntimeError(f"Slurm box needs {', '.join(missing)} "
                           "(scripts/install-system-deps installs them as root)")
    if os.geteuid() != 0:
        raise RuntimeError("Slurm box needs root: it runs slurmd and makes network namespaces")
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
    # The cluster's users (not only root) may read slurm.conf and reach munged's socket;
    # the key stays root's alone.
    os.chmod(directory, 0o755)  # noqa: S103
    os.chmod(directory / "munge", 0o755)  # noqa: S103
    key = directory / "munge" / "munge.key"
    key.write_bytes(secrets.token_bytes(1024))
    os.chmod(key, 0o600)
    try:
        with file_lock(_NET_LOCK):
            box.subnet = _free_subnet()
            _save(box)  # from here on, `down` can clean up whatever got started
            _make_network(box)
        box.conf.write_text(_slurm_conf(box, cpus, memory_mb))
        _start(box, directory, key, timeout_s)
    except BaseException:
        down(directory)  # nothing half-started is left behind
        raise
    return box


# --- the network --------------------------------------------------------------------


@contextlib.contextmanager
def file_lock(path: Path) -> Iterator[None]:
    """Held by one process of this host at a time (an exclusive ``flock`` of ``path``)."""
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _ip(*args: str, check: bool = True) -> str:
    out = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=10, check=False)
    if check and out.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {out.stderr.strip() or f'exit {out.returncode}'}")
    return out.stdout


def _free_subnet() -> str:
    """A /24 of NETWORK that no address or route of this host touches."""
    taken = []
    for line in (_ip("-o", "-4", "addr", "show") + _ip("-4", "route", "show")).splitlines():
        for word in line.split():
            with contextlib.suppress(ValueError):
                taken.append(ipaddress.ip_network(word, strict=False))
    for subnet in NETWORK.subnets(new_prefix=24):
        if not any(subnet.overlaps(t) for t in taken):
            return str(subnet)
    raise RuntimeError(f"no free /24 left in {NETWORK} for the box's network")


def _make_network(box: Box) -> None:
    prefix = ipaddress.ip_network(box.subnet).prefixlen
    _ip("link", "add", box.bridge, "type", "bridge")
    _ip("addr", "add", f"{box.controller_addr}/{prefix}", "dev", box.bridge)
    _ip("link", "set", box.bridge, "up")
    for node in box.nodes:
        ns, link = box.netns(node), box.link(node)
        _ip("netns", "add", ns)
        _ip("link", "add", link, "type", "veth", "peer", "name", "eth0", "netns", ns)
        _ip("link", "set", link, "master", box.bridge)
        _ip("link", "set", link, "up")
        _ip("-n", ns, "addr", "add", f"{box.addr(node)}/{prefix}", "dev", "eth0")
        _ip("-n", ns, "link", "set", "eth0", "up")
        _ip("-n", ns, "link", "set", "lo", "up")


def _remove_network(box: Box) -> None:
    """Delete the box's namespaces, links and bridge; whatever is already gone is fine."""
    if not box.subnet:
        return
    for node in box.nodes:
        _ip("netns", "del", box.netns(node), check=False)
        _ip("link", "del", box.link(node), check=False)  # gone with its namespace, unless a process holds it
    _ip("link", "del", box.bridge, check=False)


def set_slurmd_timeout(box: Box, seconds: int) -> None:
    """Change the box's ``SlurmdTimeout`` (10 s as made) and tell the daemons
    (``scontrol reconfigure``): a test that must not lean on Slurm noticing a lost node
    sets Slurm's default, 300 s."""
    conf = box.conf.read_text().splitlines()
    box.conf.write_text("\n".join(f"SlurmdTimeout={seconds}" if line.startswith("SlurmdTimeout=") else line
                                  for line in conf) + "\n")
    _run(["scontrol", "reconfigure"], box).check_returncode()


def partition_node(box: Box, node: str) -> None:
    """Take the node's link down: it and its processes live on, cut off from everyone."""
    _ip("link", "set", box.link(node), "down")


def heal_node(box: Box, node: str) -> None:
    _ip("link", "set", box.link(node), "up")


def _tc(*args: str, netns: str | None = None) -> None:
    where = ["ip", "netns", "exec", netns] if netns else []
    out = subprocess.run([*where, "tc", *args], capture_output=True, text=True, timeout=10, check=False)
    if out.returncode != 0:
        raise RuntimeError(f"tc {' '.join(args)}: {out.stderr.strip() or f'exit {out.returncode}'}")


def throttle_node(box: Box, node: str, rate: str = "4mbit") -> None:
    """Slow the node's link to ``rate`` both ways (a token bucket, ``tc ... tbf``, on its
    veth's end on the bridge and on its own eth0): it trains on, every collective through
    it slow, the failure a bad cable or a degraded NIC makes."""
    for dev, ns in ((box.link(node), None), ("eth0", box.netns(node))):
        _tc("qdisc", "replace", "dev", dev, "root", "tbf", "rate", rate, "burst", "32kbit",
            "latency", "400ms", netns=ns)


def unthrottle_node(box: Box, node: str) -> None:
    for dev, ns in ((box.link(node), None), ("eth0", box.netns(node))):
        with contextlib.suppress(RuntimeError):  # none there: nothing to take away
            _tc("qdisc", "del", "dev", dev, "root", netns=ns)


def block_port(box: Box, node: str, port: int) -> None:
    """Drop the node's outgoing TCP to ``port`` (an nftables rule in its namespace): the
    security group that lets Slurm through but not one service. Its own table, gone with
    the namespace."""
    ns = f"--net={NETNS_DIR / box.netns(node)}"
    rules = (f"table inet tsup-box {{\n  chain out {{\n    type filter hook output priority 0;\n"
             f"    tcp dport {port} drop\n  }}\n}}\n")
    out = subprocess.run(["nsenter", ns, "nft", "-f", "-"], input=rules, capture_output=True, text=True,
                         timeout=10, check=False)
    if out.returncode != 0:
        why = out.stderr.strip() or f"exit {out.returncode}"
        raise RuntimeError(f"nft (block port {port} on {node}): {why}")


def network_leftovers(box: Box) -> list[str]:
    """The box's namespaces and links that still exist (none, after ``down``)."""
    names = set(_ip("-o", "link", "show").replace("@", ":").replace(" ", ":").split(":"))
    left = [n for n in (box.bridge, *(box.link(node) for node in box.nodes)) if n in names]
    return left + [box.netns(node) for node in box.nodes if (NETNS_DIR / box.netns(node)).exists()]


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


# A node's own /dev/shm and /var/tmp: mounted in the slurmd's mount namespace before it
# starts, so that its steps' tasks (its descendants) see them and nothing else does. /dev/shm
# is memory (empty after a restart); /var/tmp a directory of the box's, its disk.
_NODE_MOUNTS = ('mount -t tmpfs -o mode=1777,nosuid,nodev "$1" /dev/shm && mkdir -p "$2" && chmod 1777 "$2" '
                '&& mount --bind "$2" /var/tmp && shift 2 && exec "$@"')


def start_node(box: Box, node: str, *, timeout_s: float = 30.0) -> int:
    """Start (or restart) the slurmd posing as ``node``, inside the node's network
    namespace and a mount namespace of its own (a fresh, empty /dev/shm; its own /var/tmp)."""
    box.spool(node).mkdir(parents=True, exist_ok=True)
    heal_node(box, node)  # a node killed as by a power loss comes back with its link
    pid_file = box.slurmd_pid_file(node)
    pid_file.unlink(missing_ok=True)
    argv = ["nsenter", f"--net={NETNS_DIR / box.netns(node)}",
            "unshare", "--mount", "--propagation", "private",
            "sh", "-c", _NODE_MOUNTS, "node-mounts", f"tsup-shm-{box.netns(node)}", str(box.var_tmp(node)),
            str(SBIN / "slurmd"), "-f", str(box.conf), "-N", node]
    subprocess.run(argv, env=box.env, check=True, capture_output=True, timeout=timeout_s)
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
    log = Path(box.dir) / "log" / "slurmctld.log"
    tail = log.read_text(errors="replace").splitlines()[-5:] if log.exists() else []
    raise RuntimeError(f"nodes not idle after {timeout_s:.0f} s; sinfo says: {last}; slurmctld "
                       f"(pid {box.ctld_pid}, {'alive' if _alive(box.ctld_pid) else 'gone'}) logged last: "
                       + " | ".join(tail))


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


def _unix_socket_paths(pid: int) -> dict[str, str]:
    """socket inode -> bound path, in the network namespace of process ``pid`` (each
    namespace has a table of its own: the host's /proc/net/unix lists no node's sockets)."""
    out: dict[str, str] = {}
    try:
        lines = Path(f"/proc/{pid}/net/unix").read_text().splitlines()[1:]
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
    prefix = str(spool) + "/"
    found: set[int] = set()
    tables: dict[int, dict[str, str]] = {}  # network namespace inode -> its socket table
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if (entry / "comm").read_text().strip() != "slurmstepd":
                continue
            netns = os.stat(entry / "ns" / "net").st_ino
            if netns not in tables:
                tables[netns] = _unix_socket_paths(int(entry.name))
            paths = tables[netns]
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


def kill_node(box: Box, node: str, *, power_loss: bool = False) -> list[int]:
    """SIGKILL everything ``node`` runs at once. The sockets of what it ran close, so its
    MQTT last wills fire at once and its peers' connections are reset. With
    ``power_loss`` its link goes down first, so that nothing it ran says goodbye: a node
    without power sends nothing, and is missed only by its silence. ``start_node``
    brings the link back."""
    if power_loss:
        partition_node(box, node)
    return signal_node(box, node, signal.SIGKILL)


def signal_node(box: Box, node: str, sig: signal.Signals) -> list[int]:
    """Send ``sig`` to everything ``node`` runs (SIGSTOP: a node frozen or cut off)."""
    pids = sorted(node_processes(box, node))
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)
    return pids


def _in_box_network(box: Box) -> set[int]:
    """Every process in one of the box's network namespaces, whoever started it: a
    slurmstepd still starting when the box goes down is no child of its slurmd yet, and
    would hold its namespace (and its step's tasks) after the box is gone."""
    inodes = set()
    for node in box.nodes:
        with contextlib.suppress(OSError):
            inodes.add(f"net:[{os.stat(NETNS_DIR / box.netns(node)).st_ino}]")
    found = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                if os.readlink(entry / "ns" / "net") in inodes:
                    found.add(int(entry.name))
    return found


def _sruns_of(box: Box) -> set[int]:
    """srun processes of this host that talk to the box (their SLURM_CONF is its config).
    Once the box's network is deleted their connections to the nodes vanish without a
    reset, and an srun still waiting on them would wait for ever."""
    found = set()
    conf = f"SLURM_CONF={box.conf}".encode()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if (entry / "comm").read_text().strip() != "srun":
                continue
            if conf in (entry / "environ").read_bytes().split(b"\0"):
                found.add(int(entry.name))
        except OSError:
            continue
    return found


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
    """Stop what ``up`` started in ``directory``, by pid, and any srun still talking to it,
    and delete its network; returns the pids killed. A box is thrown away: SIGKILL for
    all (a slurmd waits on its steps, a slurmstepd ignores SIGTERM, slurmctld waits on a
    node that was killed, an srun on its tasks: with SIGTERM each took 3 s a box)."""
    box = load(directory)
    if box is None:
        return []
    pids: set[int] = set()
    for node in box.nodes:
        pids |= node_processes(box, node)
    pids |= {p for p in (box.ctld_pid, box.munged_pid) if p}
    pids = {p for p in pids | _sruns_of(box) | _in_box_network(box) if _alive(p)}
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and any(_alive(p) for p in pids):
        time.sleep(0.05)  # a namespace goes only once its last process has
    _remove_network(box)
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
    k.add_argument("--power-loss", action="store_true",
                   help="take its link down first: nothing it ran says goodbye (no last will)")
    r = sub.add_parser("start-node", help="start a node's slurmd again")
    r.add_argument("node")
    c = sub.add_parser("partition-node", help="take a node's link down: it runs on, cut off")
    c.add_argument("node")
    h = sub.add_parser("heal-node", help="bring a partitioned node's link back")
    h.add_argument("node")
    t = sub.add_parser("throttle-node", help="slow a node's link both ways (tc tbf)")
    t.add_argument("node")
    t.add_argument("--rate", default="4mbit", help="tc's rate (default 4mbit)")
    ut = sub.add_parser("unthrottle-node", help="take a node's throttle away")
    ut.add_argument("node")
    e = sub.add_parser("env", help="print the export line for SLURM_CONF")
    for p in (u, d, k, r, c, h, t, ut, e):
        p.add_argument("--dir", type=Path, default=DEFAULT_DIR)
    args = ap.parse_args(argv)
    directory: Path = getattr(args, "dir", DEFAULT_DIR)
    try:
        if args.cmd == "up":
            if not 1 <= args.nodes <= 64:
                raise RuntimeError("--nodes: expected 1 to 64")
            box = up(directory, args.nodes, cpus=args.cpus, partition=args.partition)
            hosts = ", ".join(f"{n} {box.addr(n)}" for n in box.nodes)
            print(f"slurm-box: {len(box.nodes)} nodes up in {box.dir}; network {box.subnet}, controller "
                  f"{box.controller_addr}, {hosts}", file=sys.stderr)
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
            killed = kill_node(box_or_none, args.node, power_loss=args.power_loss)
            cut = f"{args.node}'s link down, and " if args.power_loss else ""
            print(f"slurm-box: {cut}SIGKILL to {len(killed)} process(es) of {args.node}", file=sys.stderr)
        elif args.cmd == "start-node":
            start_node(box_or_none, args.node)
        elif args.cmd in ("partition-node", "heal-node", "throttle-node", "unthrottle-node"):
            if args.node not in box_or_none.nodes:
                known = ", ".join(box_or_none.nodes)
                raise RuntimeError(f"no node {args.node!r} in the box (it has {known})")
            if args.cmd == "throttle-node":
                throttle_node(box_or_none, args.node, args.rate)
            else:
                {"partition-node": partition_node, "heal-node": heal_node,
                 "unthrottle-node": unthrottle_node}[args.cmd](box_or_none, args.node)
        return 0
    except (RuntimeError, OSError, subprocess.SubprocessError) as e:
        print(f"slurm-box: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())

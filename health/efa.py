"""EFA, the Elastic Fabric Adapter of p4d, p5, trn1 and trn2 nodes: its devices, their
ports, and their error counters.

- **Devices**: ``fi_info -p efa -t FI_EP_RDM`` prints a block per endpoint
  (``provider: efa``, ``fabric: efa``, ``domain: rdmap16s27-rdm``, ``type: FI_EP_RDM``);
  a device is a domain without its ``-rdm`` suffix, counted once (libfabric 2 lists each
  again under ``fabric: efa-direct``). ``fi_getinfo: -61`` (no data) means libfabric
  found no EFA device. The count is held against the instance type's (``EFA_DEVICES``,
  from AWS's documentation: one EFA per network card); fewer is unhealthy.
- **Ports**: ``/sys/class/infiniband/<device>/ports/<n>/state`` (``4: ACTIVE``); a port
  in any other state is unhealthy.
- **Counters**: ``/sys/class/infiniband/<device>/ports/<n>/hw_counters/<name>``. A counter
  is a total since the driver loaded, so what matters is its growth between two probes
  of the node: the probe keeps its reading in ``state_file`` (this user's own file, or
  none is read) and compares with the last one. Growth of the counters that mean lost
  traffic (``ERROR_COUNTERS``) is reported as degraded, with the figures: it is evidence
  to watch (a congested fabric retransmits too), never a drain by itself.

The parsers are pure; ``probe`` reads the tool and the files. A node without ``fi_info``
has no EFA (healthy, said so).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import stat
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from health.model import Action, Finding, Status, excerpt, no_devices, probe_failed
from health.runner import run_tool

PROBE = "efa"
SYS_ROOT = Path("/sys/class/infiniband")
# EFA devices per instance type: the EC2 User Guide's network cards (one EFA per card:
# p4d/p4de 4, trn1 8, trn1n 16), the Neuron documentation for trn2 (16 chips, an EFA each),
# and AWS's samples for p5 (32).
EFA_DEVICES = {"p4d.24xlarge": 4, "p4de.24xlarge": 4, "p5.48xlarge": 32, "trn1.32xlarge": 8,
               "trn1n.32xlarge": 16, "trn2.48xlarge": 16}
# Counters whose growth means traffic lost or a peer lost (the EFA driver's names).
ERROR_COUNTERS = ("rx_drops", "retrans_timeout_events", "unresponsive_remote_events",
                  "impaired_remote_conn_events")
_NO_DATA = re.compile(r"fi_getinfo:\s*-61\b")
READING_MAX = 1 << 20  # bytes of the last reading read back: far more than 32 devices' counters


@dataclass(frozen=True, slots=True)
class Port:
    device: str
    port: str
    state: str  # "ACTIVE", "DOWN", ... (the word after "4: ")
    counters: dict[str, int]

    @property
    def key(self) -> str:
        return f"{self.device}/{self.port}"


def parse_fi_info(text: str) -> set[str] | str:
    """The EFA devices ``fi_info -p efa`` lists (none, when it said plainly that there is
    no EFA device: ``fi_getinfo: -61``), or why its output lists none."""
    if _NO_DATA.search(text):
        return set()
    devices: set[str] = set()
    block: dict[str, str] = {}
    for line in [*text.splitlines(), "provider:"]:
        key, sep, value = line.strip().partition(":")
        if not sep:
            continue
        if key == "provider":
            if block.get("provider") == "efa" and "domain" in block:
                devices.add(re.sub(r"-(rdm|dgrm)$", "", block["domain"]))
            block = {}
        block[key] = value.strip()
    if not devices:
        return f"no EFA endpoint in fi_info's output: {excerpt(text) or '(empty)'}"
    return devices


def parse_port_state(text: str) -> str:
    """``4: ACTIVE`` -> ``ACTIVE`` (the text itself when it has no number)."""
    return text.strip().partition(": ")[2].strip() or text.strip()


def read_ports(root: Path = SYS_ROOT) -> list[Port]:
    """Every port of every device under ``root``, with its state and counters (a counter
    that cannot be read or is not a number is left out)."""
    ports = []
    for port_dir in sorted(root.glob("*/ports/*")):
        try:
            state = parse_port_state((port_dir / "state").read_text())
        except OSError:
            state = "unreadable"
        counters = {}
        for f in sorted((port_dir / "hw_counters").glob("*")):
            with contextlib.suppress(OSError, ValueError):
                counters[f.name] = int(f.read_text().strip())
        device = port_dir.parent.parent.name
        ports.append(Port(device=device, port=port_dir.name, state=state, counters=counters))
    return ports


def check_devices(found: set[str] | str, instance_type: str | None) -> Finding:
    """The devices fi_info listed against the instance type's count."""
    if isinstance(found, str):
        return probe_failed(PROBE, found)
    expected = EFA_DEVICES.get(instance_type or "")
    listed = ", ".join(sorted(found)) or "none: fi_getinfo -61"
    if expected is None:
        what = instance_type or "this node"
        return Finding(probe=PROBE, status=Status.HEALTHY,
                       evidence=f"{len(found)} EFA devices ({listed}); no count known for {what}")
    said = f"{len(found)} EFA devices of the {expected} a {instance_type} has"
    if len(found) < expected:
        return Finding(probe=PROBE, status=Status.UNHEALTHY, action=Action.REPLACE,
                       evidence=f"{said} ({listed})")
    return Finding(probe=PROBE, status=Status.HEALTHY, evidence=said)


def check_ports(ports: list[Port]) -> Finding | None:
    down = [f"{p.key} {p.state}" for p in ports if p.state != "ACTIVE"]
    if down:
        return Finding(probe=PROBE, status=Status.UNHEALTHY, action=Action.REBOOT,
                       evidence=f"EFA port not active: {', '.join(down)}")
    return None


def check_growth(ports: list[Port], before: Mapping[str, Mapping[str, int]]) -> Finding | None:
    """The error counters' growth since ``before`` (port key -> counters). A counter
    that went down was reset (the driver reloaded): its growth is its new value."""
    grew = []
    for p in ports:
        last = before.get(p.key)
        if last is None:
            continue
        for name in ERROR_COUNTERS:
            if name in p.counters and name in last:
                now, then = p.counters[name], last[name]
                delta = now - then if now >= then else now
                if delta > 0:
                    grew.append(f"{p.key} {name} +{delta}")
    if grew:
        return Finding(probe=PROBE, status=Status.DEGRADED,
                       evidence=f"EFA error counters grew since the last probe: {', '.join(grew)}")
    return None


def probe(instance_type: str | None, *, root: Path = SYS_ROOT,
          state_file: Path | None = None) -> list[Finding]:
    """The EFA findings of this node (none besides "no EFA" where fi_info is absent)."""
    listed = run_tool(["fi_info", "-p", "efa", "-t", "FI_EP_RDM"])
    if listed.missing:
        return [no_devices("fi_info", "EFA")]
    if not listed.ran:
        return [probe_failed(PROBE, listed.why)]
    found = parse_fi_info(listed.stdout + listed.stderr)
    findings = [check_devices(found, instance_type)]
    if not found or isinstance(found, str):
        return findings
    ports = read_ports(root)
    findings += [f for f in (check_ports(ports), check_growth(ports, _last(state_file))) if f is not None]
    if state_file is not None:
        _keep(state_file, ports)
    return findings


def state_path() -> Path:
    """Where this user's last reading is kept on the node."""
    return Path("/var/tmp") / f"training-supervisor-efa-{os.geteuid()}.json"  # noqa: S108 (checked: _last)


def _last(path: Path | None) -> dict[str, dict[str, int]]:
    """The last reading, when ``path`` is this user's own regular file (/var/tmp is
    anyone's: a file another user put there is not read, a FIFO does not block the open,
    and no more than READING_MAX bytes are read)."""
    if path is None:
        return {}
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return {}
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if st.st_uid != os.geteuid() or not stat.S_ISREG(st.st_mode):
            return {}
        try:
            doc = json.loads(f.read(READING_MAX))
        except (OSError, ValueError):
            return {}
    if not isinstance(doc, dict):
        return {}
    return {key: {name: v for name, v in counters.items() if isinstance(v, int)}
            for key, counters in doc.items() if isinstance(counters, dict)}


def _keep(path: Path, ports: list[Port]) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    with contextlib.suppress(OSError):
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump({p.key: p.counters for p in ports}, f)
        os.replace(tmp, path)

"""What every probe returns, and how a node's findings fold into one verdict.

A probe is a pure parser over a tool's output that returns ``Finding``s; it never
raises and never calls garbage healthy: empty, truncated or unreadable output is an
UNKNOWN finding whose evidence starts with "unknown: probe failed:" and says why.

Verdict rule (``verdict``): the worst status wins, in the order
unhealthy > unknown > degraded > healthy; the action is the most drastic one among
the unhealthy findings (replace > reboot > restart > none). Exit codes of
``python -m health``: 0 healthy, 1 degraded, 2 unhealthy or unknown (a node nobody
can vouch for).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from enum import StrEnum


class Status(StrEnum):
    HEALTHY = "healthy"
    DEGRADED = "degraded"
    UNHEALTHY = "unhealthy"
    UNKNOWN = "unknown"  # the probe itself failed: never read as healthy


class Action(StrEnum):
    """What the node needs, least drastic first."""

    NONE = "none"  # no node action (the fault is elsewhere, or only worth watching)
    RESTART = "restart"  # restart the application; the node is fine
    REBOOT = "reboot"  # the node needs a reboot (driver reset, soft hardware state)
    REPLACE = "replace"  # the hardware is bad: take the node out and replace it


_STATUS_ORDER = (Status.HEALTHY, Status.DEGRADED, Status.UNKNOWN, Status.UNHEALTHY)
_ACTION_ORDER = (Action.NONE, Action.RESTART, Action.REBOOT, Action.REPLACE)
EXIT_CODES = {Status.HEALTHY: 0, Status.DEGRADED: 1, Status.UNHEALTHY: 2, Status.UNKNOWN: 2}


RUN_FILES = "run-files"  # the probe name of the run's own files' findings (host.required)
BROKER = "broker"  # the probe name of the broker's finding, as the node reaches it (broker.probe)
RUN_USER = "run-user"  # the probe name of the run's account's finding (host.run_user)


@dataclass(frozen=True, slots=True, kw_only=True)
class Finding:
    probe: str  # e.g. "neuron-monitor", "nvidia-smi", "disk"
    status: Status
    evidence: str  # one line a person can act on, quoting the tool where it helps
    action: Action = Action.NONE

    def to_json(self) -> dict[str, str]:
        return {k: str(v) for k, v in asdict(self).items()}


def probe_failed(probe: str, why: str) -> Finding:
    return Finding(probe=probe, status=Status.UNKNOWN, evidence=f"unknown: probe failed: {why}")


def no_devices(probe: str, what: str) -> Finding:
    """The tool is absent: this node has no such devices (not a failure)."""
    return Finding(probe=probe, status=Status.HEALTHY,
                   evidence=f"no {what} devices found ({probe} not installed)")


@dataclass(frozen=True, slots=True, kw_only=True)
class Verdict:
    status: Status
    action: Action
    findings: list[Finding] = field(default_factory=list)

    @property
    def exit_code(self) -> int:
        return EXIT_CODES[self.status]

    def reason(self) -> str:
        """The findings that made the verdict, in one line (a drain Reason)."""
        worst = [f for f in self.findings if f.status is self.status] or self.findings
        return "; ".join(f"{f.probe}: {f.evidence}" for f in worst)

    def to_json(self) -> dict[str, object]:
        return {"status": self.status.value, "action": self.action.value,
                "findings": [f.to_json() for f in self.findings]}


def worst(statuses: list[Status]) -> Status:
    """The worst of ``statuses`` in the verdict rule's order (healthy for none)."""
    return max(statuses, key=_STATUS_ORDER.index, default=Status.HEALTHY)


def verdict(findings: list[Finding]) -> Verdict:
    status = worst([f.status for f in findings])
    unhealthy = [f.action for f in findings if f.status is Status.UNHEALTHY]
    action = max(unhealthy, key=_ACTION_ORDER.index, default=Action.NONE)
    return Verdict(status=status, action=action, findings=findings)


def excerpt(text: str, limit: int = 160) -> str:
    """``text`` on one line, cut to ``limit`` characters: what a finding quotes of a tool's output."""
    text = " ".join(text.split())
    return text if len(text) <= limit else text[:limit - 3] + "..."

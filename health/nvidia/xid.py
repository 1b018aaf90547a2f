"""The kernel log's Xid lines, judged by one table (``XID_ACTIONS``): a pure parser."""

from __future__ import annotations

import re
from dataclasses import dataclass

from health.model import Action, Finding, Status, excerpt, probe_failed

_U, _D, _H = Status.UNHEALTHY, Status.DEGRADED, Status.HEALTHY


@dataclass(frozen=True, slots=True)
class XidRule:
    status: Status
    action: Action
    meaning: str


def _x(status: Status, action: Action, meaning: str) -> XidRule:
    return XidRule(status, action, meaning)


_RESET_BUCKET = "needs a GPU reset (the catalog's RESET bucket)"

# The one Xid table: code -> what the node needs. See the module docstring for the grouping.
XID_ACTIONS: dict[int, XidRule] = {
    13: _x(_D, Action.RESTART, "graphics engine exception: an application fault"),
    31: _x(_D, Action.RESTART, "GPU memory page fault: an application's illegal access"),
    43: _x(_D, Action.RESTART, "GPU stopped processing: the faulting application's channel was reset"),
    45: _x(_D, Action.RESTART, "preemptive cleanup after an earlier error: the application was stopped"),
    94: _x(_D, Action.RESTART, "contained ECC error: only the application that touched the memory is hit"),
    126: _x(_D, Action.RESTART, "an application-level fault (the catalog's RESTART_APP bucket)"),
    63: _x(_D, Action.REBOOT, "ECC page retirement or row remap recorded: takes effect at the next reset"),
    92: _x(_D, Action.NONE, "high single-bit ECC error rate (corrected): watch"),
    48: _x(_U, Action.REBOOT, "double-bit (uncorrectable) ECC error"),
    64: _x(_U, Action.REBOOT, "row remapping failure (again after a reboot: replace)"),
    71: _x(_U, Action.REBOOT, "NVLink fatal error"),
    74: _x(_U, Action.REBOOT, "NVLink error"),
    79: _x(_U, Action.REBOOT, "GPU has fallen off the bus (again after a reboot: replace)"),
    95: _x(_U, Action.REBOOT, "uncontained ECC error"),
    109: _x(_U, Action.REBOOT, "context switch timeout"),
    110: _x(_U, Action.REBOOT, "security fault"),
    119: _x(_U, Action.REBOOT, "GSP RPC timeout"),
    120: _x(_U, Action.REBOOT, "GSP error"),
    136: _x(_U, Action.REBOOT, _RESET_BUCKET),
    140: _x(_U, Action.REBOOT, _RESET_BUCKET),
    143: _x(_U, Action.REBOOT, _RESET_BUCKET),
    155: _x(_U, Action.REBOOT, _RESET_BUCKET),
    156: _x(_U, Action.REBOOT, _RESET_BUCKET),
    158: _x(_U, Action.REBOOT, _RESET_BUCKET),
    151: _x(_U, Action.REBOOT, "the GPU needs a bare-metal (VM) restart"),
    168: _x(_U, Action.REBOOT, "GPU boot re-attempt: restart the node"),
    54: _x(_U, Action.REPLACE, "auxiliary power not connected / mechanical fault (ISOLATE)"),
    154: _x(_U, Action.REBOOT, "GPU recovery action changed"),  # refined by its text, see _xid_154
}
_UNKNOWN_XID = _x(_D, Action.NONE, "not in the table: look it up in NVIDIA's Xid catalog")

XID = re.compile(r"\bXid\s*\(([^)]*)\)\s*:\s*(\d+)\b\s*,?\s*(.*)")
XID_MENTION = re.compile(r"NVRM:\s*Xid\b")
_XID_NOISE = re.compile(r"^(?:pid=[^,]*,\s*)?(?:name=[^,]*,\s*)?")


def classify_xids(text: str) -> list[Finding]:
    """Every ``NVRM: Xid (PCI:...): N, ...`` line through ``XID_ACTIONS``: one finding per code
    and PCI address (the first message quoted, the count when more)."""
    probe = "xid"
    if "\x00" in text:
        return [probe_failed(probe, "the log holds binary data (NUL bytes), not text")]
    lines = text.splitlines()
    if not text.strip():
        return [probe_failed(probe, "the kernel log is empty (dmesg not readable?)")]
    seen: dict[tuple[int, str], tuple[XidRule, str, int]] = {}
    cut: list[str] = []
    for line in lines:
        m = XID.search(line)
        if not m:
            if XID_MENTION.search(line):
                cut.append(line.strip())
            continue
        where, code, message = m.group(1).strip(), int(m.group(2)), _xid_message(m.group(3))
        rule = _xid_154(message) if code == 154 else XID_ACTIONS.get(code, _UNKNOWN_XID)
        key = (code, where)
        _, first, count = seen.get(key, (rule, message, 0))
        seen[key] = (rule, first, count + 1)
    findings = []
    for (code, where), (rule, message, count) in seen.items():
        times = f" (x{count})" if count > 1 else ""
        quote = f": {message}" if message else ""
        findings.append(Finding(probe=probe, status=rule.status, action=rule.action,
                                evidence=f"Xid {code} on {where}{times}: {rule.meaning}{quote}"))
    if cut:
        findings.append(probe_failed(probe, f"an Xid line without a code (truncated?): {excerpt(cut[0])!r}"))
    if not findings:
        return [Finding(probe=probe, status=_H, evidence=f"no NVIDIA Xid in {len(lines)} kernel log lines")]
    return findings


_XID_PLAIN = re.compile(r"\bXid[ :]+(\d+)\b\s*,?\s*(.*)")  # "Xid 79", "Xid: 79" (a message quoting one)


# The two forms, for a reader that matches them with an engine of its own (the daemon's,
# supervisor/gathering/output_progress.py): the kernel's (groups: the device, the code, the message)
# and the plain one (the code, the message).
XID_PATTERN, XID_PLAIN_PATTERN = XID.pattern, _XID_PLAIN.pattern


def xid_rule(line: str) -> tuple[int, XidRule] | None:
    """The Xid a line reports (the kernel's ``Xid (PCI:...): N, ...``, or a plain ``Xid N``)
    and its rule in ``XID_ACTIONS``; None when the line reports none."""
    m = XID.search(line)
    if m:
        return int(m.group(2)), xid_of(int(m.group(2)), m.group(3))
    plain = _XID_PLAIN.search(line)
    if not plain:
        return None
    return int(plain.group(1)), xid_of(int(plain.group(1)), plain.group(2))


def xid_of(code: int, raw_message: str) -> XidRule:
    """The rule of Xid ``code`` reported with ``raw_message`` (what follows the code)."""
    message = _xid_message(raw_message)
    return _xid_154(message) if code == 154 else XID_ACTIONS.get(code, _UNKNOWN_XID)


def _xid_message(raw: str) -> str:
    text = _XID_NOISE.sub("", raw.strip(), count=1)
    text = text.split('\\"', 1)[0]  # the line quoted inside JSON (HyperPod's health agent)
    return excerpt(text)


def _xid_154(message: str) -> XidRule:
    """Xid 154 reports the driver's recovery action; the action is in its text."""
    m = re.search(r"to 0x[0-9a-fA-F]+ \(([^)]*)\)", message)
    new = m.group(1) if m else message
    if re.search(r"\bNone\b", new) and m:
        return _x(_D, Action.NONE, "GPU recovery action cleared (None)")
    if re.search(r"reboot", new, re.IGNORECASE):
        return _x(_U, Action.REBOOT, "GPU recovery action: node reboot required")
    if re.search(r"reset|drain", new, re.IGNORECASE):
        return _x(_U, Action.REBOOT, "GPU recovery action: GPU reset / drain required")
    return _x(_D, Action.NONE, "GPU recovery action changed (action not recognised)")


def mentions_xid(line: str) -> bool:
    """Whether a kernel log line is an Xid report (or says "NVRM: Xid" in a form not parsed)."""
    return bool(XID_MENTION.search(line) or XID.search(line))

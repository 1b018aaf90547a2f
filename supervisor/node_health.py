"""When a node's probe results take it out of service: the debounce rule, pure.

A probe result is one node's verdict from ``python -m health`` (healthy, degraded,
unhealthy or unknown, with an action). The rule, newest result first:

- healthy or degraded: the node may train (degraded is reported, never acted on);
- unhealthy or unknown once: not yet. One flaky result never drains a node; the
  supervisor probes the node again at once (``confirm``) before deciding;
- unhealthy or unknown in ``CONFIRMATIONS`` results in a row: drain, with the newest
  bad result's reason (the tool's own words), e.g.
  ``training-supervisor: probe: neuron-monitor: mem_ecc_uncorrected=1 ... (run-3, preflight)``.

Return to service: a node this supervisor drained is probed by the periodic sweep
(``training-supervisor serve --sweep-every``); when the operator has enabled it
(``--return-after N``), N healthy or degraded results in a row return it to service
(``may_return``). Otherwise, and always for a node an operator drained by hand, it
returns only by an operator's hand (``scontrol update NodeName=... State=RESUME`` on
Slurm).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass

from health import wire
from health.model import BROKER, RUN_FILES, RUN_USER, Action, Finding, Status, Verdict, verdict, worst
from supervisor.domain import ProbeRecord

CONFIRMATIONS = 2  # bad results in a row before a drain
MANUAL = "manual"  # the kind of an operator's probe (a node command): it reports, it drains nothing
_BAD = ("unhealthy", "unknown")


@dataclass(frozen=True, slots=True)
class Judgement:
    drain: bool
    confirm: bool  # probe again now: one bad result, not yet confirmed
    reason: str  # why, for the drain Reason and the event log


def judge(statuses_newest_first: Sequence[str], reasons_newest_first: Sequence[str]) -> Judgement:
    if not statuses_newest_first or statuses_newest_first[0] not in _BAD:
        return Judgement(drain=False, confirm=False, reason="")
    run = 0
    for s in statuses_newest_first:
        if s not in _BAD:
            break
        run += 1
    reason = reasons_newest_first[0] if reasons_newest_first else ""
    if run >= CONFIRMATIONS:
        return Judgement(drain=True, confirm=False, reason=reason)
    return Judgement(drain=False, confirm=True, reason=reason)


def _unhealthy(r: ProbeRecord) -> set[str | None]:
    return {f.get("probe") for f in r.findings if f.get("status") == "unhealthy"}


# Faults a probe finds that are not the node's own when every node probed has them: the
# run's own files missing (its script deleted, a wrong path: the run's fault), its user
# unknown (a user no node has), the broker unreachable (down, or the controller's
# firewall: the cluster's). On some nodes only, they are those nodes' (a mount missing,
# a replacement whose lifecycle script did not create the account, a security group).
SHARED_CAUSES = (RUN_FILES, RUN_USER, BROKER)


def shared_faults(records: Sequence[ProbeRecord]) -> frozenset[str]:
    """The ``SHARED_CAUSES`` every one of ``records`` is unhealthy for (none: empty)."""
    if not records:
        return frozenset()
    return frozenset(c for c in SHARED_CAUSES if all(c in _unhealthy(r) for r in records))


def only_for(r: ProbeRecord, causes: frozenset[str]) -> bool:
    """``r`` is unhealthy for ``causes`` and nothing else."""
    return r.status == "unhealthy" and bool(causes) and _unhealthy(r) <= causes


def may_return(statuses_newest_first: Sequence[str], clean_in_a_row: int) -> bool:
    """A drained node may return to service: its newest ``clean_in_a_row`` results are all
    healthy or degraded (0: never by itself)."""
    newest = list(statuses_newest_first[:clean_in_a_row])
    return clean_in_a_row > 0 and len(newest) == clean_in_a_row and all(s not in _BAD for s in newest)


def probe_argv(extra: Sequence[str] = (), require: Sequence[str] = (), *,
               interpreter: str = sys.executable) -> tuple[str, ...]:
    """The probe every node runs: ``python -m health``, its verdict in tagged lines naming
    the node (health/wire.py), so that many nodes' answers can share one srun stream;
    ``require``: the files a run needs there (``--require``).

    It runs the supervisor's own interpreter, which must be at the same path on every
    node (scripts/install-node). A guard in ``sh`` answers for a node without it: an
    unhealthy verdict that names the node and the missing path, where srun alone would
    print an execve error that names neither."""
    exe = interpreter
    missing = Verdict(status=Status.UNHEALTHY, action=Action.NONE, findings=[Finding(
        probe="deploy", status=Status.UNHEALTHY,
        evidence=f"{exe}, the supervisor's interpreter, is missing on this node: install the supervisor "
                 "there at the same path (scripts/install-node)")])
    doc = json.dumps({"node": _NODE, **missing.to_json(), "reason": missing.reason(), "summary": ""})
    answer = "\n".join(wire.lines(_NODE, doc))
    # -I: isolated from the environment and the user's site-packages (a probe in a run's job
    # runs as the job's owner: supervisor/slurm/nodes.py).
    needs = (a for path in require for a in ("--require", path))
    probe = (exe, "-I", "-m", "health", "--wire", *extra, *needs)
    return ("/bin/sh", "-c", _GUARD, "tsup-probe-guard", answer, *probe)


_NODE = "@NODE@"  # the guard's answer names the node it runs on
# $1: the answer for a node without the interpreter; then the probe's own argv.
_GUARD = (
    'answer=$1; shift; [ -x "$1" ] && exec "$@"; '
    'node=${SLURMD_NODENAME:-${TSUP_NODE:-$(hostname -s)}}; '
    'printf "%s\\n" "$answer" | sed "s/@NODE@/$node/g"; exit 2'
)


def record(node: str, output: str | None, kind: str, run_number: int | None, at: float, *,
           link_gbps: float | None = None) -> ProbeRecord:
    """A node's answer as a record; no answer, or one that is not a verdict, is "unknown".
    ``link_gbps``: its figure in the round's link test, kept either way."""
    try:
        if output is None:
            raise ValueError("no report from the node (the probe did not run or timed out)")
        line = _verdict_line(node, output)
        if line is None:
            raise ValueError("no JSON verdict in the output")
        doc = json.loads(line)
        status, action = str(doc["status"]), str(doc.get("action", "none"))
        if status not in ("healthy", "degraded", "unhealthy", "unknown"):
            raise ValueError(f"status {status!r}")
        findings = [f for f in doc.get("findings", []) if isinstance(f, dict)]
        reason = str(doc.get("reason", ""))
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        why = str(e) or "no JSON verdict in the output"
        return ProbeRecord(node=node, at=at, kind=kind, status="unknown", action="none",
                           reason=f"unknown: probe failed: {why}", findings=[], run_number=run_number,
                           link_gbps=link_gbps)
    return ProbeRecord(node=node, at=at, kind=kind, status=status, action=action, reason=reason,
                       findings=findings, run_number=run_number, link_gbps=link_gbps)


def with_findings(answers: dict[str, str], findings: dict[str, Finding | None]) -> dict[str, str]:
    """Each node's answer (its probe's wire lines) with ``findings[node]`` added to its
    verdict, as wire lines again. A finding worse than the verdict makes it (health/
    model.py: the worst status wins, the Reason is the worst findings'); one no worse only
    joins its findings. A node that gave no verdict (a node cut off answers nothing) gets
    one of the finding and the probe's failure, so that the finding, not only the silence,
    is its Reason when it is the worse."""
    out = dict(answers)
    for node, finding in findings.items():
        if finding is None:
            continue
        sent = _verdict_line(node, answers.get(node) or "")
        if sent is None:
            silent = Finding(probe="probe", status=Status.UNKNOWN,
                             evidence="unknown: probe failed: no report from the node")
            v = verdict([silent, finding])
            doc = {"node": node, **v.to_json(), "reason": v.reason(), "summary": ""}
            out[node] = "\n".join(wire.lines(node, json.dumps(doc)))
            continue
        try:
            doc = json.loads(sent)
            status = Status(doc["status"])
            kept = [Finding(probe=str(f["probe"]), status=Status(f["status"]), evidence=str(f["evidence"]),
                            action=Action(f.get("action", "none"))) for f in doc["findings"]]
        except (ValueError, KeyError, TypeError):
            continue
        if worst([status, finding.status]) is status:
            doc["findings"] = [*doc["findings"], finding.to_json()]
        else:
            v = verdict([*kept, finding])
            doc |= {**v.to_json(), "reason": v.reason()}
        out[node] = "\n".join(wire.lines(node, json.dumps(doc)))
    return out


def _verdict_line(node: str, output: str) -> str | None:
    """The node's verdict in its probe's output: its wire lines put together, else a
    one-line JSON verdict (``python -m health --json --compact``)."""
    sent = wire.answers(output).get(node)
    return sent or next((ln for ln in reversed(output.splitlines()) if ln.startswith("{")), None)

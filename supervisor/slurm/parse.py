"""Pure parsers for what Slurm's commands print: jobs, steps, nodes, partitions.

No I/O here: supervisor/slurm/commands.py runs the commands and hands the text over.
Every parser takes the whole output and returns plain records, or raises
``SlurmParseError`` naming what it could not read; the caller turns that into "state
unknown", never into "job failed". Recorded outputs live in tests/fixtures/slurm/.

Formats, and which Slurm prints which:

- ``squeue --json``: 22.05 (openapi v0.0.38) prints flat values (``"job_state":
  "RUNNING"``); 23.02 and later print ``job_state`` as a list of flags and numbers as
  ``{"set": true, "number": N}``. Both are read.
- ``squeue -h -o "%i|%T|%N|%r|%j"``: every version; the fallback when ``--json`` is
  missing (Slurm before 21.08, or no openapi plugin). squeue lists every user's jobs and
  a name is free text (it may hold ``|``), so the name comes last and takes the rest.
- ``squeue --steps -h -o "%i|%N|%j"``: steps (22.05's ``--json`` has no steps).
- ``scontrol -o show node`` / ``show partition``: one record per line of ``Key=Value``
  pairs (22.05 has no ``scontrol --json``). ``Reason=`` holds spaces and runs to the next
  ``Key=`` or the end of the line.
  A state ending in ``*`` (``IDLE*``) means the node does not respond.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from supervisor.errors import SupervisorError


class SlurmParseError(SupervisorError):
    """Slurm printed something this module cannot read."""


class JobPhase(StrEnum):
    """What a Slurm job state means to the supervisor."""

    WAITING = "WAITING"  # queued (PENDING, REQUEUED, CONFIGURING ...): holds no nodes yet
    HOLDING = "HOLDING"  # running: its nodes are ours
    ENDED = "ENDED"  # over for good (COMPLETED, FAILED, TIMEOUT, NODE_FAIL, PREEMPTED ...)


# One table from Slurm's job states to the supervisor's three phases. A requeued job
# (after NODE_FAIL or preemption, with JobRequeue=1) goes back to PENDING: WAITING.
JOB_STATES: dict[str, JobPhase] = {
    "PENDING": JobPhase.WAITING,
    "REQUEUED": JobPhase.WAITING,
    "REQUEUE_FED": JobPhase.WAITING,
    "REQUEUE_HOLD": JobPhase.WAITING,
    "RESV_DEL_HOLD": JobPhase.WAITING,
    "SPECIAL_EXIT": JobPhase.WAITING,
    "CONFIGURING": JobPhase.WAITING,
    "RESIZING": JobPhase.HOLDING,
    "RUNNING": JobPhase.HOLDING,
    "COMPLETING": JobPhase.ENDED,
    "SUSPENDED": JobPhase.HOLDING,
    "STOPPED": JobPhase.HOLDING,
    "SIGNALING": JobPhase.HOLDING,
    "STAGE_OUT": JobPhase.ENDED,
    "COMPLETED": JobPhase.ENDED,
    "CANCELLED": JobPhase.ENDED,
    "FAILED": JobPhase.ENDED,
    "TIMEOUT": JobPhase.ENDED,
    "NODE_FAIL": JobPhase.ENDED,
    "PREEMPTED": JobPhase.ENDED,
    "BOOT_FAIL": JobPhase.ENDED,
    "DEADLINE": JobPhase.ENDED,
    "OUT_OF_MEMORY": JobPhase.ENDED,
    "REVOKED": JobPhase.ENDED,
}


@dataclass(frozen=True, slots=True, kw_only=True)
class JobInfo:
    job_id: str
    name: str
    state: str  # Slurm's base state, e.g. RUNNING
    phase: JobPhase
    nodes: tuple[str, ...]  # expanded; empty while queued
    reason: str  # Slurm's state reason (Resources, PartitionConfig, None ...)


@dataclass(frozen=True, slots=True, kw_only=True)
class StepInfo:
    job_id: str
    step_id: str  # "0", "1", "batch", "extern"
    name: str
    nodes: tuple[str, ...]


@dataclass(frozen=True, slots=True, kw_only=True)
class NodeInfo:
    name: str
    state: str  # e.g. "IDLE", "ALLOCATED+DRAIN", "DOWN+DRAIN+NOT_RESPONDING"
    addr: str
    reason: str

    @property
    def flags(self) -> frozenset[str]:
        return frozenset(self.state.split("+"))

    @property
    def usable(self) -> bool:
        """Up, responding and not draining: a step may start on it."""
        bad = {"DOWN", "DRAIN", "DRAINED", "DRAINING", "FAIL", "FAILING", "NOT_RESPONDING",
               "POWERED_DOWN", "POWERING_DOWN", "MAINTENANCE", "REBOOT_REQUESTED", "REBOOT_ISSUED"}
        return not (self.flags & bad)


@dataclass(frozen=True, slots=True, kw_only=True)
class PartitionInfo:
    name: str
    nodes: tuple[str, ...]
    state: str  # UP, DOWN, DRAIN, INACTIVE
    total_nodes: int
    max_nodes: int | None  # per job; None: unlimited
    default: bool


# --- host lists ---------------------------------------------------------------------

_RANGE = re.compile(r"^(\d+)(?:-(\d+))?$")


def expand_hostlist(text: str) -> tuple[str, ...]:
    """``node[1-3,7],gpu-a[01-02]`` -> every name, in order (zero padding kept)."""
    text = text.strip()
    if text in ("", "(null)", "None"):
        return ()
    out: list[str] = []
    for item in _split_top(text):
        m = re.fullmatch(r"([^\[\]]*)\[([^\[\]]+)\]([^\[\]]*)", item)
        if m is None:
            if "[" in item or "]" in item:
                raise SlurmParseError(f"cannot read host list {text!r}")
            out.append(item)
            continue
        prefix, ranges, suffix = m.groups()
        for part in ranges.split(","):
            r = _RANGE.match(part)
            if r is None:
                raise SlurmParseError(f"cannot read host list {text!r}: bad range {part!r}")
            lo, hi = r.group(1), r.group(2) or r.group(1)
            if int(hi) < int(lo) or int(hi) - int(lo) > 100_000:
                raise SlurmParseError(f"cannot read host list {text!r}: bad range {part!r}")
            width = len(lo) if lo.startswith("0") else 0
            out.extend(f"{prefix}{k:0{width}d}{suffix}" for k in range(int(lo), int(hi) + 1))
    return tuple(out)


def _split_top(text: str) -> list[str]:
    """Split on commas outside brackets."""
    items, depth, cur = [], 0, ""
    for ch in text:
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
        if ch == "," and depth == 0:
            items.append(cur)
            cur = ""
        else:
            cur += ch
    if depth != 0:
        raise SlurmParseError(f"cannot read host list {text!r}: unbalanced brackets")
    items.append(cur)
    return [i for i in items if i]


# --- squeue -------------------------------------------------------------------------

SQUEUE_FORMAT = "%i|%T|%N|%r|%j"
STEPS_FORMAT = "%i|%N|%j"


def _phase(state: str) -> JobPhase:
    base = state.split("+", maxsplit=1)[0].split(" ", maxsplit=1)[0].upper()
    phase = JOB_STATES.get(base)
    if phase is None:
        raise SlurmParseError(f"unknown Slurm job state {state!r}")
    return phase


def _number(v: Any) -> Any:
    """23.02+ wraps numbers as {"set": bool, "infinite": bool, "number": N}."""
    if isinstance(v, dict) and "number" in v:
        return v["number"] if v.get("set", True) else None
    return v


def parse_squeue_json(text: str) -> dict[str, JobInfo]:
    try:
        doc = json.loads(text)
        jobs = doc["jobs"]
        if not isinstance(jobs, list):
            raise TypeError("jobs is not a list")
        errors = doc.get("errors") or []
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise SlurmParseError(f"squeue --json: {e}") from e
    if errors:
        # squeue exits 0 with an empty job list and an error when slurmctld cannot be
        # reached: that list says nothing about which jobs exist.
        first = errors[0] if isinstance(errors[0], dict) else {"error": str(errors[0])}
        words = "; ".join(str(first[k]) for k in ("source", "description", "error") if first.get(k))
        raise SlurmParseError(f"squeue --json reported an error: {words or first}")
    out: dict[str, JobInfo] = {}
    for j in jobs:
        try:
            state = j["job_state"]
            if isinstance(state, list):  # 23.02+: ["RUNNING"] or ["PENDING", "REQUEUED"]
                state = state[0] if state else ""
            job_id = str(_number(j["job_id"]))
            nodes = j.get("nodes") or ""
            info = JobInfo(job_id=job_id, name=str(j.get("name", "")), state=str(state),
                           phase=_phase(str(state)),
                           nodes=expand_hostlist(nodes) if _phase(str(state)) is JobPhase.HOLDING else (),
                           reason=str(j.get("state_reason", "")))
        except (KeyError, TypeError, IndexError) as e:
            raise SlurmParseError(f"squeue --json: job record without {e}") from e
        out[info.job_id] = info
    return out


def parse_squeue_text(text: str) -> dict[str, JobInfo]:
    """Output of ``squeue -h -o SQUEUE_FORMAT``."""
    out: dict[str, JobInfo] = {}
    for line in text.splitlines():
        if not line.strip():
            continue
        parts = line.split("|", 4)
        if len(parts) != 5:
            raise SlurmParseError(f"squeue: cannot read line {line!r}")
        job_id, state, nodes, reason, name = (p.strip() for p in parts)
        phase = _phase(state)
        out[job_id] = JobInfo(job_id=job_id, name=name, state=state, phase=phase,
                              nodes=expand_hostlist(nodes) if phase is JobPhase.HOLDING else (),
                              reason=reason)
    return out


def parse_steps_text(text: str) -> list[StepInfo]:
    """Output of ``squeue --steps -h -o STEPS_FORMAT``: ``3.0|node[1,3]|tsup.run-1.a2``."""
    out = []
    for line in text.splitlines():
        if not line.strip():
            continue
        parts = line.split("|", 2)
        if len(parts) != 3 or "." not in parts[0]:
            raise SlurmParseError(f"squeue --steps: cannot read line {line!r}")
        job_id, step_id = parts[0].strip().split(".", 1)
        out.append(StepInfo(job_id=job_id, step_id=step_id, name=parts[2].strip(),
                            nodes=expand_hostlist(parts[1])))
    return out


# --- scontrol -o --------------------------------------------------------------------


# Reason= ends where the next key starts: a node's is last on 22.05 but followed by
# Comment=, Extra= ... on newer Slurm (src/api/node_info.c); a job's is mid-line.
_AFTER_REASON = re.compile(r" (?=[A-Z][A-Za-z0-9_:/]*=)")


def parse_key_values(line: str) -> dict[str, str]:
    """One ``scontrol -o`` record. Values hold no spaces except ``Reason``."""
    reason = ""
    if " Reason=" in line:
        line, reason = line.split(" Reason=", 1)
        reason, *after = _AFTER_REASON.split(reason, maxsplit=1)
        line = " ".join([line, *after])
    out: dict[str, str] = {}
    for token in line.split():
        key, sep, value = token.partition("=")
        if sep:
            out[key] = value
    if reason:
        # "probe failed: ECC [root@2026-11-22T08:59:15]": drop Slurm's who-and-when suffix.
        out["Reason"] = re.sub(r"\s*\[[^\]]*@[^\]]*\]\s*$", "", reason)
    return out


def parse_nodes(text: str) -> dict[str, NodeInfo]:
    """Output of ``scontrol -o show node``."""
    out: dict[str, NodeInfo] = {}
    for line in text.splitlines():
        if not line.strip():
            continue
        kv = parse_key_values(line)
        if "NodeName" not in kv or "State" not in kv:
            raise SlurmParseError(f"scontrol show node: cannot read line {line[:120]!r}")
        state = kv["State"]
        if state.endswith("*"):  # IDLE*: Slurm's mark for a node that does not respond
            state = state.rstrip("*") + "+NOT_RESPONDING"
        out[kv["NodeName"]] = NodeInfo(name=kv["NodeName"], state=state,
                                       addr=kv.get("NodeAddr", kv["NodeName"]), reason=kv.get("Reason", ""))
    return out


def parse_partitions(text: str) -> dict[str, PartitionInfo]:
    """Output of ``scontrol -o show partition``."""
    out: dict[str, PartitionInfo] = {}
    for line in text.splitlines():
        if not line.strip():
            continue
        kv = parse_key_values(line)
        try:
            name = kv["PartitionName"]
            max_nodes = kv.get("MaxNodes", "UNLIMITED")
            out[name] = PartitionInfo(
                name=name, nodes=expand_hostlist(kv.get("Nodes", "")), state=kv.get("State", "UP"),
                total_nodes=int(kv.get("TotalNodes", "0")),
                max_nodes=None if max_nodes == "UNLIMITED" else int(max_nodes),
                default=kv.get("Default", "NO") == "YES",
            )
        except (KeyError, ValueError) as e:
            raise SlurmParseError(f"scontrol show partition: cannot read line {line[:120]!r}: {e}") from e
    return out


def parse_sbatch_job_id(text: str) -> str:
    """``sbatch --parsable`` prints ``<job_id>`` or ``<job_id>;<cluster>``."""
    first = text.strip().split(";")[0]
    if not first.isdigit():
        raise SlurmParseError(f"sbatch --parsable printed {text.strip()[:80]!r}, not a job id")
    return first

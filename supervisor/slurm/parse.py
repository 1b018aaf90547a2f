"""Pure parsers for what Slurm's commands print: jobs, steps, nodes, partitions.

No I/O here: supervisor/slurm/commands.py runs the commands and hands the text over.
Every parser takes the whole output and returns plain records, or raises
``SlurmParseError`` naming what it could not read; the caller turns that into "state
unknown", never into "job failed". Recorded outputs live in tests/fixtures/slurm/.

Formats, and which Slurm prints which:

- ``squeue --json``: 22.05 (openapi v0.0.38) prints flat values (``"job_state":
  "RUNNING"``); 23.02 and later print ``job_state`` as a list of flags and numbers as
  ``{"set": true, "number": N}``. Both are read.
- ``squeue -h -o "%i|%T|%N|%r|%U|%j"``: every version; the fallback when ``--json`` is
  missing (Slurm before 21.08, or no openapi plugin). squeue lists every user's jobs and
  a name is free text (it may hold ``|``), so the name comes last and takes the rest.
  Each job carries its owner's uid: a job is the supervisor's only when its owner is
  the one expected (supervisor/slurm/launcher.py), whatever its name says.
- ``squeue --steps -h -o "%i|%N|%U|%j"``: steps (22.05's ``--json`` has no steps).
  A name may hold a newline, and any user names their jobs and steps: a name of
  ``x\n3.0|node1|1001|tsup...`` would read as a record of its own, another user's. So
  the supervisor's polls frame the name between two copies of a random word made for
  that poll (``framed``): a name runs from its opening frame to its closing one, and no
  name can hold a frame it cannot know. A record whose name is not printable (a control
  or format character) is dropped: no name of the supervisor's is.
- The node table: ``sinfo --json`` (22.05: one record per node, the state and its flags
  apart, ``address``, ``reason``) or ``scontrol --json show node`` (23.02 and later;
  ``state`` a list of flags). Where neither answers, the text of
  ``scontrol -o show node``. A node's ``Reason=`` there is free text that may carry a
  trainer's words (the supervisor drains a node with the line that blamed it), so none of
  it is ever read as fields: it runs to Slurm's ``[user@time]`` stamp when only the keys
  Slurm prints after a reason follow it (``NODE_KEYS_AFTER_REASON``), else to the end of
  the line, and no key after it overrides one before it.
  A state ending in ``*`` (``IDLE*``) means the node does not respond.
- ``scontrol -o show partition`` (and ``show job``, for tests): ``Key=Value`` pairs; a
  job's ``Reason=`` is Slurm's own word (``None``, ``Resources``).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
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
    # The owner's uid (None: not printed). Not part of a record's equality: the launcher
    # checks it wherever a job is taken for the supervisor's (owned_by).
    user_id: int | None = field(default=None, compare=False)
    # How often the job was requeued ($SLURM_RESTART_COUNT; None: not printed, as by the
    # text form).
    restarts: int | None = field(default=None, compare=False)

    def owned_by(self, uid: int | None) -> bool:
        """The job is ``uid``'s (``uid`` None: no owner expected, as for a record from
        before owners were kept)."""
        return uid is None or self.user_id == uid

    @property
    def held_by_owner(self) -> bool:
        """Held in the queue by its owner (``scontrol hold``, ``requeuehold``): it starts
        only once released, by its owner or an operator."""
        return self.reason in HELD_BY_OWNER

    @property
    def finishing(self) -> bool:
        """Its steps are still being ended on the nodes it held (a dead node's until Slurm
        declares it down): of a job requeued, one that can start again only after that."""
        return self.state.upper().startswith("COMPLETING")


# Slurm's state reason for a job its owner holds: squeue --json's, and the text form's
# (which prints the reason's description where there is one).
HELD_BY_OWNER = frozenset({"JobHeldUser", "job requeued in held state"})


@dataclass(frozen=True, slots=True, kw_only=True)
class StepInfo:
    job_id: str
    step_id: str  # "0", "1", "batch", "extern"
    name: str
    nodes: tuple[str, ...]
    user_id: int | None = field(default=None, compare=False)  # as JobInfo's

    def owned_by(self, uid: int | None) -> bool:
        return uid is None or self.user_id == uid


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

# The supervisor's polls ask for the owner's uid (%U) before the free-text name; the
# forms without it are for tools and tests that read a box.
SQUEUE_OWNED_FORMAT = "%i|%T|%N|%r|%U|%j"
STEPS_OWNED_FORMAT = "%i|%N|%U|%j"
SQUEUE_FORMAT = "%i|%T|%N|%r|%j"
STEPS_FORMAT = "%i|%N|%j"


def _phase(state: str, reason: str = "") -> JobPhase:
    base = state.split("+", maxsplit=1)[0].split(" ", maxsplit=1)[0].upper()
    phase = JOB_STATES.get(base)
    if phase is None:
        raise SlurmParseError(f"unknown Slurm job state {state!r}")
    if base == "COMPLETING" and reason in HELD_BY_OWNER:
        return JobPhase.WAITING  # requeued and held, its old steps still ending (22.05)
    return phase


def _number(v: Any) -> Any:
    """23.02+ wraps numbers as {"set": bool, "infinite": bool, "number": N}."""
    if isinstance(v, dict) and "number" in v:
        return v["number"] if v.get("set", True) else None
    return v


def _whole(v: Any) -> int | None:
    """A whole number as Slurm printed it (an owner's uid, a restart count: a number,
    wrapped or not, or digits); None when it printed none."""
    v = _number(v)
    if isinstance(v, bool):
        return None
    if isinstance(v, int):
        return v
    return int(v) if isinstance(v, str) and v.isdigit() else None


def _json_records(text: str, what: str, key: str) -> list[Any]:
    """The ``key`` list of a Slurm ``--json`` document. Slurm exits 0 with an empty list
    and an error when slurmctld cannot be reached: that list says nothing about what
    exists, so an error in the document is a parse error."""
    try:
        doc = json.loads(text)
        records = doc[key]
        if not isinstance(records, list):
            raise TypeError(f"{key} is not a list")
        errors = doc.get("errors") or []
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise SlurmParseError(f"{what}: {e}") from e
    if errors:
        first = errors[0] if isinstance(errors[0], dict) else {"error": str(errors[0])}
        words = "; ".join(str(first[k]) for k in ("source", "description", "error") if first.get(k))
        raise SlurmParseError(f"{what} reported an error: {words or first}")
    return records


def parse_squeue_json(text: str) -> dict[str, JobInfo]:
    out: dict[str, JobInfo] = {}
    for j in _json_records(text, "squeue --json", "jobs"):
        try:
            state = j["job_state"]
            if isinstance(state, list):  # 23.02+: ["RUNNING"] or ["PENDING", "REQUEUED"]
                state = state[0] if state else ""
            job_id = str(_number(j["job_id"]))
            nodes = j.get("nodes") or ""
            reason = str(j.get("state_reason", ""))
            phase = _phase(str(state), reason)
            info = JobInfo(job_id=job_id, name=str(j.get("name", "")), state=str(state), phase=phase,
                           nodes=expand_hostlist(nodes) if phase is JobPhase.HOLDING else (),
                           reason=reason, user_id=_whole(j.get("user_id")),
                           restarts=_whole(j.get("restart_cnt")))
        except (KeyError, TypeError, IndexError) as e:
            raise SlurmParseError(f"squeue --json: job record without {e}") from e
        out[info.job_id] = info
    return out


def framed(fmt: str, frame: str) -> str:
    """``fmt`` (its last field a free-text name) with the name between two ``frame``s."""
    head, _, name = fmt.rpartition("|")
    return f"{head}|{frame}{name}{frame}"


def _records(text: str, fields: int, frame: str | None, what: str) -> list[list[str]]:
    """The records of squeue's ``text``, each its ``fields`` fields, the last the name:
    with ``frame``, each name between its frames (see the module docstring); without,
    one record a line. A record whose name is not printable is left out."""
    out: list[list[str]] = []
    rows: list[tuple[str, str | None]] = []  # (the fields before the name, the framed name)
    if frame is None:
        rows = [(line, None) for line in text.splitlines() if line.strip()]
    else:
        pos = 0
        while (start := text.find(frame, pos)) >= 0:
            end = text.find(frame, start + len(frame))
            if end < 0:
                raise SlurmParseError(f"{what}: a name without its closing frame")
            rows.append((text[pos:start].lstrip("\n"), text[start + len(frame):end]))
            pos = end + len(frame)
        if text[pos:].strip():
            raise SlurmParseError(f"{what}: cannot read {text[pos:pos + 200]!r}")
    for head, name in rows:
        parts = head.split("|", fields - 1) if name is None else head.split("|")
        if name is not None:
            if parts[-1] != "" or "\n" in head:
                raise SlurmParseError(f"{what}: cannot read {head!r}")
            parts[-1] = name
        if len(parts) != fields:
            raise SlurmParseError(f"{what}: cannot read line {head!r}")
        if not parts[-1].isprintable():
            continue  # no record of ours has such a name
        out.append(parts)
    return out


def parse_squeue_text(text: str, *, owners: bool = False, frame: str | None = None) -> dict[str, JobInfo]:
    """Output of ``squeue -h -o SQUEUE_FORMAT`` (``owners``: SQUEUE_OWNED_FORMAT; ``frame``:
    the format ``framed`` with it)."""
    fields = 6 if owners else 5
    out: dict[str, JobInfo] = {}
    for record in _records(text, fields, frame, "squeue"):
        job_id, state, nodes, reason, *rest = (x.strip() for x in record)
        phase = _phase(state, reason)
        out[job_id] = JobInfo(job_id=job_id, name=rest[-1], state=state, phase=phase,
                              nodes=expand_hostlist(nodes) if phase is JobPhase.HOLDING else (),
                              reason=reason, user_id=_whole(rest[0]) if owners else None)
    return out


def parse_steps_text(text: str, *, owners: bool = False, frame: str | None = None) -> list[StepInfo]:
    """Output of ``squeue --steps -h -o STEPS_FORMAT``: ``3.0|node[1,3]|tsup.run-1.a2``
    (``owners``: STEPS_OWNED_FORMAT, ``3.0|node[1,3]|1001|tsup.run-1.a2``; ``frame``: the
    format ``framed`` with it)."""
    fields = 4 if owners else 3
    out = []
    for parts in _records(text, fields, frame, "squeue --steps"):
        if "." not in parts[0]:
            raise SlurmParseError(f"squeue --steps: cannot read {'|'.join(parts)!r}")
        job_id, step_id = parts[0].strip().split(".", 1)
        out.append(StepInfo(job_id=job_id, step_id=step_id, name=parts[-1].strip(),
                            nodes=expand_hostlist(parts[1]),
                            user_id=_whole(parts[2].strip()) if owners else None))
    return out


# --- nodes --------------------------------------------------------------------------


def parse_nodes_json(text: str, what: str = "sinfo --json") -> dict[str, NodeInfo]:
    """Output of ``sinfo --json`` (22.05: ``"state": "idle"``, ``"state_flags":
    ["DRAIN"]``) or ``scontrol --json show node`` (23.02+: ``"state": ["IDLE",
    "DRAIN"]``): the node table, each Reason a string of its own."""
    out: dict[str, NodeInfo] = {}
    for n in _json_records(text, what, "nodes"):
        try:
            name = str(n["name"] or "")
            state = n["state"]
            flags = [*state] if isinstance(state, list) else [state, *(n.get("state_flags") or [])]
            words = [str(f).upper() for f in flags if f]
            address = n.get("address")
        except (KeyError, TypeError) as e:
            raise SlurmParseError(f"{what}: node record without {e}") from e
        if not name:
            continue  # a blank dynamic node: no node yet
        if not words:
            raise SlurmParseError(f"{what}: node {name!r} has no state")
        out[name] = NodeInfo(name=name, state="+".join(words), addr=str(address or name),
                             reason=str(n.get("reason") or ""))
    return out


# After a node's Reason and its "[user@time]" stamp, Slurm prints only these, each when
# set and in this order (src/api/node_info.c: none on 22.05).
NODE_KEYS_AFTER_REASON = ("Comment", "Extra", "InstanceId", "InstanceType", "ReservationName")
_STAMP = re.compile(r" \[[^\[\]\s]+@[^\[\]\s]+\]")  # " [root@2026-11-22T08:59:15]"
_NODE_TAIL = re.compile("".join(rf"(?: {k}=(?P<{k}>.*?))?" for k in NODE_KEYS_AFTER_REASON) + "$")


def _node_reason(text: str) -> tuple[str, dict[str, str]]:
    """What follows ``Reason=`` on a node line: the reason, and the keys Slurm printed
    after it. The reason is free text, so nothing in it is a key: it runs to the last
    stamp that only known keys follow (a stamp a trainer wrote comes before Slurm's
    own), else to the end of the line."""
    for stamp in reversed(list(_STAMP.finditer(text))):
        tail = _NODE_TAIL.fullmatch(text[stamp.end():])
        if tail is not None:
            return text[:stamp.start()], {k: v for k, v in tail.groupdict().items() if v is not None}
    return text, {}


def parse_node_line(line: str) -> dict[str, str]:
    """One line of ``scontrol -o show node``: the pairs before ``Reason=``, then the
    reason whole, then the known keys after it; none overrides one before it."""
    head, sep, rest = line.partition(" Reason=")
    out = parse_key_values(head)
    if sep:
        reason, after = _node_reason(rest)
        out["Reason"] = reason
        for key, value in after.items():
            out.setdefault(key, value)
    return out


def parse_nodes(text: str) -> dict[str, NodeInfo]:
    """Output of ``scontrol -o show node``."""
    out: dict[str, NodeInfo] = {}
    for line in text.splitlines():
        if not line.strip():
            continue
        kv = parse_node_line(line)
        if "NodeName" not in kv or "State" not in kv:
            raise SlurmParseError(f"scontrol show node: cannot read line {line[:120]!r}")
        state = kv["State"]
        if state.endswith("*"):  # IDLE*: Slurm's mark for a node that does not respond
            state = state.rstrip("*") + "+NOT_RESPONDING"
        out[kv["NodeName"]] = NodeInfo(name=kv["NodeName"], state=state,
                                       addr=kv.get("NodeAddr", kv["NodeName"]), reason=kv.get("Reason", ""))
    return out


# --- scontrol -o --------------------------------------------------------------------


# A job's Reason= is Slurm's own word, mid-line: it ends where the next key starts.
_AFTER_REASON = re.compile(r" (?=[A-Z][A-Za-z0-9_:/]*=)")


def parse_key_values(line: str) -> dict[str, str]:
    """One ``scontrol -o`` record of a job or partition (a node's: ``parse_node_line``).
    Values hold no spaces except ``Reason``'s; a key given twice keeps its first value."""
    reason = ""
    if " Reason=" in line:
        line, reason = line.split(" Reason=", 1)
        reason, *after = _AFTER_REASON.split(reason, maxsplit=1)
        line = " ".join([line, *after])
    out: dict[str, str] = {}
    for token in line.split():
        key, sep, value = token.partition("=")
        if sep:
            out.setdefault(key, value)
    if reason:
        # "probe failed: ECC [root@2026-11-22T08:59:15]": drop Slurm's who-and-when suffix.
        out["Reason"] = re.sub(r"\s*\[[^\]]*@[^\]]*\]\s*$", "", reason)
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

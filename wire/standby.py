"""A warm standby's assignment: the one line a launcher writes to a standby's standard
input to make it a rank (trainer/standby.py is the standby itself), a JSON object

    {"argv": ["--config", FILE, "--resume", PATH], "env": {...}, "log": FILE, "cwd": DIR|null}

Under Slurm a generation of standbys is one srun step with ``--input=all``, so the line
goes to every task and is a broadcast,

    {"slots": {"NODE/LOCAL_RANK": ASSIGNMENT, ...}}

from which each standby takes the assignment of its own slot (``slot_key``).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

SLOT_ENV = "TSUP_STANDBY_SLOT"  # the local rank a standby stands in for: its device on a GPU node
NODE_ENV = "TSUP_NODE"  # the node it waits on (the local launcher's); under Slurm, SLURMD_NODENAME


@dataclass(frozen=True, slots=True)
class Assignment:
    argv: list[str]  # python -m trainer's arguments
    env: dict[str, str]  # added to the environment
    log: str  # the rank's log file, appended to
    cwd: str | None

    @classmethod
    def parse(cls, line: bytes) -> Assignment:
        """Raises ValueError for anything but the object described above."""
        return cls.from_json(json.loads(line))

    @classmethod
    def from_json(cls, data: Any) -> Assignment:
        """The assignment ``data`` (decoded JSON) is; ValueError for anything else."""
        if not isinstance(data, dict) or set(data) != {"argv", "env", "log", "cwd"}:
            raise ValueError("an assignment is an object with argv, env, log and cwd")
        argv, env, log, cwd = data["argv"], data["env"], data["log"], data["cwd"]
        if not (isinstance(argv, list) and all(isinstance(a, str) for a in argv)):
            raise ValueError("argv: a list of strings")
        if not (isinstance(env, dict) and all(isinstance(k, str) and isinstance(v, str)
                                              for k, v in env.items())):
            raise ValueError("env: an object of strings")
        if not isinstance(log, str) or not (cwd is None or isinstance(cwd, str)):
            raise ValueError("log: a path; cwd: a path or null")
        return cls(argv=argv, env=env, log=log, cwd=cwd)

    def to_json(self) -> dict[str, Any]:
        return {"argv": self.argv, "env": self.env, "log": self.log, "cwd": self.cwd}

    def encode(self) -> bytes:
        return json.dumps(self.to_json()).encode() + b"\n"


def slot_key(environ: Mapping[str, str]) -> str:
    """"NODE/LOCAL_RANK": the slot this standby stands in for, as a broadcast names it."""
    node = environ.get(NODE_ENV) or environ.get("SLURMD_NODENAME", "")
    return f"{node}/{slot_of(environ) or 0}"


def slot_of(environ: Mapping[str, str]) -> str | None:
    """The local rank it stands in for: the launcher's word, else Slurm's task's."""
    return environ.get(SLOT_ENV) or environ.get("SLURM_LOCALID")


def parse_line(line: bytes, key: str) -> Assignment | None:
    """This standby's assignment in ``line``: the line itself, or its slot's of a broadcast
    (None: the broadcast has no slot ``key``, so it is not needed). ValueError for a line
    that is neither."""
    try:
        data: Any = json.loads(line)
    except ValueError as e:
        raise ValueError(f"not JSON: {e}") from None
    if isinstance(data, dict) and set(data) == {"slots"}:
        slots = data["slots"]
        if not isinstance(slots, dict):
            raise ValueError("slots: an object of assignments by NODE/LOCAL_RANK")
        mine = slots.get(key)
        return None if mine is None else Assignment.from_json(mine)
    return Assignment.parse(line)


def broadcast(assignments: Mapping[str, Assignment]) -> bytes:
    """One line for a generation of standbys that all read it: each takes its slot's."""
    return json.dumps({"slots": {key: a.to_json() for key, a in assignments.items()}}).encode() + b"\n"

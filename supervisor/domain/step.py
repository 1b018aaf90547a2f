"""What a job step looks like to the command it runs, and the step placeholders.

An attempt runs as one step: ``launch = "rank"`` starts the trainer once per rank with
the torchrun variables set (RANK, LOCAL_RANK, WORLD_SIZE, ...); ``launch = "node"``
starts it once per node, and the user's own torchrun or ``train.sh`` spawns the ranks.

A ``[command]``'s argv, env and resume items may name the step's rendezvous:

    {nnodes}          nodes in the step
    {nproc_per_node}  ranks per node (resources.ranks_per_node)
    {master_addr}     the step's first node, as the other nodes reach it
    {master_port}     a port on it, fresh for each attempt
    {rdzv_id}         an id unique to the attempt (torchrun's --rdzv_id)

Only the launcher knows the master when it starts the step (Slurm decides the nodes'
order), so these are filled in last: ``trainer_cmd`` leaves a marker in their place
(``deferred``), and the launcher replaces the markers with ``Step.fill``. The marker
holds NUL bytes, which no command line can carry: one left unfilled makes the launch
fail rather than run with a wrong argument.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

LaunchMode = Literal["rank", "node"]
STEP_PLACEHOLDERS = ("nnodes", "nproc_per_node", "master_addr", "master_port", "rdzv_id")


def deferred(name: str) -> str:
    """The marker left for step placeholder ``name`` until the launcher fills it."""
    return f"\0tsup:{name}\0"


DEFERRED = {name: deferred(name) for name in STEP_PLACEHOLDERS}


def readable(text: str) -> str:
    """``text`` with its markers shown as the placeholders they stand for (for records)."""
    for name in STEP_PLACEHOLDERS:
        text = text.replace(deferred(name), "{" + name + "}")
    return text


def rdzv_id(run_id: str, attempt: int) -> str:
    return f"{run_id}.a{attempt}"


@dataclass(frozen=True, slots=True, kw_only=True)
class Step:
    nnodes: int
    nproc_per_node: int
    master_addr: str
    master_port: int | str  # a str only in a dry run ("<port>")
    rdzv_id: str

    def fill(self, text: str) -> str:
        if "\0" not in text:
            return text
        for name in STEP_PLACEHOLDERS:
            text = text.replace(deferred(name), str(getattr(self, name)))
        return text

    def fill_all(self, items: tuple[str, ...]) -> tuple[str, ...]:
        return tuple(self.fill(a) for a in items)

    @property
    def world_size(self) -> int:
        return self.nnodes * self.nproc_per_node

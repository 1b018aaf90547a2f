"""How often to checkpoint: the failure rate of a cluster and the Young/Daly rule (pure).

Llama 3's pre-training (Meta, "The Llama 3 Herd of Models", 2024, section 3.3.4) saw 419
unexpected interruptions in a 54-day snapshot on 16,384 H100 GPUs (2,048 nodes of 8),
about 78 % of them hardware (GPUs, HBM, hosts, network) and the rest software or unknown.
Per node that is one interruption every 2048 x 54 / 419 = 264 node-days.

With MTBF the job's mean time between failures (a node's, over the number of nodes the
job spans) and C the time one checkpoint costs the job, the interval between checkpoints
that wastes least is, to first order, sqrt(2 C MTBF) (Young 1974, Daly 2006).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

LLAMA3_INTERRUPTIONS = 419
LLAMA3_DAYS = 54.0
LLAMA3_NODES = 2048  # 16,384 GPUs, 8 per node
LLAMA3_HARDWARE_SHARE = 0.78
# Interruptions per node per second, and per node-day.
LLAMA3_RATE_PER_NODE_S = LLAMA3_INTERRUPTIONS / (LLAMA3_DAYS * 86_400.0 * LLAMA3_NODES)
LLAMA3_FAILURES_PER_NODE_DAY = LLAMA3_RATE_PER_NODE_S * 86_400.0


def job_mtbf_s(nodes: int, rate_per_node_s: float = LLAMA3_RATE_PER_NODE_S) -> float:
    """Mean time between interruptions of a job spanning ``nodes`` nodes."""
    if nodes < 1 or rate_per_node_s <= 0:
        raise ValueError("nodes must be >= 1 and the rate positive")
    return 1.0 / (nodes * rate_per_node_s)


def young_daly_interval_s(checkpoint_cost_s: float, mtbf_s: float) -> float:
    """sqrt(2 x checkpoint cost x MTBF): the checkpoint interval that wastes least."""
    if checkpoint_cost_s < 0 or mtbf_s <= 0:
        raise ValueError("the checkpoint cost must be >= 0 and the MTBF positive")
    return math.sqrt(2.0 * checkpoint_cost_s * mtbf_s)


def advise_every_steps(checkpoint_cost_s: float, step_time_s: float, nodes: int,
                       rate_per_node_s: float = LLAMA3_RATE_PER_NODE_S) -> int:
    """The Young/Daly interval in training steps (at least 1)."""
    if step_time_s <= 0:
        raise ValueError("the step time must be positive")
    interval = young_daly_interval_s(checkpoint_cost_s, job_mtbf_s(nodes, rate_per_node_s))
    return max(1, round(interval / step_time_s))


# A run whose spec says ``every_steps = "auto"`` checkpoints this often until its own
# checkpoint cost and step time have been measured (the reference trainer's default);
# ``memory_every_steps = "auto"``, its memory tier, at a fifth of that.
AUTO_FIRST_EVERY_STEPS = 50
AUTO_FIRST_MEMORY_EVERY_STEPS = 10
TIER_PERSISTENT, TIER_MEMORY = "persistent", "memory"


def first_auto_every_steps(total_steps: int, tier: str = TIER_PERSISTENT) -> int:
    """An ``auto`` run's interval before anything was measured."""
    first = AUTO_FIRST_MEMORY_EVERY_STEPS if tier == TIER_MEMORY else AUTO_FIRST_EVERY_STEPS
    return min(first, max(1, total_steps))


@dataclass(frozen=True, slots=True, kw_only=True)
class AutoInterval:
    every_steps: int
    why: str  # for the event log


def auto_every_steps(checkpoint_cost_s: float | None, step_time_s: float | None, nodes: int,
                     failures_per_node_day: float, total_steps: int,
                     tier: str = TIER_PERSISTENT) -> AutoInterval:
    """The interval of a checkpoint tier for the next attempt of a run that asked for
    ``auto``: Young/Daly from what the run measured so far (the mean time that tier's
    saves blocked training, and the mean step time), within 1 and the run's length.
    Each tier has its own cost, so its own interval: the memory tier's copy to host
    memory is cheap and it is taken often; a persistent save is taken as rarely as its
    (synchronous, or for an asynchronous save, staging) cost says. Before both were
    measured: ``first_auto_every_steps``."""
    cap = max(1, total_steps)
    if checkpoint_cost_s is None or step_time_s is None:
        every = first_auto_every_steps(total_steps, tier)
        return AutoInterval(every_steps=every,
                            why=f"every {every} steps until a checkpoint and steps are timed")
    cost, step = checkpoint_cost_s, step_time_s
    mtbf = job_mtbf_s(nodes, failures_per_node_day / 86_400.0)
    ideal = advise_every_steps(cost, max(step, 1e-6), nodes, failures_per_node_day / 86_400.0)
    every = min(ideal, cap)
    capped = f"; the run has only {total_steps} steps" if ideal > cap else ""
    return AutoInterval(every_steps=every, why=(
        f"every {every} steps: Young/Daly sqrt(2 x {cost:.{2 if cost >= 0.1 else 3}f} s a checkpoint x "
        f"MTBF {mtbf / 3600:.1f} h of "
        f"{nodes} node(s) at {failures_per_node_day:g} failures per node-day) = {ideal} steps of {step:.3f} s"
        f"{capped}"))


class Timed(Protocol):
    """What one attempt's recorded steps add up to (supervisor/domain's ``AttemptStats``)."""

    @property
    def steps(self) -> int: ...
    @property
    def step_time_s(self) -> float: ...
    @property
    def first_step_time_s(self) -> float | None: ...
    @property
    def checkpoints(self) -> int: ...
    @property
    def checkpoint_s(self) -> float: ...


def measured_costs(stats: Sequence[Timed], memory_saves_s: Sequence[float],
                   tier: str) -> tuple[float | None, float | None]:
    """What the run measured so far, for ``auto_every_steps``: the mean time one save of
    ``tier`` blocked training (the memory tier's saves, ``memory_saves_s``; else the
    persistent saves the attempts' stats count), and the mean step time (None: not yet
    measured). Each attempt's first step is left out: it carries the warm-up (compile,
    caches)."""
    if tier == TIER_MEMORY:
        cost = sum(memory_saves_s) / len(memory_saves_s) if memory_saves_s else None
    else:
        saves = sum(s.checkpoints for s in stats)
        cost = sum(s.checkpoint_s for s in stats) / saves if saves else None
    steps = sum(s.steps - 1 for s in stats if s.steps > 1)
    step_s = sum(s.step_time_s - (s.first_step_time_s or 0.0) for s in stats if s.steps > 1)
    return cost, step_s / steps if steps else None

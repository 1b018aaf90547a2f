"""What the policy tests build their worlds from: a run, its attempts, nodes, ranks and
observations, as plain values (tests/unit/test_policy_*.py)."""

from __future__ import annotations

import signal
from dataclasses import replace

from supervisor.domain import (
    Attempt,
    AttemptObs,
    AttemptOutcome,
    AttemptState,
    CheckpointRef,
    Command,
    CommandKind,
    FaultKind,
    FaultRecord,
    Node,
    NodeState,
    Policy,
    ProcState,
    RankObs,
    RecordFault,
    Run,
    RunState,
    RunView,
    StepSample,
)
from supervisor.policy import decide

NOW = 1_000.0
SIGKILL = -int(signal.SIGKILL)


def run(state: RunState = RunState.RUNNING, **kw: object) -> Run:
    base = Run(number=7, name="t", state=state, reason="", nodes=2, ranks_per_node=2, spares=1,
               total_steps=100, policy=Policy(failures_without_progress=3, hang_timeout_s=60, startup_timeout_s=300,
                                              stop_grace_s=10),
               created_at=0.0)
    return replace(base, **kw)  # type: ignore[arg-type]


def attempt(number: int = 1, state: AttemptState = AttemptState.RUNNING, **kw: object) -> Attempt:
    base = Attempt(run_number=7, number=number, state=state, nodes=("n1", "n2"), resume_from=None,
                   resume_step=0, created_at=10.0, started_at=10.0, first_step_at=20.0,
                   launch_info="{}")
    return replace(base, **kw)  # type: ignore[arg-type]


def nodes(*states: NodeState) -> tuple[Node, ...]:
    return tuple(Node(name=f"n{i + 1}", state=s, run_number=7) for i, s in enumerate(states))


HEALTHY3 = nodes(NodeState.ALLOCATED, NodeState.ALLOCATED, NodeState.ALLOCATED)


def view(r: Run, attempts: tuple[Attempt, ...] = (), alloc: tuple[Node, ...] = HEALTHY3,
         ck: CheckpointRef | None = None, commands: tuple[Command, ...] = (), open_faults: int = 0) -> RunView:
    return RunView(run=r, attempts=attempts, allocation=alloc, newest_checkpoint=ck, commands=commands,
                   open_faults=open_faults)


def rank(r: int, proc: ProcState = ProcState.RUNNING, **kw: object) -> RankObs:
    base = RankObs(rank=r, node="n1" if r < 2 else "n2", proc=proc, last_step=50, progress_at=NOW - 1)
    if proc in (ProcState.EXITED, ProcState.VANISHED) or kw.get("lost"):
        base = replace(base, dead_since=NOW - 5)  # seen dead long enough to be judged
    return replace(base, **kw)  # type: ignore[arg-type]


def obs(*ranks: RankObs, **kw: object) -> AttemptObs:
    kw.setdefault("telemetry_up_since", 0.0)
    return AttemptObs(ranks=ranks or tuple(rank(i) for i in range(4)), **kw)  # type: ignore[arg-type]


def of(effects: list[object], cls: type) -> list:  # type: ignore[type-arg]
    return [e for e in effects if isinstance(e, cls)]


def one_rank_nodes(*ranks: RankObs) -> AttemptObs:
    """Nodes of one rank each: rank r on node n{r + 1}."""
    return obs(*(replace(r, node=f"n{r.rank + 1}", process=100 + r.rank) for r in ranks))


def heard(r: int, ago_s: float, proc: ProcState = ProcState.RUNNING) -> RankObs:
    return rank(r, proc, last_seen_at=NOW - ago_s)


def cmd(kind: CommandKind) -> Command:
    return Command(id=3, run_number=7, kind=kind, created_at=NOW)


def timed(p99: float, samples: int = 50, **kw: object) -> AttemptObs:
    """Every rank stuck at step 50 since NOW - 100, heard this tick (its heartbeats flow)."""
    ranks = tuple(rank(i, progress_at=NOW - 100, last_seen_at=NOW) for i in range(4))
    return obs(*ranks, step_time_p99_s=p99, step_time_samples=samples, **kw)


def hang_after(p99: float, samples: int = 50, **policy: object) -> float:
    """The smallest idle time, in seconds, judged a hang (to 0.5 s)."""
    r = run(policy=replace(run().policy, hang_timeout_s=60.0, **policy))  # type: ignore[arg-type]
    live = attempt(started_at=NOW - 1000, first_step_at=NOW - 900)
    for idle in [x / 2 for x in range(1, 400)]:
        o = timed(p99, samples)
        o = replace(o, ranks=tuple(replace(x, progress_at=NOW - idle) for x in o.ranks))
        if of(decide(view(run(RunState.RUNNING, policy=r.policy), (live,)), o, NOW), RecordFault):
            return idle
    return float("inf")


def fault_of(a: int, kind: FaultKind = FaultKind.RANK_EXIT, step: int = 25) -> FaultRecord:
    return FaultRecord(id=a, run_number=7, attempt=a, kind=kind, ranks=(1,), nodes=("n1",), step=step,
                       summary="x", detected_at=NOW - 100 + a, recovered_at=None)


def ended(i: int, resume: int = 20, nodes: tuple[str, ...] = ("n1", "n2")) -> Attempt:
    return attempt(i, AttemptState.ENDED, outcome=AttemptOutcome.FAILED, resume_step=resume, nodes=nodes,
                   ended_at=NOW - 1000)


def samples(losses: list[float], grads: list[float] | None = None, batch: int = 16) -> tuple[StepSample, ...]:
    grads = grads or [1.0] * len(losses)
    return tuple(StepSample(step=i + 1, loss=x, grad_norm=g, first_sample=i * batch)
                 for i, (x, g) in enumerate(zip(losses, grads, strict=True)))


def spiky(at: int, length: int, total: int = 60) -> list[float]:
    return [10.0 if at <= i + 1 < at + length else 2.0 - 0.001 * i for i in range(total)]


def one_node_attempt(*ranks: RankObs, held: bool = True) -> tuple[RunView, AttemptObs]:
    """A run of one node (n1, 2 ranks) and no spare; ``held``: the allocation still holds
    n1 (False: the cluster ended the allocation, as Slurm does once it sees n1 down)."""
    r = run(nodes=1, spares=0)
    alloc = (Node(name="n1", state=NodeState.ALLOCATED if held else NodeState.IDLE,
                  run_number=7 if held else None),)
    return view(r, (attempt(nodes=("n1",)),), alloc), obs(*ranks)

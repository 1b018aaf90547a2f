"""A large pre-training job under the supervisor's real policy: a discrete-event simulation.

    python bench/simulate.py --nodes 2048 [--spares 16] [--days 54] [--seed 1] [--compare]

The job trains on ``--nodes`` nodes (8 accelerators each) and holds ``--spares`` hot
spares. Interruptions arrive as a Poisson process at Llama 3's rate (419 in 54 days on
2,048 nodes: supervisor/planning.py), on a node picked at random from those training;
78 % are hardware (the node is lost: all its processes vanish, as with kill-node) and
the rest software (one process exits 1, as with kill-rank). At every event the
simulation builds the RunView and AttemptObs the reconciler would, calls the real
``supervisor.policy.decide`` and carries out its effects: it is the policy, not a model
of it, that detects, drains, restarts, backs off and decides when to give up.

The policy is the default one (``Policy()``, no override): the budget for failures
without progress, the crash-loop and fault-rate rules, backoff and lemons as a
submitted run gets them. Every other input is a parameter, and the JSON names each
one's source ("inputs"): measured on this machine (docs/RESULTS.md), published (Llama 3's
failure rate and hardware share), or assumed. The defaults:

- detection: hardware faults are found by silence (10 s, ``silence_timeout_s``; measured
  10.04 s for a frozen node), software crashes by the exit (1 s; measured 0.3 s for a
  SIGKILLed rank, taken higher for larger jobs) - measured;
- stop: 2 s for the other processes to go after SIGKILL (measured under 1 s) - assumed;
- restart, from the launch to the first step: 10.3 s measured for 4 ranks (the cold
  start), plus 0.01 s per node for rendezvous and communicator set-up at scale (20 s at
  2,048 nodes; assumed), plus the checkpoint load, taken as the save time (assumed);
- checkpoint save: blocking, ``--checkpoint-s`` (default 30 s: a 70B model's ~1 TB of
  weights and optimizer state at ~35 GB/s to shared storage) - assumed;
- a node lost with no spare left: a new allocation after ``--queue-wait-s`` (1,800 s);
  a drained node is back as a spare after ``--repair-s`` (one day) - assumed.

With ``--tiers`` the job has the supervisor's two checkpoint tiers (trainer/memory_tier.py):

- a memory save every ``--memory-every-s`` (default: Young/Daly of its cost) that blocks
  ``--memory-checkpoint-s``: the copy of a rank's shards to host memory. Scaled from this
  machine: the copy rate measured by bench/checkpoint_tiers.py (``--copy-gb-s``), applied
  to a rank's share of a 70B model's state (16 bytes a parameter: bf16 weights and
  gradients are not saved, fp32 master weights and two AdamW moments are, 12 bytes, plus
  margin) over 2,048 x 8 ranks: 68 MB a rank;
- a persistent save every ``--persistent-every-s`` (30 min, assumed) beside training,
  blocking for the same copy; its write (30 s at the rates above) ends long before the
  next one, so it is taken as durable at once;
- after a fault the real policy decides (``RunView.newest_memory``): a lost node's state
  is on the next node, so the next attempt resumes from memory, with a warm restart
  (``--warm-restart-s``: 1.9 s measured with standbys for 4 ranks, plus the rendezvous
  at scale as above, plus the replica transfer at the copy rate); when it cannot, from
  the persistent save, cold.

With ``--from-gpu FILE`` (the JSON of bench/gpu_recovery.py: the supervisor and its
trainer on a real GPU) the tiers' costs are that run's measurements instead, each scaled
by the state a GPU holds here over the one it held there (its ``state_bytes_per_rank``:
18 GB for llama3.2-1b on one GPU against 68 MB a rank here, a factor of 0.0038): the
blocking of a memory save and of a persistent save (medians), the restore in a warm
restart (the memory tier's) and in a cold one (the persistent tier's), and around the
restores what the recoveries took besides (SIGKILL to the first resumed step, less the
detection and the restore: the launch, the standby's or a cold start, the first step),
unscaled, plus the rendezvous at scale. The JSON says which run each came from.

Faults strike only while the job trains (none during restarts), a slight underestimate.
It prints one JSON object: ETTR (useful training time over wall time) and where the rest
went, the failures, and the Young/Daly checkpoint interval (sqrt(2 C MTBF)) next to the
one simulated; ``--compare`` also simulates intervals of 1/4 to 4 times it.
"""

from __future__ import annotations

import argparse
import heapq
import json
import random
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from supervisor import planning  # noqa: E402
from supervisor.domain import (  # noqa: E402
    AllocateNodes,
    Attempt,
    AttemptObs,
    AttemptState,
    CheckpointRef,
    DrainNode,
    Effect,
    EndAttempt,
    FaultRecord,
    FinishRun,
    MarkAttemptRunning,
    MemoryCheckpointRef,
    Node,
    NodeState,
    Policy,
    ProcState,
    RankObs,
    RecordFault,
    Run,
    RunState,
    RunView,
    SetRunState,
    StartAttempt,
    StopAttempt,
)
from supervisor.policy import decide  # noqa: E402

MEASURED_RESTART_S = 10.3  # the trainer's cold start, 4 ranks (docs/RESULTS.md, bench/mttr.py)
RENDEZVOUS_S_PER_NODE = 0.01
MEASURED_WARM_RESTART_S = 1.9  # warm standby, fault to first step, 4 ranks (docs/RESULTS.md)
STATE_BYTES_PER_RANK = 70e9 * 16 / (2048 * 8)  # a 70B model's saved state on 16,384 ranks
MIN_BLOCKING_S = 0.01  # the least a save is taken to cost when choosing its interval


@dataclass(frozen=True, slots=True)
class Params:
    nodes: int
    spares: int
    days: float
    seed: int
    rate_per_node_s: float
    hardware_share: float
    checkpoint_s: float
    checkpoint_every_s: float
    detect_hw_s: float
    detect_sw_s: float
    stop_s: float
    restart_s: float
    queue_wait_s: float
    repair_s: float
    # The memory tier (--tiers); memory_every_s 0: none, checkpoint_* is the persistent save.
    memory_every_s: float = 0.0
    memory_checkpoint_s: float = 0.0
    persistent_every_s: float = 0.0
    warm_restart_s: float = 0.0

    @property
    def every_s(self) -> float:
        """Training seconds between the saves the segment's work is kept by."""
        return self.memory_every_s or self.checkpoint_every_s

    @property
    def pause_s(self) -> float:
        """Blocking per such interval (with tiers: the memory save and the persistent
        saves' share)."""
        if not self.memory_every_s:
            return self.checkpoint_s
        return self.memory_checkpoint_s + self.checkpoint_s * self.memory_every_s / self.persistent_every_s


@dataclass(slots=True)
class Account:
    useful: float = 0.0
    checkpoint: float = 0.0
    lost_work: float = 0.0
    detection: float = 0.0
    stop: float = 0.0
    restart: float = 0.0
    waiting_for_nodes: float = 0.0
    lost_work_at_end: float = 0.0  # of the segment ended last


@dataclass(slots=True)
class Sim:
    p: Params
    rng: random.Random
    run: Run
    attempts: list[Attempt] = field(default_factory=list)
    nodes: dict[str, Node] = field(default_factory=dict)
    faults: list[FaultRecord] = field(default_factory=list)
    events: list[tuple[float, int, str, object]] = field(default_factory=list)
    seq: int = 0
    work: float = 0.0  # useful training seconds kept in the newest checkpoint (of any tier)
    persistent: float = 0.0  # ... in the newest persistent one
    memory_by: int = 0  # the attempt whose memory save holds ``work``
    segment: tuple[float, float] | None = None  # (wall time of the first step, work then)
    waiting_since: float | None = None
    mode: str = "restart"  # where wall time goes now: an Account field, or "training"
    fault_step: int = 0  # the step the last fault struck at
    acct: Account = field(default_factory=Account)
    hw: int = 0
    sw: int = 0
    decide_calls: int = 0
    memory_resumes: int = 0

    # --- events ---------------------------------------------------------------------

    def at(self, t: float, kind: str, data: object = None) -> None:
        self.seq += 1
        heapq.heappush(self.events, (t, self.seq, kind, data))

    def live(self) -> Attempt | None:
        a = self.attempts[-1] if self.attempts else None
        return a if a is not None and a.state is not AttemptState.ENDED else None

    def view(self) -> RunView:
        ck = (CheckpointRef(step=int(self.persistent), path=f"ckpt-{int(self.persistent)}")
              if self.persistent else None)
        memory = None
        if self.p.memory_every_s and self.work > self.persistent and self.memory_by:
            saver = self.attempts[self.memory_by - 1]
            memory = MemoryCheckpointRef(attempt=saver.number, step=int(self.work), nodes=saver.nodes)
        return RunView(run=self.run, attempts=tuple(self.attempts), allocation=tuple(self.nodes.values()),
                       newest_checkpoint=ck, newest_memory=memory, faults=tuple(self.faults[-50:]))

    def obs(self, t: float, dead: str | None = None, exit_code: int = -9, gone: bool = False,
            step: int | None = None) -> AttemptObs:
        a = self.live()
        assert a is not None
        if step is None:
            step = int(self.work_at(t)) if self.segment else max(a.resume_step, self.fault_step)
        ranks = []
        for i, node in enumerate(a.nodes):
            if gone or node == dead:
                code = exit_code if node == dead else -9
                ranks.append(RankObs(rank=i, node=node, proc=ProcState.EXITED, exit_code=code,
                                     dead_since=t - 1, last_step=step, progress_at=t, last_seen_at=t))
            else:
                ranks.append(RankObs(rank=i, node=node, proc=ProcState.RUNNING, last_step=step, progress_at=t,
                                     last_seen_at=t, phase="train"))
        return AttemptObs(ranks=tuple(ranks), telemetry_up_since=0.0)

    def decide(self, t: float, obs: AttemptObs | None) -> None:
        self.decide_calls += 1
        for e in decide(self.view(), obs, t):
            self.apply(e, t)

    # --- effects --------------------------------------------------------------------

    def apply(self, e: Effect, t: float) -> None:
        match e:
            case SetRunState():
                self.run = replace(self.run, state=e.state)
            case FinishRun():
                self.run = replace(self.run, state=e.state, reason=e.reason)
            case StartAttempt():
                self.attempts.append(Attempt(
                    run_number=1, number=e.number, state=AttemptState.RUNNING, nodes=e.nodes,
                    resume_from=e.resume_from, resume_step=e.resume_step, created_at=t, started_at=t,
                    launch_info="sim"))
                warm = (e.resume_from or "").startswith("memory:")
                if not warm and self.work > self.persistent:  # memory lost: back to the persistent save
                    self.acct.useful -= self.work - self.persistent
                    self.acct.lost_work += self.work - self.persistent
                    self.work = self.persistent
                self.memory_resumes += warm
                self.at(t + (self.p.warm_restart_s if warm else self.p.restart_s), "first-step", e.number)
            case MarkAttemptRunning():
                self.attempts[-1] = replace(self.attempts[-1], first_step_at=t)
            case RecordFault():
                self.faults.append(FaultRecord(id=len(self.faults) + 1, run_number=1, attempt=e.attempt,
                                               kind=e.kind, ranks=e.ranks, nodes=e.nodes, step=e.step,
                                               summary=e.summary, detected_at=t, recovered_at=None))
            case StopAttempt():
                self.attempts[-1] = replace(self.attempts[-1], state=AttemptState.STOPPING, outcome=e.outcome,
                                            reason=e.reason, stop_requested_at=t)
                self.at(t + self.p.stop_s, "gone", self.attempts[-1].number)
            case EndAttempt():
                self.attempts[-1] = replace(self.attempts[-1], state=AttemptState.ENDED, outcome=e.outcome,
                                            ended_at=t, final_step=e.final_step)
            case DrainNode():
                self.nodes[e.node] = replace(self.nodes[e.node], state=NodeState.DRAINED, reason=e.reason)
                self.at(t + self.p.repair_s, "repaired", e.node)
            case AllocateNodes():
                if self.waiting_since is None:
                    self.waiting_since = t
                    self.at(t + self.p.queue_wait_s, "allocated", e.count)
            case _:
                pass

    # --- training progress ----------------------------------------------------------

    def work_at(self, t: float) -> float:
        """Work done by wall time ``t`` in the current segment (checkpoint pauses excluded)."""
        assert self.segment is not None
        first, w0 = self.segment
        cycle = self.p.every_s + self.p.pause_s
        k, rem = divmod(max(0.0, t - first), cycle)
        return w0 + k * self.p.every_s + min(rem, self.p.every_s)

    def end_segment(self, t: float) -> None:
        """The attempt stops training at ``t``: keep the work up to its newest checkpoint."""
        assert self.segment is not None
        first, w0 = self.segment
        cycle = self.p.every_s + self.p.pause_s
        k, rem = divmod(max(0.0, t - first), cycle)
        kept = w0 + k * self.p.every_s
        done = self.work_at(t)
        self.acct.useful += kept - w0
        self.acct.lost_work += done - kept
        self.acct.lost_work_at_end = done - kept
        self.acct.checkpoint += k * self.p.pause_s + max(0.0, rem - self.p.every_s)
        self.work = kept
        if k > 0:
            self.memory_by = self.attempts[-1].number
        if self.p.memory_every_s:  # persistent saves at whole multiples of their interval
            every = self.p.persistent_every_s
            self.persistent = max(self.persistent, min(kept, (done // every) * every))
        else:  # the one tier: every save is persistent
            self.persistent = kept
        self.segment = None

    # --- the loop -------------------------------------------------------------------

    def run_sim(self) -> None:
        end = self.p.days * 86_400.0
        for i in range(self.p.nodes + self.p.spares):
            self.nodes[f"n{i:05d}"] = Node(name=f"n{i:05d}", state=NodeState.ALLOCATED, run_number=1)
        self.decide(0.0, None)
        last = 0.0
        while self.events and self.run.state not in (RunState.FAILED, RunState.SUCCEEDED):
            t, _, kind, data = heapq.heappop(self.events)
            if t > end:
                break
            self.charge(t - last)
            last = t
            getattr(self, f"on_{kind.replace('-', '_')}")(t, data)
        if self.segment is not None:
            self.end_segment(end)
            self.acct.useful += self.acct.lost_work_at_end  # the run goes on: that work is not lost
            self.acct.lost_work -= self.acct.lost_work_at_end
        else:
            self.charge(end - last)

    def charge(self, dt: float) -> None:
        if self.mode != "training":  # training time is split when its segment ends
            setattr(self.acct, self.mode, getattr(self.acct, self.mode) + dt)

    def next_fault(self, t: float) -> None:
        rate = self.p.rate_per_node_s * self.p.nodes
        self.at(t + self.rng.expovariate(rate), "fault", self.attempts[-1].number)

    def on_first_step(self, t: float, number: int) -> None:
        a = self.live()
        if a is None or a.number != number or a.state is not AttemptState.RUNNING:
            return
        self.decide(t, self.obs(t, step=a.resume_step + 1))
        self.segment = (t, self.work)
        self.mode = "training"
        self.next_fault(t)

    def on_fault(self, t: float, number: int) -> None:
        a = self.live()
        if a is None or a.number != number or self.segment is None:
            return
        node = self.rng.choice(a.nodes)
        hardware = self.rng.random() < self.p.hardware_share
        self.hw += hardware
        self.sw += not hardware
        self.fault_step = int(self.work_at(t))
        self.end_segment(t)
        self.mode = "detection"
        delay = self.p.detect_hw_s if hardware else self.p.detect_sw_s
        self.at(t + delay, "detected", (number, node, hardware))

    def on_detected(self, t: float, data: tuple[int, str, bool]) -> None:
        number, node, hardware = data
        a = self.live()
        if a is None or a.number != number:
            return
        self.decide(t, self.obs(t, dead=node, exit_code=-9 if hardware else 1))
        self.mode = "stop"

    def on_gone(self, t: float, number: int) -> None:
        a = self.live()
        if a is None or a.number != number:
            return
        self.decide(t, self.obs(t, gone=True))
        self.mode = "waiting_for_nodes" if self.waiting_since is not None else "restart"
        self.poke_if_idle(t)

    def on_allocated(self, t: float, count: int) -> None:
        self.waiting_since = None
        k = len(self.nodes)
        for i in range(count):
            name = f"n{k + i:05d}"
            self.nodes[name] = Node(name=name, state=NodeState.ALLOCATED, run_number=1)
        self.decide(t, None)
        self.mode = "waiting_for_nodes" if self.waiting_since is not None else "restart"
        self.poke_if_idle(t)

    def on_repaired(self, t: float, node: str) -> None:
        self.nodes[node] = replace(self.nodes[node], state=NodeState.ALLOCATED, reason="")

    def on_poke(self, t: float, _: object) -> None:
        if self.live() is None:
            self.decide(t, None)
            if self.waiting_since is not None:
                self.mode = "waiting_for_nodes"
            self.poke_if_idle(t)

    def poke_if_idle(self, t: float) -> None:
        """No attempt live and none coming (a backoff): ask the policy again shortly."""
        if self.live() is None and self.waiting_since is None and self.run.state not in (
                RunState.FAILED, RunState.SUCCEEDED):
            self.at(t + 1.0, "poke")


def simulate(p: Params) -> dict[str, object]:
    policy = Policy()  # as a submitted run gets it: no override
    run = Run(number=1, name="sim", state=RunState.PENDING, reason="", nodes=p.nodes, ranks_per_node=1,
              spares=p.spares, total_steps=10**15, policy=policy, created_at=0.0)
    sim = Sim(p=p, rng=random.Random(p.seed), run=run)
    sim.run_sim()
    wall = p.days * 86_400.0
    a = sim.acct
    parts = {"useful": a.useful, "checkpoint": a.checkpoint, "lost_work": a.lost_work,
             "detection": a.detection, "stop": a.stop, "restart": a.restart,
             "waiting_for_nodes": a.waiting_for_nodes}
    return {
        "ettr": round(a.useful / wall, 4),
        "breakdown": {k: round(v / wall, 4) for k, v in parts.items()},
        "breakdown_hours": {k: round(v / 3600, 1) for k, v in parts.items()},
        "accounted": round(sum(parts.values()) / wall, 4),
        "failures": {"hardware": sim.hw, "software": sim.sw},
        "attempts": len(sim.attempts),
        "resumed_from_memory": sim.memory_resumes,
        "drained_nodes": sum(1 for n in sim.nodes.values() if n.state is NodeState.DRAINED),
        "run_state": sim.run.state.value, "run_reason": sim.run.reason,
        "policy_decisions": sim.decide_calls,
    }


def _inputs(args: argparse.Namespace, gpu: GpuCosts | None) -> dict[str, str]:
    """Where each input comes from: measured here, published, or assumed (the defaults;
    a value given on the command line is the caller's)."""
    given = {a.split("=")[0].lstrip("-").replace("-", "_") for a in sys.argv[1:] if a.startswith("--")}
    sources = {
        "failures_per_node_day": "published: Llama 3, 419 interruptions in 54 days on 2,048 nodes",
        "hardware_share": "published: Llama 3, 78 % of interruptions were hardware",
        "detect_hw_s": "measured: a frozen node found by silence in 10.04 s (bench/mttr.py)",
        "detect_sw_s": "measured: a killed rank found in 0.3 s (bench/mttr.py), taken as 1 s at scale",
        "restart_s": f"measured: the cold start, {MEASURED_RESTART_S} s for 4 ranks (bench/mttr.py); "
                     f"assumed: {RENDEZVOUS_S_PER_NODE} s per node of rendezvous, the checkpoint load at "
                     "save speed",
        "stop_s": "assumed (measured under 1 s for 4 ranks)",
        "checkpoint_s": "assumed: ~1 TB of a 70B model's state at ~35 GB/s",
        "checkpoint_every_s": "the Young/Daly interval of the above",
        "queue_wait_s": "assumed",
        "repair_s": "assumed",
        "policy": "the default Policy(), no override",
    }
    if args.tiers:
        sources |= {
            "memory_checkpoint_s": f"scaled: {STATE_BYTES_PER_RANK / 1e6:.0f} MB a rank (70B x 16 bytes over "
                                   "16,384 ranks) at the measured copy rate",
            "persistent_blocking_s": "scaled: the asynchronous persistent save blocks for the same copy; "
                                     "checkpoint_s is its write, and a cold restart's read",
            "memory_every_s": "the Young/Daly interval of the memory save's cost",
            "persistent_every_s": "assumed: 30 minutes",
            "warm_restart_s": f"measured: {MEASURED_WARM_RESTART_S} s with warm standbys for 4 ranks "
                              "(bench/mttr.py); assumed: the rendezvous at scale as for restart_s; the "
                              "replica transfer at the copy rate",
        }
        sources.pop("checkpoint_every_s")
    if gpu is not None:
        sources |= {k: f"{gpu.source}: {what}" for k, what in (
            ("memory_checkpoint_s", "the median blocking of a memory save"),
            ("persistent_blocking_s", "the median blocking of a persistent save"),
            ("warm_restart_s", "kill-rank's SIGKILL to first step less detection, its memory restore scaled; "
                               f"plus {RENDEZVOUS_S_PER_NODE} s per node of rendezvous (assumed)"),
            ("restart_s", "kill-node's SIGKILL to first step less detection, its persistent restore scaled; "
                          f"plus {RENDEZVOUS_S_PER_NODE} s per node of rendezvous (assumed)"))}
    out = {k: ("given on the command line" if k in given else v) for k, v in sources.items()}
    if args.tiers and gpu is None:  # a measurement, and always given
        out["copy_gb_s"] = (f"measured: {args.copy_gb_s} GB/s, a rank's copy of its shards to host memory "
                            "(bench/checkpoint_tiers.py)")
    return out


@dataclass(frozen=True, slots=True)
class GpuCosts:
    """The tiers' costs for a rank of the simulated job, from a bench/gpu_recovery.py run."""

    memory_checkpoint_s: float
    persistent_blocking_s: float
    warm_restart_s: float  # launch to first step, restoring from memory
    restart_s: float  # launch to first step, restoring from the persistent checkpoint
    source: str

    @classmethod
    def from_run(cls, run: dict[str, Any], nodes: int) -> GpuCosts:
        """Scaled by bytes a rank (the module docstring); SystemExit naming what is missing."""
        size = run.get("state_bytes_per_rank") or 0
        if not size:
            raise SystemExit("--from-gpu: the run's JSON has no state_bytes_per_rank")
        scale = STATE_BYTES_PER_RANK / size

        def median(xs: list[float], what: str) -> float:
            if not xs:
                raise SystemExit(f"--from-gpu: the run's JSON has no {what}")
            return float(sorted(xs)[len(xs) // 2])

        saves = run.get("saves", [])
        memory = median([x["blocked_s"] for x in saves if x["tier"] == "memory"], "memory saves")
        persistent = median([x["blocked_s"] for x in saves if x["tier"] == "persistent"], "persistent saves")

        def restart(fault: str, tier: str) -> float:
            recovery = next((r for r in run.get("recoveries", []) if r["kind"] == fault), None)
            restore = next((r for r in run.get("restores", []) if r["tier"] == tier), None)
            if recovery is None or restore is None:
                raise SystemExit(f"--from-gpu: the run's JSON has no {fault} recovery from the {tier} tier")
            around = recovery["kill_to_first_step_s"] - recovery["detect_s"] - restore["seconds"]
            return max(0.0, around) + restore["seconds"] * scale + RENDEZVOUS_S_PER_NODE * nodes

        limits = run.get("limits", {})
        source = (f"measured: bench/gpu_recovery.py on {limits.get('device', '?')} "
                  f"({'GPU' if run.get('gpu') else 'CPU'}), {size / 1e9:.3g} GB of state a rank, "
                  f"scaled by {scale:.4g} to {STATE_BYTES_PER_RANK / 1e6:.0f} MB")
        return cls(memory_checkpoint_s=memory * scale, persistent_blocking_s=persistent * scale,
                   warm_restart_s=restart("rank-exit", "memory"),
                   restart_s=restart("node-lost", "persistent"), source=source)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nodes", type=int, default=2048)
    ap.add_argument("--spares", type=int, default=16)
    ap.add_argument("--days", type=float, default=54.0)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--failures-per-node-day", type=float,
                    default=planning.LLAMA3_RATE_PER_NODE_S * 86_400, help="default: Llama 3's rate")
    ap.add_argument("--hardware-share", type=float, default=planning.LLAMA3_HARDWARE_SHARE)
    ap.add_argument("--checkpoint-s", type=float, default=30.0, help="blocking cost of one checkpoint")
    ap.add_argument("--checkpoint-every-s", type=float, default=None,
                    help="training seconds between checkpoints (default: the Young/Daly interval)")
    ap.add_argument("--detect-hw-s", type=float, default=10.0)
    ap.add_argument("--detect-sw-s", type=float, default=1.0)
    ap.add_argument("--stop-s", type=float, default=2.0)
    ap.add_argument("--restart-s", type=float, default=None,
                    help="launch to first step (default: 10.3 s measured + 0.01 s/node + checkpoint load)")
    ap.add_argument("--queue-wait-s", type=float, default=1800.0)
    ap.add_argument("--repair-s", type=float, default=86_400.0)
    ap.add_argument("--compare", action="store_true", help="also simulate 1/4 to 4 x the Young/Daly interval")
    ap.add_argument("--tiers", action="store_true",
                    help="the memory tier and asynchronous persistent saves, with warm restarts")
    ap.add_argument("--copy-gb-s", type=float, default=None,
                    help="--tiers: a rank's copy rate to host memory, GB/s (from bench/checkpoint_tiers.py)")
    ap.add_argument("--memory-every-s", type=float, default=None, help="--tiers: default Young/Daly")
    ap.add_argument("--persistent-every-s", type=float, default=1800.0)
    ap.add_argument("--warm-restart-s", type=float, default=None)
    ap.add_argument("--from-gpu", type=Path, default=None,
                    help="the tiers' costs from bench/gpu_recovery.py's JSON (implies --tiers)")
    args = ap.parse_args(argv)
    gpu = GpuCosts.from_run(json.loads(args.from_gpu.read_text()), args.nodes) if args.from_gpu else None
    args.tiers = args.tiers or gpu is not None
    if args.tiers and gpu is None and (args.copy_gb_s is None or args.copy_gb_s <= 0):
        ap.error("--tiers needs --copy-gb-s (measured by bench/checkpoint_tiers.py) or --from-gpu")
    if args.nodes < 1 or args.spares < 0 or args.days <= 0 or args.failures_per_node_day <= 0:
        ap.error("--nodes >= 1, --spares >= 0, --days > 0 and --failures-per-node-day > 0")
    rate = args.failures_per_node_day / 86_400
    mtbf = planning.job_mtbf_s(args.nodes, rate)
    young_daly = planning.young_daly_interval_s(args.checkpoint_s, mtbf)
    restart = args.restart_s if args.restart_s is not None else (
        gpu.restart_s if gpu else MEASURED_RESTART_S + RENDEZVOUS_S_PER_NODE * args.nodes + args.checkpoint_s)
    base = Params(nodes=args.nodes, spares=args.spares, days=args.days, seed=args.seed, rate_per_node_s=rate,
                  hardware_share=args.hardware_share, checkpoint_s=args.checkpoint_s,
                  checkpoint_every_s=args.checkpoint_every_s or young_daly, detect_hw_s=args.detect_hw_s,
                  detect_sw_s=args.detect_sw_s, stop_s=args.stop_s, restart_s=restart,
                  queue_wait_s=args.queue_wait_s, repair_s=args.repair_s)
    tiers: dict[str, object] = {}
    if args.tiers:
        # Both tiers block for a copy of a rank's state; --checkpoint-s stays the storage
        # write (and read, in a cold restart's checkpoint load).
        if gpu is not None:
            memory_s, copy_s = gpu.memory_checkpoint_s, gpu.persistent_blocking_s
        else:
            memory_s = copy_s = STATE_BYTES_PER_RANK / (args.copy_gb_s * 1e9)
        # A save that overlaps training (blocking 0) would get a Young/Daly interval of 0.
        memory_every = args.memory_every_s or planning.young_daly_interval_s(max(memory_s, MIN_BLOCKING_S),
                                                                               mtbf)
        warm = args.warm_restart_s if args.warm_restart_s is not None else (
            gpu.warm_restart_s if gpu
            else MEASURED_WARM_RESTART_S + RENDEZVOUS_S_PER_NODE * args.nodes + copy_s)
        base = replace(base, memory_every_s=memory_every, memory_checkpoint_s=memory_s, checkpoint_s=copy_s,
                       persistent_every_s=args.persistent_every_s, warm_restart_s=warm,
                       checkpoint_every_s=args.persistent_every_s)
        tiers = {"copy_gb_s": args.copy_gb_s, "from_gpu": str(args.from_gpu) if gpu else None,
                 "memory_checkpoint_s": round(memory_s, 4),
                 "persistent_blocking_s": round(copy_s, 4),
                 "memory_every_s": round(memory_every, 1), "persistent_every_s": args.persistent_every_s,
                 "warm_restart_s": round(warm, 2)}
    began = time.perf_counter()
    result: dict[str, object] = {
        "nodes": args.nodes, "spares": args.spares, "days": args.days, "seed": args.seed,
        "failures_per_node_day": round(args.failures_per_node_day, 6),
        "job_mtbf_h": round(mtbf / 3600, 2), "checkpoint_s": args.checkpoint_s,
        "restart_s": round(restart, 1),
        **tiers,
        "inputs": _inputs(args, gpu),
        "checkpoint_every_s": round(base.checkpoint_every_s, 1),
        "young_daly_every_s": round(young_daly, 1),
        **simulate(base),
    }
    if args.compare:
        result["compare"] = [
            {"checkpoint_every_s": round(young_daly * f, 1), "factor": f,
             "ettr": simulate(replace(base, checkpoint_every_s=young_daly * f))["ettr"]}
            for f in (0.25, 0.5, 1.0, 2.0, 4.0)]
    result["sim_wall_s"] = round(time.perf_counter() - began, 2)
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

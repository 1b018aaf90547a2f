"""Fault injection for demos and tests: ``--chaos KIND@STEP[:TARGET]``.

    kill-rank@50      SIGKILL one rank (the highest rank, or rank TARGET) when the run
                      reaches step 50
    kill-node@90      SIGKILL every process of one node (the last node of the attempt, or
                      the node at index TARGET) at step 90; on a Slurm box, its slurmd too
    freeze-node@90    SIGSTOP every process of one node: a node that hangs hard or loses
                      its network, found only by its silence
    partition-node@90[:TARGET][/SECONDS]
                      take one node's network link down for SECONDS (20), then up again:
                      its processes live on, cut off (a Slurm box only)
    partition-all@90[/SECONDS]
                      every node of the attempt cut off for SECONDS (30) at once: the
                      network, not the nodes (a Slurm box only)
    slow-link@20[:TARGET]
                      slow one node's link (the last node, or the node at index TARGET) to
                      4 Mbit/s both ways for the rest of the run: every collective waits
                      for it, nothing fails (a Slurm box only)
    hang-rank@40      SIGSTOP one rank (the highest, or rank TARGET): the others wait for it
                      in the next collective, and no rank makes progress (a hang)
    corrupt-ckpt@50   flip 16 bytes in the middle of the largest shard of the newest
                      complete checkpoint, its size unchanged (silent corruption on
                      storage): it still looks complete and DCP would load it; the
                      trainer's check against the checkpoint's manifest finds out (exit
                      code 3). Pair it with a fault at the same step to make the next
                      attempt resume from it

Trainer-side faults go to the reference trainer itself (``TSUP_FAULT``, trainer/faults.py),
in every attempt of the run:

    crash@25[:RANK]   every rank (or rank RANK) raises after step 25, in every attempt
                      that gets there: a crash loop
    nan@60            the loss of step 60 turns NaN (and with it the model), once per run
    spike@60:30       the data of steps 60 to 89 is bad: their loss is 8 x higher, in every
                      attempt that reads that data (until the supervisor skips it)
    device@50[:RANK]  rank RANK's accelerator fails after step 50 (the trainer exits with
                      code 4, "device fault"), once per run
    kill-in-save@40[:RANK]
                      rank RANK (every rank if left out) SIGKILLs itself in the middle of
                      the checkpoint save of step 40, shards written but not committed
    tamper-ckpt@40[:RANK]
                      the checkpoint of step 40 is saved with one weight of rank RANK's
                      (0's) shard changed: it loads, but not as saved. Pair it with a later
                      fault to make the run resume from it: the resumed step's loss differs
    slow@40[:RANK]    from step 40 on, the node of rank RANK (default 0) computes at half
                      speed for the rest of the run: a straggler
    slow-save@10[:MBPS]
                      from step 10 on, every persistent checkpoint save writes at MBPS
                      MB/s per rank (40): slow or busy storage

Each action fires once per run, through the launcher, as real signals to real
processes. The reference trainer holds after the step of one that ends the attempt (up to
5 s, in the first attempt to get there: ``hold@STEP``, trainer/faults.py), so that the
fault lands at its step even when a busy supervisor hears of that step late; a
``[command]`` trainer does not wait.

An action at a later step than one that ends the attempt (a kill, a freeze, a hang)
waits for the next attempt: with ``kill-rank@45 kill-node@48`` the node dies at step 48
of the attempt that resumed, even when the supervisor first hears of steps 45 and 48 in
one poll. The injector tells the reconciler nothing: the supervisor must detect the fault
on its own. It records a ``chaos.injected`` event so that a reader (and the tests) can
compare detection times with the moment of injection.
"""

from __future__ import annotations

import logging
import os
import re
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from supervisor.domain import AttemptState, EventKind, run_id_of
from supervisor.errors import LaunchError, SpecError
from supervisor.launchers.base import ChaosHooks
from supervisor.reconciler import Reconciler
from supervisor.runfiles import checkpoint_scan
from supervisor.store import SqlStore
from supervisor.telemetry.view import TelemetryView

log = logging.getLogger(__name__)

_KINDS = ("kill-rank|kill-node|freeze-node|partition-node|partition-all|slow-link|hang-rank|corrupt-ckpt|"
          "crash|nan|spike|slow-save|slow|device|kill-in-save|tamper-ckpt")
_SYNTAX = re.compile(rf"^({_KINDS})@([0-9]+)(?::([0-9]+))?(?:/([0-9]+))?$")
ChaosKind = Literal["kill-rank", "kill-node", "freeze-node", "partition-node", "partition-all", "slow-link",
                    "hang-rank",
                    "corrupt-ckpt", "crash", "nan", "spike", "slow", "device", "kill-in-save", "tamper-ckpt",
                    "slow-save"]
PARTITION_S = {"partition-node": 20, "partition-all": 30}  # how long a cut lasts unless /SECONDS says
# Injected by the trainer itself, not by signals from outside.
TRAINER_KINDS = frozenset({"crash", "nan", "spike", "slow", "device", "kill-in-save", "tamper-ckpt",
                           "slow-save"})
# Faults that end the attempt they hit: a later action waits for the attempt after it.
ENDS_ATTEMPT = frozenset({"kill-rank", "kill-node", "freeze-node", "hang-rank"})


@dataclass(frozen=True, slots=True, kw_only=True)
class ChaosAction:
    kind: ChaosKind
    step: int
    target: int | None = None
    seconds: int | None = None  # partition-*: how long the cut lasts

    def __str__(self) -> str:
        suffix = f":{self.target}" if self.target is not None else ""
        lasting = f"/{self.seconds}" if self.seconds is not None else ""
        return f"{self.kind}@{self.step}{suffix}{lasting}"


def parse_chaos(text: str) -> ChaosAction:
    m = _SYNTAX.match(text.strip())
    if m is None:
        raise SpecError(
            f"--chaos {text!r}: expected KIND@STEP[:TARGET][/SECONDS] with KIND kill-rank, kill-node, "
            "freeze-node, partition-node, partition-all, slow-link, hang-rank, corrupt-ckpt, crash, nan, "
            "spike, slow, slow-save, device, kill-in-save or tamper-ckpt, for example kill-rank@50"
        )
    kind: ChaosKind = m.group(1)  # type: ignore[assignment]
    step = int(m.group(2))
    if step <= 0:
        raise SpecError(f"--chaos {text!r}: STEP must be positive")
    seconds = int(m.group(4)) if m.group(4) else None
    if seconds is not None and kind not in PARTITION_S:
        raise SpecError(f"--chaos {text!r}: /SECONDS is for partition-node and partition-all only")
    if kind == "partition-all" and m.group(3):
        raise SpecError(f"--chaos {text!r}: partition-all cuts every node; it takes no TARGET")
    return ChaosAction(kind=kind, step=step, target=int(m.group(3)) if m.group(3) else None,
                       seconds=PARTITION_S[kind] if kind in PARTITION_S and seconds is None else seconds)


def trainer_faults(actions: list[ChaosAction]) -> list[str]:
    """What the reference trainer is told of ``actions`` (TSUP_FAULT): the faults it
    injects itself, and a ``hold`` at the step of each that ends the attempt from outside."""
    holds = sorted({a.step for a in actions if a.kind in ENDS_ATTEMPT})
    return [str(a) for a in actions if a.kind in TRAINER_KINDS] + [f"hold@{step}" for step in holds]


class ChaosMonkey:
    def __init__(
        self, actions: list[ChaosAction], run_number: int, store: SqlStore, hooks: ChaosHooks | None,
        telemetry: TelemetryView, reconciler: Reconciler, checkpoint_dir: Path | None = None,
    ) -> None:
        self.pending = sorted(actions, key=lambda a: a.step)
        self.run_number = run_number
        self.store = store
        self.hooks = hooks
        self.telemetry = telemetry
        self.reconciler = reconciler
        self.checkpoint_dir = checkpoint_dir
        self.heals: list[tuple[float, str]] = []  # (time.monotonic() when due, node) of cut links
        self.throttled: list[str] = []  # nodes whose links slow-link slowed, until the run ends
        self.ended: tuple[int, int] | None = None  # (attempt, step) of the last fault that ends its attempt

    def poll(self) -> None:
        self._heal_when_due()
        if not self.pending:
            return
        with self.store.tx() as tx:
            attempts = tx.list_attempts(self.run_number)
        live = attempts[-1] if attempts else None
        if live is None or live.state is not AttemptState.RUNNING or live.launch_info is None:
            return
        if live.precompile is not None:
            return  # a drill's faults go into training, not the job's precompile pass
        step = self.telemetry.max_step(run_id_of(self.run_number), live.number)
        while self.pending and self.pending[0].step <= step and not self._waits_for_next_attempt(
                self.pending[0], live.number):
            action = self.pending.pop(0)
            try:
                if action.kind == "corrupt-ckpt":
                    what = self._corrupt_newest_checkpoint()
                elif self.hooks is None:
                    raise LaunchError("no chaos hooks on this cluster")
                elif action.kind in ("kill-rank", "hang-rank"):
                    world = len(live.nodes) * _ranks_per_node(self.store, self.run_number)
                    rank = action.target if action.target is not None else world - 1
                    sig = signal.SIGKILL if action.kind == "kill-rank" else signal.SIGSTOP
                    what = self.hooks.kill_rank(live.launch_info, rank, sig)
                elif action.kind in PARTITION_S:
                    what = self._partition(action, live.nodes)
                elif action.kind == "slow-link":
                    node = _target_node(action, live.nodes)
                    what = self.hooks.throttle_node(node, slow=True)
                    self.throttled.append(node)
                else:
                    node = _target_node(action, live.nodes)
                    what = (self.hooks.kill_node(live.launch_info, node) if action.kind == "kill-node"
                            else self.hooks.freeze_node(live.launch_info, node))
            except (LaunchError, IndexError, OSError) as e:
                log.warning("chaos %s not injected: %s", action, e)
                continue
            if action.kind in ENDS_ATTEMPT:
                self.ended = (live.number, action.step)
            self.reconciler.post_event(
                self.run_number, EventKind.CHAOS_INJECTED, f"chaos {action} at step {step}: {what}",
                {"action": str(action), "step": step, "attempt": live.number},
            )

    def _waits_for_next_attempt(self, action: ChaosAction, attempt: int) -> bool:
        if self.ended is None:
            return False
        ended_attempt, ended_step = self.ended
        return attempt == ended_attempt and action.step > ended_step

    def _partition(self, action: ChaosAction, nodes: tuple[str, ...]) -> str:
        assert self.hooks is not None and action.seconds is not None
        cut = list(nodes) if action.kind == "partition-all" else [_target_node(action, nodes)]
        said = [self.hooks.partition_node(node, cut=True) for node in cut]
        self.heals += [(time.monotonic() + action.seconds, node) for node in cut]
        return f"{'; '.join(said)}; healed in {action.seconds} s"

    def _heal_when_due(self) -> None:
        due = [node for at, node in self.heals if at <= time.monotonic()]
        if not due or self.hooks is None:
            return
        self.heals = [(at, node) for at, node in self.heals if node not in due]
        for node in due:
            try:
                said = self.hooks.partition_node(node, cut=False)
            except LaunchError as e:
                log.warning("chaos: cannot heal %s: %s", node, e)
                continue
            self.reconciler.post_event(self.run_number, EventKind.CHAOS_HEALED, f"chaos: {said}",
                                       {"node": node})

    def heal_all(self) -> None:
        """Bring back every link still cut (the run ended before its heal was due), and
        every slowed link to its speed."""
        self.heals = [(0.0, node) for _, node in self.heals]
        self._heal_when_due()
        for node in self.throttled:
            try:
                if self.hooks is not None:
                    self.hooks.throttle_node(node, slow=False)
            except LaunchError as e:
                log.warning("chaos: cannot give %s its speed back: %s", node, e)
        self.throttled = []

    def _corrupt_newest_checkpoint(self) -> str:
        newest, _ = checkpoint_scan.pick(self.checkpoint_dir) if self.checkpoint_dir else (None, [])
        if newest is None:
            raise LaunchError(f"no complete checkpoint in {self.checkpoint_dir} to corrupt")
        shard = max(newest.path.glob("*.distcp"), key=lambda p: p.stat().st_size, default=None)
        if shard is None:
            raise LaunchError(f"{newest.path} holds no shard file")
        with open(shard, "r+b") as f:
            middle = os.fstat(f.fileno()).st_size // 2
            f.seek(middle)
            flipped = bytes(b ^ 0xFF for b in f.read(16))
            f.seek(middle)
            f.write(flipped)
        return f"flipped {len(flipped)} bytes at offset {middle} of {shard}, its size unchanged"


def _target_node(action: ChaosAction, nodes: tuple[str, ...]) -> str:
    """The node an action hits: the attempt's node at index TARGET, else its last."""
    return nodes[action.target if action.target is not None else len(nodes) - 1]


def _ranks_per_node(store: SqlStore, run_number: int) -> int:
    with store.tx() as tx:
        return tx.get_run(run_number).ranks_per_node

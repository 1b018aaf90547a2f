"""Chaos hooks on a Slurm box: real signals to the processes of a node or a rank.

On a real cluster the supervisor cannot kill a node; on a box every node's slurmd and
what it started run on this host, so ``kill-node`` is a SIGKILL to all of them, as a
power loss would be, ``partition-node`` takes the node's link down, and ``slow-link``
slows it (``tc`` on its veth).
The development entry point (``python -m slurmbox.tsup run --chaos ... --launcher slurm``,
slurmbox/tsup.py) hands these hooks to the product's command, which imports nothing of
the box.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
from pathlib import Path

import psutil

from slurmbox import box as slurm_box
from supervisor.errors import LaunchError

THROTTLE = "4mbit"  # slow-link: a link at 4 Mbit/s, a bad cable or a degraded NIC


class BoxChaos:
    def __init__(self, slurm_conf: str | None) -> None:
        found = slurm_box.load(Path(slurm_conf).parent) if slurm_conf else None
        if found is None:
            raise LaunchError("kill-node, freeze-node and kill-rank on Slurm need a Slurm box on this host "
                              "(scripts/slurm-box)")
        self.box = found

    def kill_node(self, launch_info: str, node: str) -> str:
        """As by a power loss: the node's link goes down first, so that nothing it ran
        says goodbye (no last will fires; its peers' connections hang rather than reset),
        then everything it runs is SIGKILLed."""
        pids = slurm_box.kill_node(self.box, node, power_loss=True)
        if not pids:
            raise LaunchError(f"node {node} runs no process")
        return (f"power lost: {node}'s link down, SIGKILL to its slurmd and every process it started "
                f"({len(pids)} processes)")

    def freeze_node(self, launch_info: str, node: str) -> str:
        pids = slurm_box.signal_node(self.box, node, signal.SIGSTOP)
        if not pids:
            raise LaunchError(f"node {node} runs no process")
        return f"SIGSTOP to {node}'s slurmd and every process it started ({len(pids)} processes)"

    def partition_node(self, node: str, cut: bool) -> str:
        if node not in self.box.nodes:
            raise LaunchError(f"no node {node!r} in the box")
        try:
            (slurm_box.partition_node if cut else slurm_box.heal_node)(self.box, node)
        except RuntimeError as e:
            raise LaunchError(str(e)) from e
        return f"{node}'s link {'down: cut off' if cut else 'up again'} ({self.box.link(node)})"

    def throttle_node(self, node: str, slow: bool) -> str:
        if node not in self.box.nodes:
            raise LaunchError(f"no node {node!r} in the box")
        try:
            if slow:
                slurm_box.throttle_node(self.box, node, THROTTLE)
            else:
                slurm_box.unthrottle_node(self.box, node)
        except RuntimeError as e:
            raise LaunchError(str(e)) from e
        return f"{node}'s link {f'throttled to {THROTTLE} both ways' if slow else 'at full speed again'}"

    def kill_rank(self, launch_info: str, rank: int, sig: int = signal.SIGKILL) -> str:
        """``sig`` to the process of ``rank`` in the attempt's step: the topmost one whose
        RANK it is (the rank wrapper sets it; with launch "node", the node's torchrun sets
        it in its workers), or that runs the standby task that became it, not its own
        children."""
        info = json.loads(launch_info)
        step, task, job = info["step"], None, None
        # A rank made of a standby (supervisor/slurm/standby.py) keeps the environment it
        # was started with, its task's: it is known by that task of its node's step (and
        # in an attempt split over two jobs, of its job's).
        for part in info.get("parts", []):
            if str(rank) in part["tasks"]:
                step, job = part["step"], part.get("job")
                task = part["tasks"][str(rank)] if info.get("warm") else None
        found: dict[int, tuple[int, str | None]] = {}  # pid -> (parent, node)
        for p in psutil.process_iter(["pid", "ppid"]):
            try:
                env = p.environ()
            except psutil.Error:
                continue
            if (env.get("SLURM_STEP_ID") is None or env.get("SLURM_JOB_NAME") != step
                    or (job is not None and env.get("SLURM_JOB_ID") != job)):
                continue
            if (env.get("SLURM_PROCID") == str(task) if task is not None
                    else env.get("RANK") == str(rank) and env.get("TSUP_RUN_ID")):
                found[p.pid] = (p.info["ppid"], env.get("SLURMD_NODENAME"))
        for pid, (parent, node) in found.items():
            if parent not in found:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, sig)
                return f"{signal.Signals(sig).name} to rank {rank} (pid {pid}, node {node})"
        raise LaunchError(f"rank {rank} is not running")

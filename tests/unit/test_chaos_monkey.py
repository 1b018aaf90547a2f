"""When ChaosMonkey fires its actions: in step order, and never two faults in one attempt
when the second was meant for the attempt that recovers from the first."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

from supervisor.chaos import ChaosMonkey, parse_chaos
from supervisor.domain import AttemptState


@dataclass
class Cluster:
    """The store, telemetry, reconciler and hooks a ChaosMonkey talks to, in one fake."""

    attempt: int = 1
    step: int = 0
    precompile: str | None = None  # the live attempt is the job's precompile pass
    fired: list[tuple[int, str]] = field(default_factory=list)  # (attempt, what)

    @contextlib.contextmanager
    def tx(self) -> Iterator[Any]:
        live = SimpleNamespace(number=self.attempt, state=AttemptState.RUNNING, launch_info="job",
                               nodes=("n1", "n2"), precompile=self.precompile)
        yield SimpleNamespace(list_attempts=lambda _run: [live],
                              get_run=lambda _run: SimpleNamespace(ranks_per_node=2))

    def max_step(self, _run_id: str, _attempt: int) -> int:
        return self.step

    def post_event(self, *_args: Any) -> None:
        pass

    def kill_rank(self, _info: str, rank: int, _sig: int = 9) -> str:
        self.fired.append((self.attempt, f"rank {rank}"))
        return "killed"

    def kill_node(self, _info: str, node: str) -> str:
        self.fired.append((self.attempt, f"node {node}"))
        return "killed"


def monkey(cluster: Cluster, *actions: str) -> ChaosMonkey:
    return ChaosMonkey([parse_chaos(a) for a in actions], 1, cluster, cluster, cluster, cluster)  # type: ignore[arg-type]


def test_a_fault_after_one_that_ended_the_attempt_waits_for_the_next_attempt() -> None:
    cluster = Cluster()
    chaos = monkey(cluster, "kill-rank@45:0", "kill-node@48")
    cluster.step = 49  # the supervisor hears of steps 45 and 48 in the same poll
    chaos.poll()
    assert cluster.fired == [(1, "rank 0")]
    chaos.poll()
    assert cluster.fired == [(1, "rank 0")], "the node dies in the attempt that resumed, not this one"
    cluster.attempt, cluster.step = 2, 47
    chaos.poll()
    assert cluster.fired == [(1, "rank 0")]
    cluster.step = 48
    chaos.poll()
    assert cluster.fired == [(1, "rank 0"), (2, "node n2")]


def test_faults_at_the_same_step_fire_together() -> None:
    cluster = Cluster(step=50)
    chaos = monkey(cluster, "kill-rank@50:1", "kill-node@50:0")
    chaos.poll()
    assert cluster.fired == [(1, "rank 1"), (1, "node n1")]


def test_a_drill_waits_out_the_precompile_pass_for_training() -> None:
    """The pass's own steps (its graphs traced) reach the fault's step: still not training."""
    cluster = Cluster(step=5, precompile="f" * 64)
    chaos = monkey(cluster, "kill-rank@3:0")
    chaos.poll()
    assert cluster.fired == []
    cluster.attempt, cluster.step, cluster.precompile = 2, 3, None
    chaos.poll()
    assert cluster.fired == [(2, "rank 0")]


def test_the_console_script_finds_the_slurm_box_of_its_checkout() -> None:
    """`training-supervisor run --launcher slurm --chaos ...` from a checkout after `make
    run`: the installed package finds slurmbox/ beside it, off the path pytest gives."""
    import os
    import subprocess
    import sys

    code = ("from supervisor.chaos import box_hooks\n"
            "try:\n    box_hooks(None)\nexcept Exception as e:\n    print(e)")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "SLURM_CONF")}
    done = subprocess.run([sys.executable, "-c", code], cwd="/", env=env, capture_output=True, text=True,
                          timeout=60, check=True)
    assert "need a Slurm box on this host" in done.stdout, done.stdout + done.stderr
    assert "development Slurm box" not in done.stdout

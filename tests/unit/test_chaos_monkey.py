"""When ChaosMonkey fires its actions: in step order, and never two faults in one attempt
when the second was meant for the attempt that recovers from the first."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from supervisor.chaos import ChaosMonkey, parse_chaos, trainer_faults
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


def test_the_reference_trainer_holds_at_the_step_of_each_fault_that_ends_its_attempt_from_outside() -> None:
    actions = [parse_chaos(c) for c in ("kill-rank@30", "nan@40", "kill-node@75", "freeze-node@75",
                                        "partition-node@50", "corrupt-ckpt@30")]
    assert trainer_faults(actions) == ["nan@40", "hold@30", "hold@75"]
    assert trainer_faults([parse_chaos("partition-all@20")]) == []


def test_a_drill_waits_out_the_precompile_pass_for_training() -> None:
    """The pass's own steps (its graphs traced) reach the fault's step: still not training."""
    cluster = Cluster(step=5, precompile="f" * 64)
    chaos = monkey(cluster, "kill-rank@3:0")
    chaos.poll()
    assert cluster.fired == []
    cluster.attempt, cluster.step, cluster.precompile = 2, 3, None
    chaos.poll()
    assert cluster.fired == [(2, "rank 0")]


def test_only_the_boxs_entry_point_hands_the_product_chaos_hooks_for_slurm(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """`python -m slurmbox.tsup` is the product's command with the box's hooks handed in
    (the product imports nothing of the box); the hooks need a box on this host."""
    from cli import daemon
    from slurmbox import tsup
    from slurmbox.chaos import BoxChaos
    from supervisor.errors import LaunchError

    handed: dict[str, object] = {}
    monkeypatch.setattr(daemon, "main", lambda argv=None, **kw: handed.update(argv=argv, **kw) or 0)
    assert tsup.main(["run", "spec.toml"]) == 0
    assert handed == {"argv": ["run", "spec.toml"], "slurm_chaos": BoxChaos}
    with pytest.raises(LaunchError, match="need a Slurm box on this host"):
        BoxChaos(None)


def test_the_products_command_refuses_node_chaos_on_slurm_before_anything_is_submitted(tmp_path: Path,
                                                                                       capsys: pytest.CaptureFixture[str]) -> None:
    from cli import daemon
    from tests.conftest import REPO

    state = tmp_path / "state"
    code = daemon.main(["run", str(REPO / "examples" / "tiny-llama.toml"), "--launcher", "slurm",
                        "--chaos", "kill-node@5", "--state-dir", str(state)])
    assert code == 2
    assert "only a development Slurm box" in capsys.readouterr().err
    assert not state.exists(), "nothing was submitted, no state made"


"""Warm standbys on Slurm (supervisor/slurm/standby.py), without Slurm: the step a node's
standbys are, and when they may become an attempt. The box runs them for real
(tests/chaos/test_slurm.py)."""

from __future__ import annotations

import sys
from pathlib import Path

from supervisor.launchers.base import LaunchSpec
from supervisor.slurm.requests import StepRequest, standby_srun_argv
from supervisor.slurm.standby import Generation, SlurmStandbys


class _Srun:
    """A node's standby step's srun as the pool sees it: alive until it is not."""

    def __init__(self) -> None:
        self.code: int | None = None
        self.pid = 4242
        self.stdin = None

    def poll(self) -> int | None:
        return self.code


def _spec(tmp_path: Path, nodes: tuple[str, ...], standby_nodes: tuple[str, ...] | None = None) -> LaunchSpec:
    return LaunchSpec(run_id="run-1", attempt=2, nodes=nodes, ranks_per_node=2,
                      argv=(sys.executable, "-m", "trainer", "--config", "c.json", "--resume", "auto"), env={},
                      log_dir=tmp_path / "attempts" / "2", marker="m",
                      standby_nodes=nodes if standby_nodes is None else standby_nodes)


def _waiting(tmp_path: Path, node: str, job: str = "7") -> Generation:
    log = tmp_path / f"srun-{node}.log"
    log.touch()
    return Generation(run_id="run-1", name=f"tsup-x.run-1.s-{node}", job=job, node=node, ranks_per_node=2,
                      proc=_Srun(), log=log, uid=None)  # type: ignore[arg-type]


def test_a_nodes_standbys_are_one_step_of_a_task_per_slot_reading_one_broadcast_line() -> None:
    req = StepRequest(job_id="7", step_name="tsup-x.run-1.s3", nodes=("node3",), ranks_per_node=2,
                      argv=(), log_dir=Path("/runs/run-1/attempts"), extra=("--mem=0",))
    argv = standby_srun_argv(req, "/venv/bin/python", "/runs/run-1")
    assert argv[:1] == ["srun"] and argv[-5:] == ["/venv/bin/python", "-m", "trainer", "--standby", "/runs/run-1"]
    for flag in ("--jobid=7", "--job-name=tsup-x.run-1.s3", "--nodelist=node3", "--nodes=1", "--ntasks=2",
                 "--ntasks-per-node=2", "--overlap", "--input=all", "--output=/runs/run-1/attempts/s3-%t.log",
                 "--mem=0"):
        assert flag in argv, flag


ALL_IN_7 = {f"node{k}": "7" for k in range(1, 5)}
ALL_IN_8 = {f"node{k}": "8" for k in range(1, 5)}


def test_standbys_become_an_attempt_only_all_alive_on_every_one_of_its_nodes_and_only_once(
        tmp_path: Path) -> None:
    pool = SlurmStandbys(commands=None, prefix="tsup-x")  # type: ignore[arg-type]
    gens = {n: _waiting(tmp_path, n) for n in ("node1", "node2", "node3")}
    pool._waiting["run-1"] = dict(gens)
    spec = _spec(tmp_path, ("node1", "node3"))
    assert pool.take(spec, ALL_IN_8, spec.nodes) is None, "another allocation's"
    assert pool.take(spec, {**ALL_IN_7, "node3": "8"}, spec.nodes) is None, "node3 is now a growth job's"
    assert pool.take(_spec(tmp_path, ("node1", "node4")), ALL_IN_7, ("node1", "node4")) is None, "node4 has none"
    # node2 was killed: srun says its tasks ended. An attempt on node1 and node3 does not need them.
    gens["node2"].log.write_text("srun: error: node2: tasks 0-1: Killed\n")
    assert pool.waiting() == {"run-1": {"node1": 2, "node3": 2}}
    assert pool.take(_spec(tmp_path, ("node1", "node2")), ALL_IN_7, ("node1", "node2")) is None
    gens["node3"].log.write_text("srun: error: node3: task 1: Exited with exit code 1\n")
    assert pool.take(spec, ALL_IN_7, spec.nodes) is None, "one of node3's standbys is gone"
    gens["node3"].log.write_text("")
    assert pool.take(spec, ALL_IN_7, spec.nodes) == [gens["node1"], gens["node3"]], "in the attempt's order"
    assert pool.take(spec, ALL_IN_7, spec.nodes) is None, "used once"
    pool._waiting["run-1"] = dict(gens)
    gens["node1"].proc.code = 0  # type: ignore[attr-defined]
    assert pool.take(spec, ALL_IN_7, spec.nodes) is None, "node1's srun ended"
    assert pool.take(_spec(tmp_path, spec.nodes, ()), ALL_IN_7, spec.nodes) is None, "a spec that keeps none"

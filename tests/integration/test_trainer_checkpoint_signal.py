"""SIGUSR1 to one rank of the reference trainer: every rank saves a checkpoint at the
same next step, and training goes on (Slurm sends it ahead of a time limit)."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

from supervisor.domain import ProcState
from supervisor.launchers.base import LaunchSpec
from supervisor.launchers.local import LocalLauncher
from supervisor.runfiles import trainer_cmd
from supervisor.spec import parse_spec
from tests.conftest import wait_for
from trainer.checkpoint_layout import complete_checkpoints


def test_sigusr1_to_one_rank_makes_every_rank_checkpoint_at_the_next_step(tmp_path: Path) -> None:
    spec = parse_spec({"name": "usr1", "trainer": {
        "model": "tiny", "steps": 200, "global_batch_size": 8, "seq_len": 32, "log_every_steps": 1,
        "checkpoint": {"every_steps": 1000, "keep": 5}}})
    config = trainer_cmd.write_attempt_config(spec, tmp_path, 1)
    launcher = LocalLauncher()
    info = launcher.start(LaunchSpec(run_id="run-1", attempt=1, nodes=("local-1",), ranks_per_node=2,
                                     argv=trainer_cmd.trainer_argv(config, None), env={},
                                     log_dir=tmp_path / "logs", marker=str(config)))
    try:
        log0 = tmp_path / "logs" / "rank-0000.local-1.log"
        wait_for(lambda: "step 20/200" in (log0.read_text() if log0.exists() else ""), 120, "step 20")
        rank1 = next(r for r in launcher.observe(info) if r.rank == 1)
        assert rank1.proc is ProcState.RUNNING
        pid = next(r["pid"] for r in json.loads(info)["ranks"] if r["rank"] == 1)
        os.kill(pid, signal.SIGUSR1)  # rank 1, not rank 0 that logs: the ranks must agree

        ranks = wait_for(lambda: (rs := launcher.observe(info)) and all(r.proc is ProcState.EXITED for r in rs)
                         and rs, 180, "the run to finish")
    finally:
        launcher.forget(info)  # the node's own process goes with the attempt
    assert [r.exit_code for r in ranks] == [0, 0], log0.read_text()[-2000:]
    steps = sorted(step for step, _ in complete_checkpoints(tmp_path / "checkpoints"))
    assert len(steps) == 2 and 20 < steps[0] < 200 and steps[1] == 200, steps
    assert f"checkpoint at step {steps[0]} asked for by SIGUSR1" in log0.read_text()

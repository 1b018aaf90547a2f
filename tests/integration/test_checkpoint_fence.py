"""A rank 0 of an earlier attempt, frozen and woken while the next attempt is live, leaves
that attempt's checkpoints alone (issue 26, item 10). A real trainer process is stopped
with SIGSTOP after its first save, the supervisor writes the next attempt's fence, the
live attempt has a save in progress and a newer checkpoint, and SIGCONT wakes the stale
one. Before the fence it cleared the live save's temporary directory and pruned the
newer checkpoint (a trajectory it knew nothing of)."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

from supervisor.domain import ProcState
from supervisor.launchers.base import LaunchSpec
from supervisor.launchers.local import LocalLauncher
from supervisor.runfiles import trainer_cmd, user_tree
from supervisor.spec import parse_spec
from tests.conftest import wait_for
from trainer.checkpoint_layout import live_attempt
from wire.errors import EXIT_DO_NOT_RETRY
from wire.files import FENCE_FILE


def test_a_stale_rank_0_woken_during_the_next_attempt_neither_commits_nor_prunes(tmp_path: Path) -> None:
    spec = parse_spec({"name": "fence", "trainer": {
        "model": "tiny", "steps": 40, "global_batch_size": 4, "seq_len": 32, "log_every_steps": 1,
        "checkpoint": {"every_steps": 10, "keep": 5, "asynchronous": False}}})
    config = trainer_cmd.write_attempt_config(spec, tmp_path, 1)
    trainer_cmd.write_fence(spec, tmp_path, 1, user_tree.LOCAL)  # what the supervisor writes before attempt 1
    ck = tmp_path / "checkpoints"
    assert live_attempt(ck) == 1
    launcher = LocalLauncher()
    # slow-save holds step 10's save between its writes and its commit for seconds: the
    # rank is frozen there, deterministically inside a save.
    info = launcher.start(LaunchSpec(run_id="run-1", attempt=1, nodes=("local-1",), ranks_per_node=1,
                                     argv=trainer_cmd.trainer_argv(config, None),
                                     env={"TSUP_RUN_ID": "run-1", "TSUP_ATTEMPT": "1",
                                          "TSUP_FAULT": "slow-save@10:1"},
                                     log_dir=tmp_path / "logs", marker=str(config)))
    log = tmp_path / "logs" / "rank-0000.local-1.log"
    wait_for(lambda: "slow-save@10:1 fired" in (log.read_text() if log.exists() else ""), 120,
             "step 10's save to be held")
    pid = json.loads(info)["ranks"][0]["pid"]
    os.kill(pid, signal.SIGSTOP)  # frozen: the supervisor gives up on attempt 1 and starts attempt 2
    try:
        trainer_cmd.write_fence(spec, tmp_path, 2, user_tree.LOCAL)
        live_tmp = ck / ".tmp-step_00000020"  # attempt 2's save of step 20, being written
        live_tmp.mkdir()
        (live_tmp / "__0_0.distcp").write_bytes(b"attempt 2's shard")
        newer = ck / "step_00000030"  # a checkpoint of attempt 2's trajectory
        newer.mkdir()
        for name in (".metadata", "trainer_meta.json", "__0_0.distcp"):
            (newer / name).write_text("attempt 2's")
    finally:
        os.kill(pid, signal.SIGCONT)

    try:
        ranks = wait_for(lambda: (rs := launcher.observe(info)) and all(r.proc is ProcState.EXITED for r in rs)
                         and rs, 120, "the stale rank to end")
    finally:
        launcher.forget(info)  # the node's own process goes with the attempt
    text = log.read_text()
    assert ranks[0].exit_code == EXIT_DO_NOT_RETRY, text[-2000:]
    assert "attempt 2 of this run is live" in text, text[-2000:]
    assert (live_tmp / "__0_0.distcp").read_bytes() == b"attempt 2's shard", "the live save was cleared"
    assert (newer / "trainer_meta.json").read_text() == "attempt 2's", "the live trajectory was pruned"
    assert not (ck / "step_00000010").exists(), "the stale attempt committed after the fence"
    assert json.loads((ck / FENCE_FILE).read_text()) == {"attempt": 2}

"""warm-ranks.jsonl, in the run's user's attempt directory, names the processes the
daemon (root) later signals as the attempt's ranks (issue 26, item 1). A line naming a
process that is not the run's user's (pid 1, with its real start time) is not taken:
before, the daemon adopted it and would SIGKILL it when the attempt stopped."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import psutil

from supervisor.launchers.base import LaunchSpec
from supervisor.launchers.local_record import warm_ranks
from tests.conftest import require_root

NOBODY = 65534


def test_a_planted_line_naming_another_users_process_is_not_a_rank(tmp_path: Path) -> None:
    require_root("starting a process of another user")
    attempt = tmp_path / "attempts" / "2"
    attempt.mkdir(parents=True)
    own = subprocess.Popen(["sleep", "30"], user=NOBODY, group=NOBODY)
    try:
        lines = [{"rank": 0, "local_rank": 0, "node": "local-1", "pid": 1, "pgid": 1,
                  "create_time": psutil.Process(1).create_time()},
                 {"rank": 1, "local_rank": 1, "node": "local-1", "pid": own.pid, "pgid": own.pid,
                  "create_time": psutil.Process(own.pid).create_time()}]
        (attempt / "warm-ranks.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
        spec = LaunchSpec(run_id="run-1", attempt=2, nodes=("local-1",), ranks_per_node=2, argv=("true",), env={},
                          log_dir=attempt, marker="m", user="nobody", trusted_dir=tmp_path)
        assert [r.pid for r in warm_ranks(spec)] == [own.pid]
    finally:
        own.kill()
        own.wait()


def test_a_fifo_as_warm_ranks_reads_as_none(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "warm-ranks.jsonl")
    spec = LaunchSpec(run_id="run-1", attempt=2, nodes=("local-1",), ranks_per_node=1, argv=("true",), env={},
                      log_dir=tmp_path, marker="m", trusted_dir=tmp_path)
    assert warm_ranks(spec) == []

"""Which file holds a rank's or a node's output, and reading it a piece at a time
(supervisor/runfiles/attempt_logs.py)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from supervisor.errors import Conflict, NotFound
from supervisor.runfiles import attempt_logs


def test_a_rank_reads_its_own_file_else_its_nodes(tmp_path: Path) -> None:
    for name in ("rank-0000.local-1.log", "rank-0003.local-2.log", "node-1.log", "chaos.log"):
        (tmp_path / name).write_text(name)
    pick = attempt_logs.pick
    assert pick(tmp_path, rank=None, node_index=None, ranks_per_node=2) == "rank-0000.local-1.log"
    assert pick(tmp_path, rank=3, node_index=None, ranks_per_node=2) == "rank-0003.local-2.log"
    assert pick(tmp_path, rank=2, node_index=None, ranks_per_node=2) == "node-1.log", "rank 2 is on node 1"
    assert pick(tmp_path, rank=None, node_index=1, ranks_per_node=2) == "node-1.log"
    assert pick(tmp_path, rank=None, node_index=0, ranks_per_node=2) == "rank-0000.local-1.log", "its first rank"
    with pytest.raises(NotFound, match=r"no log of rank 5 .*its log files: node-1.log, rank-0000"):
        pick(tmp_path, rank=5, node_index=None, ranks_per_node=2)
    with pytest.raises(NotFound, match="no logs in"):
        pick(tmp_path / "absent", rank=None, node_index=None, ranks_per_node=2)


def test_a_log_is_read_from_an_offset_and_a_planted_link_is_refused(tmp_path: Path) -> None:
    (tmp_path / "rank-0.log").write_bytes(b"Epoch 0:   1%|  | 1/91\rEpoch 0:   2%|  | 2/91\n")
    first = attempt_logs.read(tmp_path, "rank-0.log", 0, 10)
    assert (first.data, first.size) == (b"Epoch 0:  ", 46)
    rest = attempt_logs.read(tmp_path, "rank-0.log", 10, 1 << 20)
    assert first.data + rest.data == (tmp_path / "rank-0.log").read_bytes()
    assert attempt_logs.read(tmp_path, "rank-0.log", 46, 10).data == b""
    (tmp_path / "secret").write_text("the daemon's")
    os.symlink(tmp_path / "secret", tmp_path / "rank-1.log")
    with pytest.raises(Conflict, match="cannot be read"):
        attempt_logs.read(tmp_path, "rank-1.log", 0, 10)


def test_a_link_planted_as_the_attempts_directory_is_not_followed(tmp_path: Path) -> None:
    """A low of issue 37: the logs API read through links in intermediate directories, so a
    run's user who linked attempts/2 to another user's attempt directory read that user's
    logs through the daemon."""
    runs = tmp_path / "runs"
    victim = tmp_path / "victims" / "attempts" / "1"
    victim.mkdir(parents=True)
    (victim / "rank-0000.node1.log").write_text("the victim's secrets\n")
    mine = runs / "run-1" / "attempts"
    mine.mkdir(parents=True)
    (mine / "2").symlink_to(victim)
    with pytest.raises(NotFound):
        attempt_logs.pick(mine / "2", rank=0, node_index=None, ranks_per_node=1, base=runs)
    with pytest.raises(Conflict):
        attempt_logs.read(mine / "2", "rank-0000.node1.log", 0, 1000, base=runs)
    assert attempt_logs.read(victim, "rank-0000.node1.log", 0, 1000).data, "without the link it is a file"

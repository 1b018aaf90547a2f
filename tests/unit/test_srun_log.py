"""srun.log, in the run's user's attempt directory, as the daemon (root) opens and reads
it every tick (issue 26, items 1 and 7): a link planted in its place is never opened
for srun's output, and a FIFO or a link to /dev/zero never blocks or floods the tick."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from supervisor.slurm.commands import SlurmCommands
from supervisor.slurm.srun import task_exits
from supervisor.user_files import UnsafePath


def test_a_fifo_or_a_link_to_dev_zero_as_srun_log_reads_as_no_exits_at_once(tmp_path: Path) -> None:
    """Before: the FIFO blocked the reading thread for ever; the link to /dev/zero read
    until memory ran out."""
    fifo, zero = tmp_path / "fifo-srun.log", tmp_path / "zero-srun.log"
    os.mkfifo(fifo)
    zero.symlink_to("/dev/zero")
    results: list[dict[int, int]] = []
    reader = threading.Thread(target=lambda: results.extend([task_exits(fifo), task_exits(zero)]),
                              daemon=True)
    reader.start()
    reader.join(timeout=10)
    assert not reader.is_alive(), "the tick's read of srun.log blocked"
    assert results == [{}, {}]


def test_srun_log_is_read_from_its_end(tmp_path: Path) -> None:
    log = tmp_path / "srun.log"
    log.write_text("x" * (3 << 20) + "\nsrun: error: node2: task 3: Exited with exit code 7\n")
    assert task_exits(log) == {3: 7}


def test_a_link_planted_as_srun_log_is_not_opened_for_srun(tmp_path: Path) -> None:
    """Before: the root daemon opened the link's target for appending and srun (as the
    run's user) wrote its output into it."""
    victim = tmp_path / "root-only"
    victim.write_text("root's\n")
    attempt = tmp_path / "runs" / "run-1" / "attempts" / "2"
    attempt.mkdir(parents=True)
    (attempt / "srun.log").symlink_to(victim)
    with pytest.raises(UnsafePath, match="symbolic link"):
        SlurmCommands().start_step(["echo", "srun output"], env={}, log_path=attempt / "srun.log",
                                   log_base=tmp_path / "runs")
    assert victim.read_text() == "root's\n"

"""Warm standby: the assignment a standby reads, and a real standby process turned into a
one-rank trainer by it (torch imported before, the rank's environment and log after)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from supervisor.launchers.standby import reference_args
from tests.conftest import REPO, wait_for
from trainer.standby import WAITING_NAME, name_for
from wire.standby import Assignment, broadcast, parse_line, slot_key

pytestmark = pytest.mark.integration


@pytest.mark.parametrize(("line", "complaint"), [
    (b"[]", "an object with argv, env, log and cwd"),
    (b'{"argv": [], "env": {}, "log": "x"}', "an object with argv, env, log and cwd"),
    (b'{"argv": "--config c", "env": {}, "log": "x", "cwd": null}', "argv: a list of strings"),
    (b'{"argv": [], "env": {"RANK": 1}, "log": "x", "cwd": null}', "env: an object of strings"),
    (b'{"argv": [], "env": {}, "log": null, "cwd": null}', "log: a path"),
])
def test_a_bad_assignment_is_refused(line: bytes, complaint: str) -> None:
    with pytest.raises(ValueError, match=complaint):
        Assignment.parse(line)


def test_an_assignment_round_trips_and_names_fit_the_kernels_15_bytes() -> None:
    a = Assignment(argv=["--config", "c.toml"], env={"RANK": "3"}, log="/x/rank-3.log", cwd=None)
    assert Assignment.parse(a.encode()) == a
    assert name_for("12") == "tsup-a12" and len(name_for("123456789012345")) == 15


def test_a_broadcast_gives_each_standby_its_own_slots_assignment() -> None:
    """Under Slurm one line reaches every standby of a generation (srun --input=all)."""
    a = Assignment(argv=["--config", "c"], env={"RANK": "2"}, log="/x/rank-2.log", cwd=None)
    b = Assignment(argv=["--config", "c"], env={"RANK": "3"}, log="/x/rank-3.log", cwd=None)
    line = broadcast({"node3/0": a, "node3/1": b})
    assert parse_line(line, "node3/0") == a and parse_line(line, "node3/1") == b
    assert parse_line(line, "node2/0") is None, "a slot the attempt does not use: not needed"
    assert parse_line(a.encode(), "node2/0") == a, "a line for one standby is its own, whatever its slot"
    with pytest.raises(ValueError, match="slots: an object"):
        parse_line(b'{"slots": []}\n', "node3/0")
    with pytest.raises(ValueError, match="argv: a list of strings"):
        parse_line(b'{"slots": {"node3/0": {"argv": 1, "env": {}, "log": "x", "cwd": null}}}\n', "node3/0")
    with pytest.raises(ValueError, match="not JSON"):
        parse_line(b'{"slots"\n', "node3/0")
    assert slot_key({"SLURMD_NODENAME": "node3", "SLURM_LOCALID": "1"}) == "node3/1", "Slurm's task"
    assert slot_key({"TSUP_NODE": "local-2", "TSUP_STANDBY_SLOT": "0", "SLURMD_NODENAME": "h",
                     "SLURM_LOCALID": "1"}) == "local-2/0", "the launcher's word first"


def test_only_the_reference_trainer_can_be_a_standby() -> None:
    assert reference_args((sys.executable, "-m", "trainer", "--config", "c", "--resume", "none")) == [
        "--config", "c", "--resume", "none"]
    assert reference_args(("torchrun", "train.py")) is None
    assert reference_args((sys.executable, "-m", "trainer", "--check-config", "c")) is None


def _standby(tmp_path: Path, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    with open(tmp_path / "standby.log", "ab") as log:
        return subprocess.Popen([sys.executable, "-m", "trainer", "--standby", str(tmp_path)], cwd=REPO,
                                stdin=subprocess.PIPE, stdout=log, stderr=subprocess.STDOUT,
                                env={**os.environ, **(env or {})})


def test_a_standby_waits_warm_then_trains_as_its_assignment_says(tmp_path: Path) -> None:
    config = tmp_path / "c.toml"
    config.write_text(f'model = "tiny"\nsteps = 3\noutput_dir = "{tmp_path / "out"}"\n'
                      f'[checkpoint]\ndir = "{tmp_path / "ck"}"\nevery_steps = 3\n')
    p = _standby(tmp_path)
    try:
        wait_for(lambda: "waiting for an assignment" in (tmp_path / "standby.log").read_text(), 60, "warm")
        assert Path(f"/proc/{p.pid}/comm").read_text().strip() == WAITING_NAME
        log = tmp_path / "rank-0.log"
        a = Assignment(argv=["--config", str(config), "--resume", "none"], env={"TSUP_ATTEMPT": "7"},
                       log=str(log), cwd=str(tmp_path))
        assert p.stdin is not None
        p.stdin.write(a.encode())
        p.stdin.close()
        wait_for(lambda: Path(f"/proc/{p.pid}/comm").read_text().strip() == "tsup-a7", 10, "the new name")
        assert p.wait(timeout=60) == 0
    finally:
        p.kill()
    text = log.read_text()
    assert "is rank ? of attempt 7" in text and "done: step 3" in text
    assert (tmp_path / "ck" / "step_00000003").is_dir()


def test_a_standby_whose_input_ends_leaves_and_a_bad_assignment_exits_2(tmp_path: Path) -> None:
    p = _standby(tmp_path)
    assert p.stdin is not None
    p.stdin.close()  # its launcher is gone
    assert p.wait(timeout=60) == 0
    p = _standby(tmp_path)
    assert p.stdin is not None
    p.stdin.write(b'{"argv": 1}\n')
    p.stdin.close()
    assert p.wait(timeout=60) == 2
    assert "a bad assignment" in (tmp_path / "standby.log").read_text()
    # Slurm's node3, task 1 of its node, reads a broadcast for node1's slots only.
    p = _standby(tmp_path, {"SLURMD_NODENAME": "node3", "SLURM_LOCALID": "1"})
    assert p.stdin is not None
    other = Assignment(argv=["--config", "c"], env={"RANK": "0"}, log=str(tmp_path / "rank-0.log"), cwd=None)
    p.stdin.write(broadcast({"node1/0": other, "node1/1": other}))
    p.stdin.flush()
    assert p.wait(timeout=60) == 0, "not needed: it leaves, without waiting for the end of its input"
    assert "slot node3/1 is not in the attempt: not needed" in (tmp_path / "standby.log").read_text()
    assert not (tmp_path / "rank-0.log").exists()


class _Waiting:
    """A standby process as the pool sees one: alive until it is not."""

    def __init__(self, alive: bool = True) -> None:
        self.alive = alive

    def poll(self) -> int | None:
        return None if self.alive else 0


def test_the_pool_hands_a_rank_the_standby_warmed_for_its_slot_and_falls_back_to_another() -> None:
    """Each standby warms the device of one local rank (on a GPU node, cuda:SLOT): a rank
    gets its own slot's standby when one waits, else any of its node's."""
    from supervisor.launchers.standby import StandbyPool, _RunPool, _Standby

    pool = StandbyPool()
    spec = object()
    procs = {(node, slot): _Waiting() for node in ("n1", "n2") for slot in (0, 1)}
    pool._runs["run-1"] = _RunPool(spec=spec, refill_at=0.0,  # type: ignore[arg-type]
                                   waiting=[_Standby(p, node, slot) for (node, slot), p in procs.items()])
    assert pool.take("run-1", "n1", 1) is procs[("n1", 1)]
    assert pool.take("run-1", "n1", 1) is procs[("n1", 0)], "its slot's is taken: another of the node's"
    assert pool.take("run-1", "n1", 0) is None
    procs[("n2", 0)].alive = False
    assert pool.take("run-1", "n2", 0) is procs[("n2", 1)], "a dead standby is passed over"
    assert pool.take("run-2", "n2", 0) is None


def test_a_standby_says_its_device_is_ready_before_it_waits(tmp_path: Path) -> None:
    """On this machine the device is the CPU: nothing to warm but the first uses of a
    rank's init and step, and the line says so."""
    p = _standby(tmp_path)
    try:
        wait_for(lambda: "waiting for an assignment" in (tmp_path / "standby.log").read_text(), 60, "warm")
    finally:
        assert p.stdin is not None
        p.stdin.close()
        p.wait(timeout=60)
    line = (tmp_path / "standby.log").read_text()
    assert " (cpu ready in " in line and ", first uses in " in line, line

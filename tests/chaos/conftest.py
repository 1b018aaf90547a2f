"""What every chaos scenario checks besides its own verdict.

A scenario breaks a real run (real processes, real signals, a real broker or Slurm box)
and asserts its own outcome: the run completes, or stops with the right reason; the
model digest equals the fault-free run's wherever the fault is invisible to the math;
exactly the nodes to blame are drained. ``Watch`` checks, in every scenario, that no
attempt ever ran twice at once; ``assert_records``, called by 26 of the 46 scenarios,
that SQLite holds the whole story and that each resumed attempt restored the step it
was given (equal digests cannot tell a resume from a restart from scratch).
"""

from __future__ import annotations

import re
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from tests.e2e.conftest import attempt_of, db_rows, node_processes, trainer_processes


def assert_records(state: Path, s: dict[str, Any], *, injected: int | None = None) -> None:
    """SQLite holds every attempt and event of the run the summary ``s`` describes."""
    attempts = db_rows(state, "SELECT number, state, outcome FROM attempts ORDER BY number")
    assert [a[0] for a in attempts] == list(range(1, s["attempts"] + 1)), attempts
    assert all(a[1] == "ENDED" for a in attempts), f"an attempt was left open: {attempts}"
    if s["state"] == "SUCCEEDED":
        assert attempts[-1][2] == "SUCCEEDED" and all(a[2] != "SUCCEEDED" for a in attempts[:-1]), attempts
    kinds = [k for (k,) in db_rows(state, "SELECT kind FROM events ORDER BY id")]
    assert kinds.count("attempt.launching") == len(attempts) == kinds.count("attempt.ended")
    faults = db_rows(state, "SELECT kind, detected_at, recovered_at FROM faults ORDER BY id")
    assert [f[0] for f in faults] == [f["kind"] for f in s["faults"]]
    assert kinds.count("fault.detected") == len(faults)
    assert all(f[1] is not None for f in faults)
    if s["state"] == "SUCCEEDED":
        assert all(f[2] is not None and f[2] >= f[1] for f in faults), f"a fault never recovered: {faults}"
    if injected is not None:
        assert kinds.count("chaos.injected") == injected, "every injection is on record, once"
    assert trainer_processes(state) == [], "nothing of the run is left running"
    assert node_processes(state) == [], "nor its nodes' own processes"
    assert_restored(state, s)


def assert_restored(state: Path, s: dict[str, Any]) -> None:
    """Every attempt that trained says, itself, where it began: its rank 0's log names the
    checkpoint step it resumed from (or none, from scratch), and the first step it reported
    on its own telemetry is the one after. The model digest cannot tell a resume from a
    restart from scratch (both see the same batches): this can."""
    firsts = dict(db_rows(state, "SELECT attempt, first_step FROM attempt_stats WHERE steps > 0"))
    assert firsts, "no attempt reported a step"
    for a in s["attempt_history"]:
        if a["number"] not in firsts:
            continue  # ended before its first step
        n, resume = a["number"], a["resume_step"]
        assert firsts[n] == resume + 1, f"attempt {n} was to resume from step {resume}, first reported {firsts[n]}"
        logs = [p for p in (state / "runs" / s["run_id"] / "attempts" / str(n)).glob("rank-*.log")
                if re.fullmatch(r"rank-0+(\..+)?\.log", p.name)]
        assert len(logs) == 1, f"attempt {n}: rank 0's log: {logs}"
        said = re.findall(r"resumed from \S+ at step (\d+) in ", logs[0].read_text(errors="replace"))
        assert said == ([str(resume)] if resume else []), f"attempt {n} resumed from {said}, not step {resume}"


class Watch:
    """Samples the running trainer processes of a state directory four times a second,
    grouped by attempt: two attempts alive at once would be a duplicate launch. A
    stopped process (a frozen node's, one no one can reach) runs nothing and is not
    counted; the end of every scenario checks that none is left. Nor are the processes of
    a node the scenario cut off from the network (``cut_off``): nothing can reach them
    (not the daemon, not its node agent's fence, not Slurm) until its link is back. A warm
    standby counts only once it is assigned to an attempt."""

    def __init__(self, state: Path) -> None:
        self.state = state
        self.overlaps: list[set[str]] = []
        self.samples = 0
        self.cut_off: set[str] = set()  # nodes the scenario cut off from the network
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.wait(0.25):
            attempts: set[str] = set()
            for p in trainer_processes(self.state):
                try:
                    if p.status() == psutil.STATUS_STOPPED:
                        continue  # frozen, it runs nothing; assert_records finds any left at the end
                    env = p.environ()
                    if env.get("SLURMD_NODENAME", env.get("TSUP_NODE")) in self.cut_off:
                        continue  # on a node cut off: out of anyone's reach
                    if "TSUP_STANDBY" in env:  # a warm standby: part of an attempt once assigned,
                        name = p.name()  # which it says by its name (trainer/standby.py)
                        if name.startswith("tsup-a"):
                            attempts.add(name.removeprefix("tsup-a"))
                        continue
                    if (attempt := attempt_of(env)) is not None:
                        attempts.add(attempt)
                except psutil.Error:
                    continue
            self.samples += 1
            if len(attempts) > 1:
                self.overlaps.append(attempts)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def assert_no_duplicates(self) -> None:
        assert self.samples > 0
        assert self.overlaps == [], f"trainers of two attempts alive at once: {self.overlaps[:5]}"


@pytest.fixture
def state(tmp_path: Path) -> Path:
    """The state directory of the scenario's run."""
    return tmp_path / "state"


@pytest.fixture(autouse=True)
def watch(state: Path) -> Iterator[Watch]:
    """Every scenario is watched for duplicate attempts; no trainer outlives it."""
    w = Watch(state)
    yield w
    w.stop()
    for p in trainer_processes(state):
        p.kill()
    w.assert_no_duplicates()

"""Rank 0's log lines stay whole when a background save says something while the training
thread prints its step (trainer/tracking.py: print_line). With print(), which writes the
text and its newline apart, 706 of 40,000 such lines came out broken here, and a reader
of the log (the daemon's output parser, bench/checkpoint_tiers.py) missed both lines."""

from __future__ import annotations

import re
import subprocess
import sys

from tests.conftest import REPO

WRITERS = r"""
import sys, threading
from trainer.tracking import print_line

def write(tag):
    for i in range(20000):
        print_line(f"{tag} line {i} " + "x" * 40)

threads = [threading.Thread(target=write, args=(tag,)) for tag in ("step", "checkpoint")]
for t in threads:
    t.start()
for t in threads:
    t.join()
"""


def test_two_threads_lines_come_out_whole() -> None:
    out = subprocess.run([sys.executable, "-c", WRITERS], capture_output=True, text=True, cwd=REPO,
                         timeout=120, check=True).stdout
    lines = out.splitlines()
    assert len(lines) == 40000
    broken = [line for line in lines if not re.fullmatch(r"(step|checkpoint) line \d+ x{40}", line)]
    assert broken == [], broken[:5]

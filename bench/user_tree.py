"""What touching a run's tree as its user costs the tick (supervisor/runfiles/user_tree.py).

    python bench/user_tree.py [--checkpoints 10,100,1000] [--requests 50] [--user nobody]

As root, for each size N: a checkpoint directory of N checkpoints of the FSDP test
case's layout (DCP: ``llama_v3-<step>steps/`` with ``.metadata`` and two shards) that
``--user`` may read, then ``--requests`` times each:

- ``scan``: the tick's scan of the directory (``Tree.pick``), in the daemon
  (``user_tree.LOCAL``, as every scan ran before) and by the user's worker;
- ``round_trip``: the worker's smallest request (``exists``), what a request costs
  beside the work it asks for.

Also the worker's start (its interpreter and imports, paid once a user, and again after
a worker is killed). It prints one JSON object: per size the p50 and p99 milliseconds of
each, and the start's seconds. A user with no login (``nobody``) is enough: the worker
needs only to read the checkout and the directory.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from history_reads import timed  # noqa: E402 - bench/, the script's own directory

from supervisor import users  # noqa: E402
from supervisor.runfiles import user_tree  # noqa: E402


def build(directory: Path, checkpoints: int) -> None:
    for n in range(1, checkpoints + 1):
        d = directory / f"llama_v3-{n * 10}steps"
        d.mkdir(parents=True)
        (d / ".metadata").write_bytes(b"m" * 64)
        for shard in range(2):
            (d / f"__{shard}_0.distcp").write_bytes(b"y" * 16)


def measure(worker: user_tree.Worker, checkpoints: int, requests: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="tsup-user-tree-") as tmp:
        Path(tmp).chmod(0o755)
        directory = Path(tmp) / "checkpoints"
        build(directory, checkpoints)
        here, there = user_tree.LOCAL.pick(directory, "dcp"), worker.pick(directory, "dcp")
        assert here == there and here[0] is not None and here[0].step == checkpoints * 10, (here, there)
        return {"checkpoints": checkpoints,
                "scan": {"local": timed(lambda: user_tree.LOCAL.pick(directory, "dcp"), requests),
                         "worker": timed(lambda: worker.pick(directory, "dcp"), requests)},
                "round_trip": timed(lambda: worker.exists(directory), requests)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--checkpoints", default="10,100,1000", help="comma-separated directory sizes")
    ap.add_argument("--requests", type=int, default=50, help="timed requests of each kind at each size")
    ap.add_argument("--user", default="nobody", help="the run's user the worker runs as")
    args = ap.parse_args()
    if os.geteuid() != 0:
        sys.exit("bench/user_tree.py: run it as root (the worker is started as --user)")
    worker = user_tree.Worker(users.lookup(args.user))
    try:
        starts = []
        for _ in range(3):
            worker.close()
            began = time.perf_counter()
            worker.exists(Path("/"))
            starts.append(time.perf_counter() - began)
        sizes = [measure(worker, int(n), args.requests) for n in args.checkpoints.split(",")]
    finally:
        worker.close()
    print(json.dumps({"user": args.user, "requests": args.requests,
                      "worker_start_s": round(statistics.median(starts), 3), "sizes": sizes}, indent=2))


if __name__ == "__main__":
    main()

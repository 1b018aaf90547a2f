"""``training-supervisor`` with a Slurm box's chaos hooks: the development entry point for
``run --launcher slurm --chaos kill-node@N`` (and freeze-node, partition-node, kill-rank)
on a box (slurmbox/box.py)::

    python -m slurmbox.tsup run examples/tiny-llama.toml --launcher slurm --chaos kill-node@50

It is the product's command (cli/daemon.py) with the box's hooks handed in; the product
itself has none, since nothing kills a real cluster's node on request.
"""

from __future__ import annotations

import sys

from cli import daemon
from slurmbox.chaos import BoxChaos


def main(argv: list[str] | None = None) -> int:
    return daemon.main(argv, slurm_chaos=BoxChaos)


if __name__ == "__main__":
    sys.exit(main())

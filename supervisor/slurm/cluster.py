"""One Slurm cluster's adapters, built together: they share the commands and the poll."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

from supervisor.slurm.allocation import SlurmOptions
from supervisor.slurm.commands import SlurmCommands
from supervisor.slurm.launcher import SlurmLauncher
from supervisor.slurm.nodes import SlurmNodes
from supervisor.slurm.state import SlurmState


@dataclass(frozen=True, slots=True)
class SlurmCluster:
    commands: SlurmCommands
    state: SlurmState  # started by the daemon (a worker thread polls); inline otherwise
    launcher: SlurmLauncher
    nodes: SlurmNodes


def slurm_cluster(*, slurm_conf: str | None, state_dir: Path, poll_interval_s: float = 0.5,
                  options: SlurmOptions | None = None, admin_prefix: tuple[str, ...] = (),
                  hyperpod: bool = False, bin_dir: Path | None = None,
                  node_python: str = sys.executable) -> SlurmCluster:
    commands = SlurmCommands(slurm_conf=slurm_conf, admin_prefix=admin_prefix, bin_dir=bin_dir)
    state = SlurmState(commands, poll_interval_s=poll_interval_s)
    launcher = SlurmLauncher(commands, state, state_dir=state_dir, options=options, node_python=node_python)
    return SlurmCluster(commands, state, launcher, SlurmNodes(commands, state, prefix=launcher.prefix,
                                                              hyperpod=hyperpod, node_python=node_python))

"""Slurm: the production cluster adapter, one allocation per run and the trainer as a job step in it.

    cluster.py   slurm_cluster(): one cluster's adapters, built together (sharing the commands and the poll)
    commands.py  SlurmCommands: the one module that runs Slurm's commands (argv lists, a timeout each)
    state.py     SlurmState: what Slurm said last, polled off the reconciler's path
    launcher.py  SlurmLauncher: the ``Launcher`` port (allocations, steps, what they hold and do)
    nodes.py     SlurmNodes: the ``NodeAdmin`` port (drains, returns, probes; HyperPod's repairs)
    requests.py  the sbatch request and a step's srun, pure builders
    parse.py     what squeue, sinfo and scontrol print, pure parsers

The ports are in supervisor/launchers/base.py; the daemon builds this adapter with
``slurm_cluster`` when its launcher is ``slurm`` (supervisor/daemon.py). No chaos hooks
here: drills on Slurm use the development Slurm box's (slurmbox/chaos.py), which its own
entry point hands in (slurmbox/tsup.py); they are no part of the installed product.
"""

"""The ports to a cluster (base.py) and the local adapter: a run's nodes as process groups here.

    base.py     Launcher, NodeAdmin, ChaosHooks: what the reconciler asks of any cluster
    local.py    LocalLauncher: every port at once, on this machine (tests, drills, one host)
    standby.py  StandbyPool: the local launcher's warm standby processes

The Slurm adapter is supervisor/slurm/.
"""

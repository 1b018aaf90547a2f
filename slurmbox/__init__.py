"""A real Slurm cluster on one host, for development and tests (not part of the product).

    box.py    munged, slurmctld and N slurmd posing as nodes: up, down, kill a node
    chaos.py  the chaos hooks (supervisor/launchers/base.py, ChaosHooks) on a box

``scripts/slurm-box`` runs it; the tests start one per test (tests/conftest.py).
"""

"""Slurm: the production launcher (see supervisor/launchers/slurm.py)."""

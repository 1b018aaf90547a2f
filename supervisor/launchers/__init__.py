"""Launchers: local process groups today; Slurm steps next."""

"""A run's files, and the commands that make them: reached as the run's user.

user_tree.py is the one door to a run's tree (its checkpoints, results, logs, compile
inputs): each operation runs as the run's user in a worker of its own (the operations
themselves: supervisor/user_files.py; the checkpoint scan: checkpoint_scan.py). Beside
it: what an attempt is told and where it writes (trainer_cmd.py: the trainer's command
line, its config and directories), the precompile pass's bookkeeping (precompile.py), and
an attempt's logs as supervisorctl reads them (attempt_logs.py).
"""

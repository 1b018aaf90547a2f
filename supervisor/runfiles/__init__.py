"""A run's files, and the commands that make them: reached as the run's user.

user_tree.py is the one door to a run's tree (its checkpoints, results, logs, compile
inputs): each operation runs as the run's user in a worker of its own (user_files.py holds
the operations themselves, checkpoint_scan.py the checkpoint scan). Beside it: what an
attempt is told and where it writes (trainer_cmd.py: the trainer's command line, its
config and directories; node_env.py: the accelerator's environment), the precompile
pass's bookkeeping (precompile.py), and an attempt's logs as supervisorctl reads them
(attempt_logs.py).
"""

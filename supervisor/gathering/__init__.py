"""Gathering: what the reconciler sees of each run each tick, before the policy decides.

feed.py first tells the telemetry view what it must know (the live attempt's world size,
what a [command] trainer printed); then observe.py reads the store, the launcher, the
telemetry view and (as the run's user) the checkpoints, and hands the policy one
``Observed`` run (observed.py). Beside them: what
this process remembers of a run between ticks (run_memory.py), a run's settled history
decoded once (settled.py), what a [command] trainer's output says (output_progress.py),
and what starts an attempt or finds it again (launch_specs.py).
"""

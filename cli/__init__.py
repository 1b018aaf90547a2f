"""The command lines, above everything they start or ask: ``training-supervisor``
(cli/daemon.py: serve, run, and the other daemon-side commands) and ``supervisorctl``
(cli/ctl.py: the REST API's client). Nothing in supervisor/ or api/ imports them.
"""

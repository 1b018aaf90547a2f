"""The supervisor's one error tree.

    SupervisorError                 anything this package raises on purpose
    ├── SpecError                   a run spec, config file or command-line flag is invalid
    │                               (names the key), or names a user the run may not execute as
    ├── NotFound                    an unknown run, node or command
    ├── Forbidden                   a person's token asked for another's run, or an
    │                               operator's act (supervisor/people.py)
    ├── Conflict                    a change the current state forbids
    ├── StateDirLocked              another daemon holds the state directory
    ├── StoreError                  the database is unusable (schema too new, corrupt, not open)
    └── LaunchError                 the launcher could not start or control processes, or
        │                           the cluster refused a node command (drain, return)
        └── CannotExecute           the command itself cannot be run (no such program, not
                                    executable, a NUL byte in an argument, a user that no
                                    longer exists): no retry helps

Two subclasses live beside the code that raises them: ``IllegalTransition`` (a
``Conflict``: a state change the transition table forbids, supervisor/policy/
transitions.py) and ``SlurmParseError`` (Slurm printed what cannot be read,
supervisor/slurm/parse.py). The daemon raises a bare ``SupervisorError`` when it
cannot start or a root task dies.

The API maps these to HTTP statuses in one handler (api/app.py); cli/daemon.py
maps them to exit codes, and supervisorctl (cli/ctl.py) maps the API's statuses to its
own. Adapters translate foreign exceptions into these with ``raise ... from e``.
"""

from __future__ import annotations


class SupervisorError(Exception):
    """Base of every error the supervisor raises on purpose."""


class SpecError(SupervisorError):
    """A run spec or config file is invalid; the message names the file and key."""


class NotFound(SupervisorError):
    pass


class Conflict(SupervisorError):
    pass


class Forbidden(SupervisorError):
    pass


class StateDirLocked(SupervisorError):
    pass


class StoreError(SupervisorError):
    pass


class LaunchError(SupervisorError):
    pass


class CannotExecute(LaunchError):
    pass

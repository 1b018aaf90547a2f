"""The supervisor's one error tree.

    SupervisorError                 anything this package raises on purpose
    ├── SpecError                   a run spec or config file is invalid (names the key)
    ├── NotFound                    an unknown run, node or attempt
    ├── Conflict                    a request that the current state forbids
    ├── StateDirLocked              another daemon holds the state directory
    ├── StoreError                  the database is unusable (schema too new, corrupt)
    └── LaunchError                 the launcher could not start or control processes
        └── CannotExecute           the command itself cannot be run (no such program, not
                                    executable, a NUL byte in an argument): no retry helps

The API maps these to HTTP statuses in one handler (api/app.py) and the CLIs map
them to exit codes (supervisor/cli.py, api/ctl.py). Adapters translate foreign
exceptions into these with ``raise ... from e``.
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


class StateDirLocked(SupervisorError):
    pass


class StoreError(SupervisorError):
    pass


class LaunchError(SupervisorError):
    pass


class CannotExecute(LaunchError):
    pass

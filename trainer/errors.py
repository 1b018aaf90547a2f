"""The trainer's error tree and the exit codes it maps to (stdlib only).

::

    Exception
    └── TrainerError              exit 1: unexpected; the supervisor may retry
        └── DoNotRetry            exit 2: retrying the same command cannot help
            ├── ConfigError       a bad config file, key or value (also a ValueError)
            ├── UsageError        bad command line or launcher environment
            ├── CheckpointMismatch a checkpoint written by another world size or model
            └── DataError         a token file that is missing, empty or out of vocab range

Any other exception also exits 1. The table lives here so that ``__main__`` (the
process exit status) and ``telemetry`` (the ``Exit`` message) agree on it.
"""

from __future__ import annotations

EXIT_OK = 0
EXIT_UNEXPECTED = 1  # a traceback is on stderr; the supervisor may retry
EXIT_DO_NOT_RETRY = 2  # configuration or usage error; retrying cannot help
EXIT_INTERRUPTED = 130  # SIGINT / KeyboardInterrupt, the shell convention 128 + 2


class TrainerError(Exception):
    """Base of the errors the trainer raises on purpose."""

    exit_code: int = EXIT_UNEXPECTED


class DoNotRetry(TrainerError):
    """An error that the same command would hit again: the supervisor must not retry."""

    exit_code = EXIT_DO_NOT_RETRY


class ConfigError(DoNotRetry, ValueError):
    """One or more problems in a config; ``errors`` holds one line per problem.

    Each line starts with the dotted key path it is about, for example
    ``optimizer.lr: expected a positive number, got -1``.
    """

    def __init__(self, errors: str | list[str]) -> None:
        self.errors: list[str] = [errors] if isinstance(errors, str) else list(errors)
        super().__init__("\n".join(self.errors))

    def prefixed(self, prefix: str) -> ConfigError:
        """The same errors with ``prefix.`` in front of each key path."""
        return ConfigError([f"{prefix}.{line}" for line in self.errors])


class UsageError(DoNotRetry):
    """A bad command line or launcher environment (for example RANK without WORLD_SIZE)."""


class CheckpointMismatch(DoNotRetry):
    """The checkpoint to resume from cannot be loaded into this run."""


class DataError(DoNotRetry):
    """The training data cannot be used (missing file, too short, token ids >= vocab)."""


def exit_code_for(exc: BaseException) -> int:
    """The process exit status that a run ending with ``exc`` should have."""
    if isinstance(exc, TrainerError):
        return exc.exit_code
    if isinstance(exc, KeyboardInterrupt):
        return EXIT_INTERRUPTED
    if isinstance(exc, SystemExit):
        code = exc.code
        if code is None:
            return EXIT_OK
        return code if isinstance(code, int) else EXIT_UNEXPECTED
    return EXIT_UNEXPECTED

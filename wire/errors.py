"""The trainer's error tree and the exit codes it maps to (stdlib only).

::

    Exception
    └── TrainerError              exit 1: unexpected; the supervisor may retry
        ├── DoNotRetry            exit 2: retrying the same command cannot help
        │   ├── ConfigError       a bad config file, key or value (also a ValueError)
        │   ├── UsageError        bad command line or launcher environment
        │   ├── CheckpointMismatch a checkpoint written by another world size or model
        │   ├── Superseded        a later attempt of the run is live (a stale rank woke up)
        │   └── DataError         a token file that is missing, empty or out of vocab range
        ├── CheckpointUnreadable  exit 3: the checkpoint to resume from cannot be read
        │                         (a truncated or corrupt shard): resume from an older one
        ├── DeviceFault           exit 4: this rank's accelerator failed (an uncorrectable
        │                         ECC error, a Neuron hardware error): drain its node
        └── CheckpointStorageFull exit 5: a checkpoint cannot be written (no space, quota,
                                  read-only): stop until an operator frees space

Any other exception exits 1, unless its message carries a device failure's signature
(``DEVICE_SIGNATURES``): then 4. The table lives here so that ``__main__`` (the process
exit status) and ``telemetry`` (the ``Exit`` message) agree on it; trainer/README.md
says what the supervisor does with each code.
"""

from __future__ import annotations

EXIT_OK = 0
EXIT_UNEXPECTED = 1  # a traceback is on stderr; the supervisor may retry
EXIT_DO_NOT_RETRY = 2  # configuration or usage error; retrying cannot help
EXIT_CHECKPOINT_UNREADABLE = 3  # the checkpoint to resume from is corrupt: resume from an older one
EXIT_DEVICE_FAULT = 4  # this rank's device failed: its node must not be used again before repair
EXIT_STORAGE_FULL = 5  # no checkpoint can be written: a restart cannot help until space is freed
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


class Superseded(DoNotRetry):
    """A later attempt of this run is live: this (stale) process must not touch the
    run's checkpoints (wire.files.FENCE_FILE)."""


class DataError(DoNotRetry):
    """The training data cannot be used (missing file, too short, token ids >= vocab)."""


class CheckpointUnreadable(TrainerError):
    """The checkpoint to resume from is complete by its marker but cannot be read."""

    exit_code = EXIT_CHECKPOINT_UNREADABLE


class DeviceFault(TrainerError):
    """The rank's accelerator reported a hardware failure."""

    exit_code = EXIT_DEVICE_FAULT


class CheckpointStorageFull(TrainerError):
    """A checkpoint could not be written: no space left, over quota, or read-only."""

    exit_code = EXIT_STORAGE_FULL


# Words in an error message that only a failing device produces: CUDA's
# cudaErrorECCUncorrectable, and the Neuron runtime's hardware-error statuses
# (NRT 1201-1203 and 1205).
DEVICE_SIGNATURES = (
    "uncorrectable ECC error",
    "NRT_EXEC_HW_ERR_HBM_UE",
    "NRT_EXEC_HW_ERR_NC_UE",
    "NRT_EXEC_HW_ERR_DMA_ABORT",
    "NRT_EXEC_HW_ERR_REPAIRABLE_HBM_UE",
)


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
    if any(s in str(exc) for s in DEVICE_SIGNATURES):
        return EXIT_DEVICE_FAULT
    return EXIT_UNEXPECTED

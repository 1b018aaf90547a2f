"""A run spec's ``[command]`` table (supervisor/spec.py): a trainer the supervisor did
not write, how it is launched, resumed and read.

    [command]
    argv = ["./train.sh"]
    launch = "node"              # or "rank": once per rank, with torchrun's environment
    cwd = "/fsx/ubuntu/neuronx-distributed-training/examples"
    checkpoint_dir = "/fsx/ubuntu/neuronx-distributed-training/examples/nemo_experiments"
    env = {CONF_FILE = "hf_llama3_8B_config"}
    precompile_env = {COMPILE = "1"}
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from supervisor import linear_match
from supervisor.domain import TSUP_EXIT_CODES, ExitMeaning
from supervisor.domain.step import STEP_PLACEHOLDERS, LaunchMode
from supervisor.slurm.requests import SUPERVISOR_SRUN_OPTIONS

MODEL_CONFIG = ConfigDict(extra="forbid", frozen=True)  # every table of a spec: no unknown key

# supervisor/runfiles/checkpoint_scan.py
CHECKPOINT_LAYOUTS = ("tsup", "nxd", "nemo", "hf", "megatron", "dcp", "lightning")


SKIP_TO_STEP = "{skip_to_step}"
MAX_PRECOMPILE_INPUTS = 32  # files the precompile fingerprint reads (supervisor/runfiles/precompile.py)


class CommandSpec(BaseModel):
    """A trainer the supervisor did not write: a plain command, run on every rank with the
    torchrun environment (RANK, WORLD_SIZE, MASTER_ADDR ...), or with ``launch = "node"``
    once per node, where the user's torchrun or script spawns the ranks.

    Placeholders: ``{run_dir}`` and ``{checkpoint_dir}`` in ``argv``, ``checkpoint_dir``,
    ``env`` and ``cwd``; the step's rendezvous (supervisor/domain/step.py: ``{nnodes}``,
    ``{nproc_per_node}``, ``{master_addr}``, ``{master_port}``, ``{rdzv_id}``) in ``argv``,
    ``env`` and ``resume``; ``{checkpoint}`` (the path of the checkpoint to resume from)
    and ``{step}`` in ``resume``, whose items are appended to ``argv`` only when resuming;
    ``{skip_to_step}`` in ``argv``, ``env`` and ``resume``: the step of the data stream the
    trainer's next step reads (``TSUP_SKIP_TO_STEP``, always set). It is the step after the
    checkpoint, until a persistent loss spike makes the run skip data: a trainer whose
    command names it is told to step over the spike's batches (``skips_data``).

    ``precompile_env``: the variables that turn the same command into the job's precompile
    pass (NxD Training's train.sh: ``COMPILE = "1"``). The supervisor then runs that pass
    as the run's first attempt, under the compile allowance, and again before the next
    attempt only when its inputs changed: the command section and the files named in
    ``precompile_inputs`` (relative to ``cwd``; by default ``argv[0]``), read on the
    controller (supervisor/runfiles/precompile.py).
    """

    model_config = MODEL_CONFIG
    argv: Annotated[list[str], Field(min_length=1)]
    launch: LaunchMode = "rank"
    # Appended to argv when resuming. Items naming {checkpoint} or {step} tell the trainer
    # which checkpoint to load; otherwise (a directory to search, as the FSDP test case's
    # --resume_from_checkpoint, or nothing: NxD Training finds its own) the trainer
    # searches, and the supervisor first moves every checkpoint newer than the one it
    # chose out of its way (``searches``).
    resume: list[str] = []
    checkpoint_dir: str
    checkpoint_layout: str | None = None  # None: recognise any layout
    steps: Annotated[int, Field(ge=0, le=10**12)] = 0  # the run's length, for progress (0: unknown)
    env: dict[str, str] = {}
    cwd: str | None = None  # the ranks' working directory ({run_dir}, {checkpoint_dir} allowed)
    precompile_env: dict[str, str] = {}  # over env, for the precompile pass (empty: the job has none)
    precompile_inputs: Annotated[list[Annotated[str, Field(min_length=1, max_length=4096)]],
                                 Field(max_length=MAX_PRECOMPILE_INPUTS)] | None = None
    # Slurm: options of the user's own for the step's srun (-l, --container-image=...),
    # after the supervisor's; those it sets itself (--nodes, --ntasks, ...) are refused.
    srun_args: list[Annotated[str, Field(min_length=2, max_length=1000)]] = []
    # The command saves a checkpoint on SIGUSR1, which Slurm then sends ahead of the
    # allocation's time limit. Off by default: SIGUSR1 ends a process that ignores it.
    handles_usr1: bool = False
    # What its exit codes mean: "none" (any failure is retried), "tsup" (the reference
    # trainer's table: 2 do-not-retry, 3 checkpoint-unreadable, 4 device, 5 storage-full),
    # or a table of its own ({"7" = "device"}).
    exit_codes: str | dict[str, str] = "none"
    # A regular expression for the trainer's progress lines, with named groups "step" and
    # optionally "loss" and "grad_norm" (supervisor/gathering/output_progress.py), tried before the
    # formats the supervisor knows (the FSDP test case's, NxD's, NeMo's). RE2's syntax:
    # no backreferences or lookarounds, so that any line is matched in linear time.
    progress_pattern: Annotated[str, Field(min_length=1, max_length=1000)] | None = None

    @field_validator("progress_pattern")
    @classmethod
    def _progress_pattern(cls, v: str | None) -> str | None:
        if v is None:
            return v
        try:
            groups = re.compile(v).groupindex
        except re.error as e:
            raise ValueError(f"{v!r} is not a regular expression: {e}") from e
        linear_match.check(v)  # every line a trainer prints is matched: in linear time
        if "step" not in groups:
            raise ValueError(f"{v!r} has no (?P<step>...) group: the step number is what progress is")
        unknown = sorted(set(groups) - {"step", "loss", "grad_norm"})
        if unknown:
            raise ValueError(f"{v!r}: unknown group(s) {', '.join(unknown)}; known: step, loss, grad_norm")
        return v

    @field_validator("exit_codes", mode="before")
    @classmethod
    def _exit_codes(cls, v: object) -> object:
        if isinstance(v, str) and v not in ("none", "tsup"):
            raise ValueError(f'expected "none", "tsup" or a table of codes, got {v!r}')
        if isinstance(v, dict):
            known = ", ".join(m.value for m in ExitMeaning)
            for code, meaning in v.items():
                if not str(code).isdigit() or not 1 <= int(code) <= 255:
                    raise ValueError(f"{code!r}: an exit code is a number from 1 to 255")
                if meaning not in {m.value for m in ExitMeaning}:
                    raise ValueError(f"{code} = {meaning!r}: expected one of {known}")
        return v

    @property
    def searches(self) -> bool:
        """The trainer picks the checkpoint it resumes from by itself."""
        return not any("{checkpoint}" in r or "{step}" in r for r in self.resume)

    @property
    def exit_meanings(self) -> Mapping[int, ExitMeaning]:
        if isinstance(self.exit_codes, dict):
            return {int(code): ExitMeaning(meaning) for code, meaning in self.exit_codes.items()}
        return TSUP_EXIT_CODES if self.exit_codes == "tsup" else {}

    @property
    def precompiles(self) -> bool:
        """The job has a precompile pass the supervisor runs (``precompile_env``)."""
        return bool(self.precompile_env)

    @property
    def skips_data(self) -> bool:
        """Its command names ``{skip_to_step}``: it can be told to step over data."""
        return any(SKIP_TO_STEP in item for item in (*self.argv, *self.resume, *self.env.values()))

    @field_validator("checkpoint_layout")
    @classmethod
    def _layout(cls, v: str | None) -> str | None:
        if v is not None and v not in CHECKPOINT_LAYOUTS:
            raise ValueError(f"expected one of {', '.join(CHECKPOINT_LAYOUTS)}")
        return v

    @model_validator(mode="after")
    def _placeholders(self) -> CommandSpec:
        paths = {"run_dir", "checkpoint_dir"}
        step = paths | set(STEP_PLACEHOLDERS) | {"skip_to_step"}
        for where, items, allowed in (("argv", self.argv, step),
                                      ("resume", self.resume, step | {"checkpoint", "step"}),
                                      ("checkpoint_dir", [self.checkpoint_dir], {"run_dir"}),
                                      ("env", list(self.env.values()), step),
                                      ("precompile_env", list(self.precompile_env.values()), step),
                                      ("cwd", [self.cwd] if self.cwd else [], paths)):
            for item in items:
                try:
                    item.format(**{k: "" for k in allowed})
                except (KeyError, IndexError, ValueError) as e:
                    names = ", ".join("{" + a + "}" for a in sorted(allowed))
                    raise ValueError(f"{where}: {item!r} uses an unknown placeholder or a stray brace "
                                     f"({e}); allowed: {names}") from e
        for arg in self.srun_args:
            if not arg.startswith("-"):
                raise ValueError(f"srun_args: {arg!r} is not an option (srun's options start with '-')")
            option = arg.split("=", 1)[0] if arg.startswith("--") else arg[:2]  # -N2 is -N
            if option in SUPERVISOR_SRUN_OPTIONS:
                raise ValueError(f"srun_args: {option} is the supervisor's to set, for every step")
        return self



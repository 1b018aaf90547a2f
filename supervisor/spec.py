"""Run specs: the TOML file a user submits, validated with errors that name the key.

    name = "tiny-llama"
    user = "alice"         # the trainers execute as (absent: the daemon's run_as, or its own user)

    [resources]            # what one attempt trains on, plus hot spares
    launcher = "local"     # or "slurm": the cluster SLURM_CONF names (partition, time_limit_min)
    nodes = 2
    ranks_per_node = 2
    spares = 1

    [trainer]              # the reference trainer's own config (trainer/README.md);
    steps = 120            # the supervisor reads `steps` and `checkpoint`, and fills in
    [trainer.checkpoint]   # checkpoint.dir and output_dir when the spec leaves them out
    every_steps = 20       # or "auto": Young/Daly, set by the supervisor at each attempt

    [policy]               # decision rules (supervisor/policy/)
    failures_without_progress = 4

    [telemetry]
    mqtt_url = "mqtt://127.0.0.1:1883"   # absent: the daemon's broker (embedded by default)
    aggregate = "rank"     # or "node": one message per node, not per rank (reference trainer)

    [curves]               # the run's own curves, shown by status, the page and the API
    tensorboard = "{checkpoint_dir}/{job_id}"   # a TensorBoard logdir (absent: the
                           # reference trainer's; NxD Training's per-job one for "nemo")
    url = "https://wandb.ai/team/llama/runs/{run_id}"   # W&B, MLflow, any link

The trainer table itself is checked by the trainer (``python -m trainer --check-config``,
see supervisor/runfiles/trainer_cmd.py), so that the daemon never imports torch.
"""

from __future__ import annotations

import json
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from supervisor.domain import TSUP_EXIT_CODES, ExitMeaning, Policy
from supervisor.errors import SpecError
from supervisor.node_env import Accelerator
from supervisor.planning import LLAMA3_FAILURES_PER_NODE_DAY
from supervisor.spec_command import MODEL_CONFIG, CommandSpec
from wire import parse_mqtt_url
from wire.batch import split_batch
from wire.errors import ConfigError


class ResourcesSpec(BaseModel):
    model_config = MODEL_CONFIG
    launcher: Literal["local", "slurm"] = "local"
    nodes: Annotated[int, Field(gt=0, le=4096)] = 1
    ranks_per_node: Annotated[int, Field(gt=0, le=64)] = 1
    spares: Annotated[int, Field(ge=0, le=1024)] = 0
    # Slurm only: where the allocation goes, and its time limit (before it, the trainer
    # gets SIGUSR1 and saves a checkpoint; after it, the run gets a new allocation).
    partition: Annotated[str, Field(pattern=r"^[A-Za-z0-9._-]{1,64}$")] | None = None
    time_limit_min: Annotated[int, Field(gt=0, le=525_600)] | None = None
    # Warm standby: a rank process per slot on every healthy node the run holds, started
    # and with torch imported, for the next attempt (supervisor/launchers/standby.py).
    # It costs each node a second interpreter per rank (here about 250 MB of memory each).
    standby: bool = False
    # The nodes' accelerators, for the interconnect and runtime environment every step
    # gets (supervisor/node_env.py): "neuron" (trn1.32xlarge: 32 ranks per node) or
    # "nvidia" (p5.48xlarge: 8); absent, nothing is added.
    accelerator: Accelerator | None = None


_DAY_S = 86_400.0


class PolicySpec(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)
    failures_without_progress: Annotated[int, Field(ge=1, le=10_000)] = 4
    progress_steps: Annotated[int, Field(ge=1, le=10**12)] = 100
    fault_rate_max: Annotated[int, Field(ge=1, le=1_000_000)] = 30
    fault_rate_window_s: Annotated[float, Field(gt=0, le=365 * _DAY_S)] = 3600.0
    crash_loop_attempts: Annotated[int, Field(ge=2, le=10_000)] = 3
    backoff_base_s: Annotated[float, Field(ge=0, le=_DAY_S)] = 5.0
    backoff_max_s: Annotated[float, Field(ge=0, le=_DAY_S)] = 300.0
    spike_window: Annotated[int, Field(ge=2, le=100_000)] = 20
    spike_loss_rel: Annotated[float, Field(gt=0, le=1000)] = 0.5
    spike_grad_factor: Annotated[float, Field(gt=1, le=1000)] = 5.0
    spike_persist_steps: Annotated[int, Field(ge=1, le=100_000)] = 5
    spike_skip_steps: Annotated[int, Field(ge=1, le=10_000_000)] = 50
    hang_timeout_s: Annotated[float, Field(gt=0, le=_DAY_S)] = 300.0
    hang_floor_s: Annotated[float, Field(gt=0, le=_DAY_S)] = 8.0
    hang_k: Annotated[float, Field(ge=1, le=1000)] = 3.0
    hang_min_samples: Annotated[int, Field(ge=1, le=100_000)] = 20
    startup_timeout_s: Annotated[float, Field(gt=0, le=_DAY_S)] = 900.0
    compile_timeout_s: Annotated[float, Field(gt=0, le=7 * _DAY_S)] = 7200.0
    checkpoint_timeout_s: Annotated[float, Field(gt=0, le=_DAY_S)] = 600.0
    checkpoint_min_gb_s: Annotated[float, Field(gt=0, le=10_000)] = 0.1
    eval_timeout_s: Annotated[float, Field(gt=0, le=_DAY_S)] = 600.0
    stop_grace_s: Annotated[float, Field(ge=0, le=3600)] = 10.0
    fault_settle_s: Annotated[float, Field(ge=0, le=60)] = 1.0
    abandon_after_s: Annotated[float, Field(gt=0, le=_DAY_S)] = 120.0
    pause_release_s: Annotated[float, Field(ge=0, le=365 * _DAY_S)] = 300.0
    silence_timeout_s: Annotated[float, Field(gt=0, le=_DAY_S)] = 10.0
    straggler_window: Annotated[int, Field(ge=3, le=100)] = 20  # telemetry keeps 100 per rank
    straggler_margin: Annotated[float, Field(gt=0, le=100)] = 0.25
    straggler_min_s: Annotated[float, Field(ge=0, le=3600)] = 0.005
    straggler_restart: bool = False
    slowdown_factor: Annotated[float, Field(gt=1, le=1000)] = 2.0
    slowdown_window: Annotated[int, Field(ge=3, le=60)] = 10  # telemetry keeps 64 of rank 0's steps
    lemon_faults: Annotated[int, Field(ge=2, le=10_000)] = 3
    lemon_window_s: Annotated[float, Field(gt=0, le=365 * _DAY_S)] = _DAY_S
    drains_per_fault: Annotated[int, Field(ge=1, le=100_000)] = 2
    drains_per_window: Annotated[int, Field(ge=1, le=100_000)] = 4
    drain_window_s: Annotated[float, Field(gt=0, le=365 * _DAY_S)] = 3600.0
    failures_per_node_day: Annotated[float, Field(gt=0, le=100)] = LLAMA3_FAILURES_PER_NODE_DAY
    shrink_after_s: Annotated[float, Field(ge=0, le=365 * _DAY_S)] = 0.0
    shrink_min_nodes: Annotated[int, Field(ge=1, le=4096)] = 1

    def to_policy(self, node_counts: tuple[int, ...] | None = None) -> Policy:
        """The knobs, with the node counts the trainer can shrink to (RunSpec.shrink_counts)."""
        return Policy(**self.model_dump(), shrink_node_counts=node_counts)


class HealthSpec(BaseModel):
    """Node probes (``python -m health`` on the nodes; supervisor/node_health.py).

    What the probe checks is a closed set of typed keys, never an open argument list: the
    probe may run as root on every node, and a spec is a write-token holder's (a path such
    as --kernel-log or --checkpoint-dir, or --drain-self, would let a spec steer it)."""

    model_config = MODEL_CONFIG
    preflight: bool = False  # probe newly allocated nodes before the trainer starts on them
    diagnose: bool = False  # probe an attempt's nodes after it failed
    timeout_s: Annotated[float, Field(gt=0, le=600)] = 60.0
    instance_type: Annotated[str, Field(pattern=r"^[a-z0-9-]{1,20}\.[a-z0-9-]{1,20}$")] | None = None
    neuron_devices: Annotated[int, Field(ge=1, le=64)] | None = None  # expected Neuron devices
    gpus: Annotated[int, Field(ge=1, le=64)] | None = None  # expected NVIDIA GPUs
    min_free_gib: Annotated[float, Field(ge=0, le=1e6)] | None = None  # where checkpoints go
    dcgm: bool = False  # also `dcgmi diag -r 1`
    bandwidth: bool = False  # also the collective bandwidth test (nccom-test / nccl-tests)
    min_busbw_gbps: Annotated[float, Field(gt=0, le=1e5)] | None = None
    # The link test (health/links.py), with every preflight and diagnosis of two or more
    # nodes: a node whose best pair runs under link_fraction of the median is drained.
    links: bool = True
    link_fraction: Annotated[float, Field(gt=0, lt=1)] = 0.5
    # With preflight: a node the run holds idle (a spare) whose newest probe is older than
    # this is probed while the run trains, so that it joins proven (0: never).
    spare_probe_every_s: Annotated[float, Field(ge=0, le=30 * _DAY_S)] = 1800.0
    # The tool each pair runs (supervisor/link_steps.py); None: the one of the accelerator
    # the other keys name (pair_tool).
    link_tool: Literal["allreduce", "nccl-tests", "nccom-test"] | None = None

    @model_validator(mode="before")
    @classmethod
    def _no_args(cls, data: object) -> object:
        if isinstance(data, dict) and "args" in data:
            raise ValueError("args is no key of [health] any more: the probe's options are keys of their "
                             "own (instance_type, neuron_devices, gpus, min_free_gib, dcgm, bandwidth, "
                             "min_busbw_gbps)")
        return data

    def probes_idle_spares(self) -> bool:
        """Whether a run's idle spares are probed while it trains (``spare_probe_every_s``)."""
        return self.preflight and self.spare_probe_every_s > 0

    def pair_tool(self) -> str:
        """The link test's tool: ``link_tool``; else nccom-test on Trainium (``neuron_devices``,
        or a trn* ``instance_type``), nccl-tests on NVIDIA GPUs (``gpus``, or a p* or g*
        one), python -m health.allreduce elsewhere."""
        family = (self.instance_type or "").split(".")[0]
        if self.link_tool is not None:
            return self.link_tool
        if self.neuron_devices or family.startswith("trn"):
            return "nccom-test"
        return "nccl-tests" if self.gpus or family.startswith(("p", "g")) else "allreduce"

    def probe_args(self) -> tuple[str, ...]:
        """The options of ``python -m health`` these keys stand for."""
        out: list[str] = []
        for key, flag in (("instance_type", "--instance-type"), ("neuron_devices", "--neuron-devices"),
                          ("gpus", "--gpus"), ("min_free_gib", "--min-free-gib"),
                          ("min_busbw_gbps", "--min-busbw-gbps")):
            value = getattr(self, key)
            if value is not None:
                out += [flag, str(value)]
        out += ["--dcgm"] if self.dcgm else []
        out += ["--bandwidth"] if self.bandwidth else []
        return tuple(out)


class TelemetrySpec(BaseModel):
    model_config = MODEL_CONFIG
    mqtt_url: str | None = None
    # "node": the reference trainer's ranks of a node report through its local rank 0, one
    # message a heartbeat interval (trainer/telemetry.py, TSUP_TELEMETRY_AGGREGATE).
    aggregate: Literal["rank", "node"] = "rank"

    @field_validator("mqtt_url")
    @classmethod
    def _url(cls, v: str | None) -> str | None:
        if v is not None:
            parse_mqtt_url(v)
        return v


# trainer.checkpoint.every_steps = "auto" (and memory_every_steps, the memory tier's):
# the supervisor sets the interval at each attempt by the Young/Daly rule
# (supervisor/planning.py, policy.failures_per_node_day), each tier from its own cost.
AUTO = "auto"

class CurvesSpec(BaseModel):
    """Where people see the run's own curves: a TensorBoard logdir and a link (W&B, MLflow).
    Placeholders: {run_id}, {run_dir}, {checkpoint_dir}, {job_id} (the Slurm job the run's
    nodes are in; a value that needs it is shown once the run has one)."""

    model_config = MODEL_CONFIG
    tensorboard: Annotated[str, Field(min_length=1, max_length=4096)] | None = None
    url: Annotated[str, Field(pattern=r"^https?://[^\s]+$", max_length=4096)] | None = None

    @field_validator("tensorboard", "url")
    @classmethod
    def _placeholders(cls, v: str | None) -> str | None:
        if v is not None:
            try:
                v.format(run_id="", run_dir="", checkpoint_dir="", job_id="")
            except KeyError as e:
                raise ValueError(f"{{{e.args[0]}}} is no placeholder (they are {{run_id}}, {{run_dir}}, "
                                 "{checkpoint_dir}, {job_id})") from None
            except (IndexError, ValueError) as e:
                raise ValueError(f"not a template: {e} (a brace itself is written twice)") from None
        return v


class RunSpec(BaseModel):
    model_config = MODEL_CONFIG
    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")]
    # The user the trainers execute as (absent: the daemon config's run_as, else the
    # daemon's own user; supervisor/users.py). Filled in at submit.
    user: Annotated[str, Field(pattern=r"^[a-z_][a-z0-9_.-]{0,31}$")] | None = None
    resources: ResourcesSpec = ResourcesSpec()
    trainer: dict[str, Any] | None = None  # the reference trainer's config ...
    command: CommandSpec | None = None  # ... or a trainer the supervisor did not write
    policy: PolicySpec = PolicySpec()
    telemetry: TelemetrySpec = TelemetrySpec()
    health: HealthSpec = HealthSpec()
    curves: CurvesSpec = CurvesSpec()
    # Trainer-side faults for chaos drills (``--chaos crash@25``), handed to the reference
    # trainer as TSUP_FAULT in every attempt (trainer/faults.py).
    chaos: list[Annotated[str, Field(pattern=r"^[a-z][a-z-]*@[0-9]+(:[0-9]+)?$")]] = []

    @model_validator(mode="before")
    @classmethod
    def _no_nul_bytes(cls, data: Any) -> Any:
        """No argument, variable or path can carry a NUL byte (TOML can, as ``\\u0000``):
        a spec holding one could never be launched, so it is refused here, by its key."""
        where = _nul_at(data, "")
        if where is not None:
            raise ValueError(f"{where}: holds a NUL byte (\\u0000), which no command line, environment "
                             "variable or path can carry")
        return data

    @model_validator(mode="after")
    def _trainer_keys_the_supervisor_reads(self) -> RunSpec:
        if (self.trainer is None) == (self.command is None):
            raise ValueError("give either a [trainer] table (the reference trainer) or a [command] table "
                             "(any other trainer), not both or neither")
        if self.resources.standby and self.command is not None:
            raise ValueError("resources.standby: only the reference trainer ([trainer]) can wait as a "
                             "standby; a [command] is started cold")
        if self.trainer is None:
            return self
        steps = self.trainer.get("steps")
        if isinstance(steps, bool) or not isinstance(steps, int) or not 0 < steps <= 10**12:
            raise ValueError("trainer.steps: expected a positive integer (at most 10**12)")
        ck = self.trainer.get("checkpoint", {})
        if not isinstance(ck, dict):
            raise ValueError("trainer.checkpoint: expected a table")
        if not isinstance(ck.get("dir", ""), str):
            raise ValueError("trainer.checkpoint.dir: expected a path (a string)")
        for key in ("every_steps", "memory_every_steps"):
            if isinstance(ck.get(key), str) and ck[key] != AUTO:
                raise ValueError(f"trainer.checkpoint.{key}: expected a number of steps or {AUTO!r}")
        if not isinstance(self.trainer.get("output_dir", ""), str):
            raise ValueError("trainer.output_dir: expected a path (a string)")
        return self

    @model_validator(mode="after")
    def _shrinking_can_happen(self) -> RunSpec:
        """``shrink_after_s`` must leave a node count to shrink to."""
        policy, nodes = self.policy, self.resources.nodes
        if policy.shrink_after_s <= 0:
            return self
        if policy.shrink_min_nodes >= nodes:
            raise ValueError(f"policy.shrink_min_nodes: {policy.shrink_min_nodes} leaves no count below "
                             f"resources.nodes {nodes} to shrink to")
        counts = self.shrink_counts
        if counts is not None and not [k for k in counts if k >= policy.shrink_min_nodes]:
            why = ("the Neuron backend cannot reshard its checkpoints" if self.neuron_backend else
                   "no node count from shrink_min_nodes up splits trainer.global_batch_size over its ranks "
                   "(and micro-batches)")
            raise ValueError(f"policy.shrink_after_s: this run cannot go on with fewer nodes: {why}")
        return self

    @property
    def auto_checkpoints(self) -> bool:
        """The reference trainer's checkpoint interval is the supervisor's to set."""
        return self.trainer is not None and self.trainer.get("checkpoint", {}).get("every_steps") == AUTO

    @property
    def auto_memory_checkpoints(self) -> bool:
        """... and so is its memory tier's."""
        ck = self.trainer.get("checkpoint", {}) if self.trainer is not None else {}
        return bool(ck.get("memory_every_steps") == AUTO)

    @property
    def data_skip_unit(self) -> str | None:
        """How the trainer steps over a spike's data: "samples" (the reference trainer, by
        its stream's positions), "steps" (a [command] naming ``{skip_to_step}``), or None
        (it cannot: a spike is rolled back once, then only reported)."""
        if self.command is None:
            return "samples"
        return "steps" if self.command.skips_data else None

    @property
    def exit_meanings(self) -> Mapping[int, ExitMeaning]:
        """What the trainer means by its exit codes (supervisor/policy/attribution.py)."""
        return self.command.exit_meanings if self.command is not None else TSUP_EXIT_CODES

    @property
    def neuron_backend(self) -> bool:
        """The reference trainer on Neuron (``backend = "neuron"``): one torchrun per node."""
        return self.trainer is not None and self.trainer.get("backend") == "neuron"

    @property
    def handles_usr1(self) -> bool:
        """The trainer saves a checkpoint on SIGUSR1: the reference trainer does, but not
        under torchrun (its Neuron backend), which SIGUSR1 would end; a command only
        when it says so."""
        return self.command.handles_usr1 if self.command is not None else not self.neuron_backend

    @property
    def shrink_counts(self) -> tuple[int, ...] | None:
        """The node counts below ``resources.nodes`` that an attempt may shrink to (None:
        any). The reference trainer keeps its global batch on fewer ranks by more
        accumulation, so the batch must split evenly over the ranks and micro-batches
        (trainer.config.split_batch, the trainer's own rule). Its Neuron backend cannot
        reshard. A [command] that opts
        in to shrinking (policy.shrink_after_s) handles its own."""
        if self.trainer is None:
            return None
        if self.neuron_backend:
            return ()  # NxD's sharded (ZeRO-1) checkpoints are not resharded on load
        batch, micro = self.trainer.get("global_batch_size", 16), self.trainer.get("micro_batch_size")
        if (not isinstance(batch, int) or batch < 1
                or not (micro is None or (isinstance(micro, int) and micro >= 1))):
            return ()  # the trainer's own check says what is wrong

        def fits(nodes: int) -> bool:
            try:
                split_batch(batch, micro, nodes * self.resources.ranks_per_node, "the ranks")
            except ConfigError:
                return False
            return True
        return tuple(k for k in range(1, self.resources.nodes) if fits(k))

    @property
    def total_steps(self) -> int:
        if self.command is not None:
            return self.command.steps
        assert self.trainer is not None
        return int(self.trainer["steps"])

    def to_json(self) -> str:
        return json.dumps(self.model_dump(mode="json"), sort_keys=True)


def _nul_at(value: Any, where: str) -> str | None:
    """Where in ``value`` (the spec's tables, lists and strings) a NUL byte is first
    found: ``command.argv[2]``, ``command.env.NAME``; None where there is none."""
    if isinstance(value, str):
        return where if "\0" in value else None
    if isinstance(value, dict):
        for key, item in value.items():
            name = f"{where}.{key}" if where else str(key)
            if "\0" in str(key):
                return f"{where or 'spec'}: key {str(key)!r}"
            found = _nul_at(item, name)
            if found is not None:
                return found
    if isinstance(value, list):
        for k, item in enumerate(value):
            found = _nul_at(item, f"{where}[{k}]")
            if found is not None:
                return found
    return None


def parse_spec(data: dict[str, Any], source: str = "spec") -> RunSpec:
    try:
        return RunSpec.model_validate(data)
    except ValidationError as e:
        raise SpecError(f"{source}: " + "; ".join(_describe(err) for err in e.errors())) from e


def load_spec(path: str | Path) -> RunSpec:
    p = Path(path)
    try:
        data = tomllib.loads(p.read_text())
    except FileNotFoundError as e:
        raise SpecError(f"{p}: no such file") from e
    except (OSError, UnicodeDecodeError) as e:
        raise SpecError(f"{p}: cannot read: {e}") from e
    except tomllib.TOMLDecodeError as e:
        raise SpecError(f"{p}: not valid TOML: {e}") from e
    return parse_spec(data, str(p))


def spec_from_json(text: str) -> RunSpec:
    """A spec as the store holds it; SpecError when it no longer validates (a rule changed)."""
    try:
        return RunSpec.model_validate_json(text)
    except ValidationError as e:
        raise SpecError("; ".join(_describe(err) for err in e.errors())) from e


def _describe(err: Any) -> str:
    loc = ".".join(str(x) for x in err["loc"])
    kind, msg = err["type"], err["msg"]
    if kind == "extra_forbidden":
        return f"unknown key {loc!r}"
    if kind == "missing":
        return f"missing required key {loc!r}"
    if msg.startswith("Value error, "):
        msg = msg.removeprefix("Value error, ")
    return f"{loc}: {msg}" if loc else msg

"""What the reconciler's parts share: observing hands executing one ``Observed`` per run
each tick, and both use the run's memory between ticks.

observe.py, effects/, probes.py and recorder.py are independent siblings (an
import-linter contract): none imports another. What they must share lives here, one
layer below them:

- ``Observed``, ``Facts`` and ``GrantChanges``: a run as seen this tick, and what the
  executor records with the decision;
- ``RunMemory``: what this process remembers of each run and attempt between ticks (its
  validated spec, when a rank was first seen dead, a [command] trainer's output read so
  far, the short spikes already reported, ...). It has one owner, the reconciler, which
  hands it to the observer (which reads and notes) and the executor (which notes and
  forgets an attempt once it ended). None of it is durable: a restarted daemon rebuilds
  it from the store and what it observes;
- ``LaunchSpecs``: what starts an attempt, or what to look for of one after a restart:
  one description for both;
- ``ProbeSubmitter``: the probe scheduler as the executor sees it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from supervisor import trainer_cmd
from supervisor.checkpoint_scan import Verdict
from supervisor.domain import Attempt, AttemptObs, Node, NodeState, Run, RunView
from supervisor.errors import SpecError
from supervisor.launchers.base import Grant, LaunchSpec
from supervisor.output_progress import AttemptOutput
from supervisor.spec import RunSpec, spec_from_json
from supervisor.store import SqlStore
from supervisor.telemetry import TelemetryView
from wire import KEY_ENV, PASSWORD_ENV, USERNAME_ENV, attempt_key, attempt_login

# --- a run as seen this tick ------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class GrantChanges:
    """What a grant changes in the store's node records for one run."""

    info: str | None
    puts: tuple[Node, ...]  # node records to write
    added: tuple[str, ...]  # nodes the run holds now and did not before
    released: tuple[str, ...]  # nodes it held and holds no more


def grant_changes(known: list[Node], run_number: int, grant: Grant) -> GrantChanges:
    """Make the node records say what ``grant`` says the run holds (pure). A drained node
    stays drained; a node held no more is idle again."""
    by_name = {x.name: x for x in known}
    puts: list[Node] = []
    added: list[str] = []
    for name in grant.nodes:
        node = by_name.get(name)
        if node is not None and node.state is NodeState.DRAINED:
            continue  # ours, but out of service: it stays drained
        if node is None or node.run_number != run_number or node.state is not NodeState.ALLOCATED:
            puts.append(Node(name=name, state=NodeState.ALLOCATED, run_number=run_number))
            added.append(name)
    granted = set(grant.nodes)
    gone = [x for x in known if x.run_number == run_number and x.name not in granted
            and x.state is NodeState.ALLOCATED]
    puts.extend(Node(name=x.name, state=NodeState.IDLE) for x in gone)
    return GrantChanges(info=grant.info, puts=tuple(puts), added=tuple(added),
                        released=tuple(x.name for x in gone))


def allocation_after(known: list[Node], run_number: int, changes: GrantChanges | None) -> tuple[Node, ...]:
    """The run's nodes (drained ones included) once ``changes`` are recorded."""
    nodes = {x.name: x for x in known}
    for x in changes.puts if changes else ():
        nodes[x.name] = x
    return tuple(sorted((x for x in nodes.values() if x.run_number == run_number), key=lambda x: x.name))


@dataclass(slots=True, kw_only=True)
class Facts:
    """What observing learnt that the executor records with the decision."""

    grant: GrantChanges | None = None
    checkpoints: list[Verdict] = field(default_factory=list)  # the newest ok one, and newer failed ones
    out_of_range: list[Path] = field(default_factory=list)  # checkpoint directories no step column holds
    output_offsets: tuple[int, str] | None = None  # (attempt, how far its logs were read) to keep


@dataclass(slots=True, kw_only=True)
class Observed:
    """One run, as seen this tick."""

    run: Run
    spec: RunSpec | None  # None: the stored spec no longer validates (view.spec_error says why)
    run_dir: Path
    view: RunView
    obs: AttemptObs | None
    facts: Facts


# --- what is remembered between ticks ---------------------------------------------------


@dataclass(slots=True)
class AttemptMemory:
    """What this process remembers of one live attempt."""

    dead_since: dict[int, float] = field(default_factory=dict)  # rank -> when first seen dead
    # A [command] trainer's: (newest checkpoint step, when first seen, when last scanned).
    quiet: tuple[int, float | None, float] | None = None
    output: AttemptOutput = field(default_factory=AttemptOutput)  # its output read so far
    output_resumed: bool = False  # read on from the offsets the store kept (a restarted daemon)
    offsets_kept: tuple[float, dict[str, int]] = (0.0, {})  # when the store was last given them, and them
    # A resumed reference trainer's first step and the loss an earlier attempt reported for
    # it (``expected_known``: looked up once; None: the check does not hold).
    expected: tuple[int, float] | None = None
    expected_known: bool = False
    heard: float | None = None  # when any of its ranks was last heard
    back_at: float | None = None  # when heard again after all of them fell silent together
    spikes_said: set[int] = field(default_factory=set)  # first steps of the short spikes reported


class RunMemory:
    """Each run's and live attempt's memory between ticks (see the module docstring)."""

    def __init__(self, store: SqlStore) -> None:
        self.store = store
        self._specs: dict[int, tuple[RunSpec | str, Path]] = {}  # run -> its spec (or why it is invalid)
        self._attempts: dict[tuple[int, int], AttemptMemory] = {}
        self._allocated: dict[int, list[str]] = {}  # run -> nodes an allocation gave it since the last look
        self._out_of_range: set[tuple[int, str]] = set()  # (run, path) of checkpoints said to be out of range

    def spec(self, number: int) -> tuple[RunSpec | str, Path]:
        """The run's stored spec, validated once; or why it no longer validates."""
        if number not in self._specs:
            with self.store.tx() as tx:
                text, run_dir = tx.run_spec_and_dir(number)
            try:
                self._specs[number] = (spec_from_json(text), run_dir)
            except SpecError as e:
                self._specs[number] = (str(e), run_dir)
        return self._specs[number]

    def keep_specs(self, numbers: set[int]) -> None:
        """Forget the specs of runs no longer reconciled."""
        for number in [n for n in self._specs if n not in numbers]:
            del self._specs[number]

    def attempt(self, run_number: int, attempt: int) -> AttemptMemory:
        key = (run_number, attempt)
        memory = self._attempts.get(key)
        if memory is None:
            memory = self._attempts[key] = AttemptMemory()
        return memory

    def forget_attempt(self, run_number: int, attempt: int) -> None:
        """The attempt ended: nothing of it is needed any more."""
        self._attempts.pop((run_number, attempt), None)

    def note_allocated(self, run_number: int, nodes: tuple[str, ...]) -> None:
        """Nodes an allocation just gave the run: newly allocated in its next view."""
        self._allocated.setdefault(run_number, []).extend(nodes)

    def take_allocated(self, run_number: int) -> tuple[str, ...]:
        """The nodes noted since the last look, once."""
        return tuple(self._allocated.pop(run_number, ()))

    def note_out_of_range(self, run_number: int, path: Path) -> bool:
        """True the first time ``path`` is seen out of range (to say so once)."""
        key = (run_number, str(path))
        if key in self._out_of_range:
            return False
        self._out_of_range.add(key)
        return True


# --- what starts an attempt ---------------------------------------------------------------


class LaunchSpecs:
    """Each attempt's LaunchSpec: the trainer command (supervisor/trainer_cmd.py) and the
    telemetry settings its ranks get (the broker, and the attempt's own key and login)."""

    def __init__(self, telemetry: TelemetryView, *, mqtt_url: str | None,
                 mqtt_ca_file: Path | None = None) -> None:
        self.telemetry = telemetry
        self.mqtt_url = mqtt_url
        self.mqtt_ca_file = mqtt_ca_file

    def of(self, run: Run, spec: RunSpec, run_dir: Path, a: Attempt,
           skip_to_step: int | None = None) -> LaunchSpec:
        """``skip_to_step``: the step of the data stream the attempt's first step reads (None:
        the one after its checkpoint's)."""
        config_path = trainer_cmd.config_path(run_dir, a.number)
        data_step = a.resume_step + 1 if skip_to_step is None else skip_to_step
        env = {**trainer_cmd.attempt_env(spec, run_dir, data_step, precompile=a.precompile is not None),
               **trainer_cmd.attempt_ids(run.run_id, a.number)}
        if self.mqtt_url:
            env["TSUP_MQTT_URL"] = self.mqtt_url
            env["TSUP_CLUSTER"] = self.telemetry.cluster
            if self.mqtt_ca_file is not None:
                env["TSUP_MQTT_CA_FILE"] = str(self.mqtt_ca_file)
            secret, cluster, run_id = self.telemetry.secret, self.telemetry.cluster, run.run_id
            if secret is not None:  # the attempt's key (and login): its ranks' environment only
                env[KEY_ENV] = attempt_key(secret, cluster, run_id, a.number).hex()
                if self.telemetry.broker_logins:
                    env[USERNAME_ENV], env[PASSWORD_ENV] = attempt_login(secret, cluster, run_id, a.number)
        return LaunchSpec(
            run_id=run.run_id, attempt=a.number, nodes=a.nodes, ranks_per_node=run.ranks_per_node,
            argv=trainer_cmd.attempt_argv(spec, run_dir, a.number, a.resume_from, a.resume_step, data_step),
            env=env,
            log_dir=trainer_cmd.attempt_dir(run_dir, a.number), marker=str(config_path),
            allocation_info=run.allocation_info, user=spec.user, cwd=trainer_cmd.attempt_cwd(spec, run_dir),
            srun_args=trainer_cmd.attempt_srun_args(spec), launch=trainer_cmd.launch_mode(spec),
            trusted_dir=run_dir.parent,
        )


class ProbeSubmitter(Protocol):
    """The probe scheduler (supervisor/probes.py), as the executor uses it."""

    sweep_args: tuple[str, ...]
    sweep_timeout_s: float

    def submit(self, *, run_number: int | None, kind: str, nodes: list[str], argv: tuple[str, ...],
               timeout_s: float, round_: int = 1, allocation_info: str | None = None,
               drained: Mapping[str, str] | None = None) -> None: ...

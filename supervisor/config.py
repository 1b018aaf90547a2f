"""The daemon's own configuration: a TOML file, environment overrides, then flags.

``load_service_config(path, environ)`` reads the file (optional), applies every
``TSUP_<KEY>`` variable of the environment on top (``TSUP_API_BIND=0.0.0.0:8470``),
validates the result and returns a ``ServiceConfig``; the command line's flags
override that again (``cli.py``). Every error names the key and where it came from:
``/etc/training-supervisor/config.toml: api_bind: expected HOST:PORT, got '8470'``.

    state_dir = "/var/lib/training-supervisor"   # SQLite, run directories, lock, token
    api_bind = "127.0.0.1:8470"                  # HOST:PORT; "" for no API
    mqtt_url = "mqtts://tsup:secret@broker:8883" # absent: the embedded broker
    mqtt_bind = "10.0.0.5"                       # embedded broker: HOST[:PORT] it listens on
                                                 # (absent: the address the nodes reach this
                                                 # host by; loopback for the local launcher)
    mqtt_advertise_url = "mqtt://10.0.0.5:1883"  # the URL ranks are told (absent: the
                                                 # broker's own), with their credentials
    mqtt_ca_file = "/etc/ssl/certs/broker-ca.pem"  # mqtts:// brokers: the CA (absent: system's)
    cluster_id = "trn-west"                      # in every topic (absent: a fingerprint of
                                                 # state_dir); two daemons on one broker differ
    run_as = "train"                             # runs execute as (absent: the daemon's user)
    allow_root_runs = false                      # a run executing as root is refused
    run_users = ["alice", "bob"]                 # who a spec's user may name (absent: any
                                                 # account with uid >= UID_MIN and a login shell)
    shared_dir = "/fsx/training-supervisor"      # run logs and checkpoints, on every node
                                                 # (absent: state_dir, one host only)
    checkpoint_roots = ["/fsx/ubuntu"]           # runs' checkpoints outside shared_dir: the
                                                 # unit's ReadWritePaths (install-controller)
    slurm_admin_prefix = ["sudo", "-n", "/usr/local/libexec/training-supervisor/node-admin"]
                                                 # before scontrol drain/resume (README)
    runs_share_admin_rights = false              # runs may execute as the daemon's user even
                                                 # with slurm_admin_prefix (one tenant only)
    hyperpod = false                             # SageMaker HyperPod: a node to repair is set
                                                 # FAIL with Reason "Action:Replace" or
                                                 # "Action:Reboot", HyperPod's own words
    launcher = "slurm"                           # or "local" (simulated nodes)
    slurm_conf = "/etc/slurm/slurm.conf"         # absent: SLURM_CONF or Slurm's default
    slurm_bin_dir = "/opt/slurm/bin"             # Slurm's commands (absent: on PATH)
    node_python = "/fsx/training-supervisor/node/bin/python"  # the node side's interpreter
                                                 # on every node: probes, agents (absent:
                                                 # the daemon's own, at the same path)
    tick_s = 0.25                                # reconcile period
    sweep_every_s = 900                          # probe idle and drained nodes; 0: never
    sweep_args = ["--instance-type", "trn1.32xlarge"]
    return_after = 3                             # clean sweeps in a row that return a node this
                                                 # daemon drained (0: only an operator does)
    drains_per_window = 8                        # nodes this daemon drains of its own accord,
    drain_window_s = 3600                        # at most, in this long (past it: held)
    log_format = "text"                          # or "json": one object per line
    api_token_file = "/etc/training-supervisor/api-token"  # absent: <state_dir>/api-token
    tls_cert = "/etc/training-supervisor/tls.crt"          # both: the API speaks HTTPS
    tls_key = "/etc/training-supervisor/tls.key"

    [[notify]]                                   # webhooks (supervisor/webhooks.py), any number
    name = "oncall"
    url_file = "/etc/training-supervisor/oncall-webhook"
    format = "slack"                             # or "json"
    kinds = ["run.failed", "node.drained"]
"""

from __future__ import annotations

import ipaddress
import json
import os
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from supervisor.errors import SpecError
from supervisor.telemetry.broker import check_bind
from supervisor.webhooks import Webhook
from wire import check_cluster_id, parse_broker_url

ENV_PREFIX = "TSUP_"


def default_state_dir() -> Path:
    """Where a daemon keeps its state when nothing says otherwise ($XDG_STATE_HOME)."""
    base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base) / "training-supervisor"


class ServiceConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    state_dir: Path | None = None  # None: the user's default (default_state_dir)
    api_bind: str = "127.0.0.1:8470"
    mqtt_url: str | None = None
    mqtt_bind: str | None = None
    mqtt_advertise_url: str | None = None
    mqtt_ca_file: Path | None = None
    cluster_id: str | None = None
    # Least privilege (supervisor/users.py): who runs execute as when a spec names no one,
    # whether one may execute as root, and where run directories (logs, checkpoints) go.
    run_as: Annotated[str, Field(pattern=r"^[a-z_][a-z0-9_.-]{0,31}$")] | None = None
    allow_root_runs: bool = False
    run_users: list[Annotated[str, Field(pattern=r"^[a-z_][a-z0-9_.-]{0,31}$")]] | None = None
    shared_dir: Path | None = None  # None: the state directory (one host only)
    # Where runs keep checkpoints outside shared_dir (/fsx): the daemon moves checkpoints
    # there (a rollback's set-aside, a precompile pass), so the unit's ReadWritePaths name
    # them; scripts/install-controller writes them from here. The daemon reads none.
    checkpoint_roots: list[Path] = []
    # Put before the scontrol calls that need Slurm operator rights (drain, resume,
    # reservations) when the daemon's user has none, e.g. ["sudo", "-n"] (README).
    slurm_admin_prefix: list[Annotated[str, Field(min_length=1, max_length=200)]] = []
    runs_share_admin_rights: bool = False
    hyperpod: bool = False
    launcher: Literal["local", "slurm"] = "local"
    slurm_conf: str | None = None
    slurm_bin_dir: Path | None = None
    node_python: Path | None = None  # the node programs' interpreter on every node (None: the daemon's)
    tick_s: Annotated[float, Field(gt=0, le=60)] = 0.25
    sweep_every_s: Annotated[float, Field(ge=0, le=30 * 86_400)] = 900.0
    sweep_args: list[Annotated[str, Field(max_length=200)]] = []
    return_after: Annotated[int, Field(ge=0, le=1000)] = 3
    # The daemon's one drain budget: the nodes it drains of its own accord (faults, probes'
    # verdicts), whatever the run, at most this many in drain_window_s; a spec's own can
    # only be tighter. Past it a drain is held for an operator (an operator's drain never is).
    drains_per_window: Annotated[int, Field(ge=0, le=100_000)] = 8
    drain_window_s: Annotated[float, Field(gt=0, le=30 * 86_400)] = 3600.0
    log_format: Literal["text", "json"] = "text"
    api_token_file: Path | None = None
    tls_cert: Path | None = None
    tls_key: Path | None = None
    # Retention: raw step metrics and published events older than this are deleted (the
    # per-attempt stats, the loss curve, runs, attempts, faults and checkpoints never are).
    retention_metrics_days: Annotated[float, Field(gt=0, le=3650)] = 14.0
    retention_events_days: Annotated[float, Field(gt=0, le=3650)] = 90.0
    notify: list[Webhook] = []  # [[notify]] tables: webhooks

    @field_validator("notify")
    @classmethod
    def _names(cls, v: list[Webhook]) -> list[Webhook]:
        names = [h.name for h in v]
        if len(set(names)) != len(names):
            raise ValueError("two [[notify]] tables with one name: each keeps its own place in the event log")
        return v

    @model_validator(mode="after")
    def _tls_pair(self) -> ServiceConfig:
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("tls_cert and tls_key go together: give both, or neither for plain HTTP")
        if self.api_bind and self.tls_cert is None and not _loopback(parse_bind(self.api_bind)[0]):
            raise ValueError(f"api_bind: {self.api_bind} is reachable from the network and the API has no "
                             "TLS (tls_cert, tls_key): its tokens would cross the network in clear; set "
                             "both, or bind 127.0.0.1 (behind a TLS proxy)")
        return self

    @field_validator("api_bind")
    @classmethod
    def _bind(cls, v: str) -> str:
        if v:
            parse_bind(v)
        return v

    @field_validator("mqtt_url", "mqtt_advertise_url")
    @classmethod
    def _mqtt(cls, v: str | None) -> str | None:
        if v is not None:
            parse_broker_url(v)
        return v

    @field_validator("slurm_bin_dir", "node_python")
    @classmethod
    def _absolute(cls, v: Path | None) -> Path | None:
        if v is not None and not v.is_absolute():
            raise ValueError(f"expected an absolute path, got {str(v)!r}")
        return v

    @field_validator("checkpoint_roots")
    @classmethod
    def _absolute_roots(cls, v: list[Path]) -> list[Path]:
        for p in v:
            cls._absolute(p)
        return v

    @field_validator("mqtt_bind")
    @classmethod
    def _mqtt_bind(cls, v: str | None) -> str | None:
        return None if v is None else check_bind(v)

    @field_validator("cluster_id")
    @classmethod
    def _cluster(cls, v: str | None) -> str | None:
        return None if v is None else check_cluster_id(v)

    @model_validator(mode="after")
    def _embedded_only(self) -> ServiceConfig:
        if self.mqtt_bind is not None and self.mqtt_url is not None:
            raise ValueError("mqtt_bind is where the embedded broker listens: leave it out with mqtt_url")
        return self


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a name: wherever it resolves, assume the network


def parse_bind(text: str) -> tuple[str, int]:
    """'127.0.0.1:8470' -> ('127.0.0.1', 8470); '[::1]:8470' -> ('::1', 8470)."""
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(f"expected HOST:PORT, for example 127.0.0.1:8470, got {text!r}")
    return host.strip("[]"), int(port)


def load_service_config(path: Path | None, environ: Mapping[str, str]) -> ServiceConfig:
    """The file's settings with the environment's ``TSUP_<KEY>`` overrides, validated."""
    values: dict[str, object] = {}
    source: dict[str, str] = {}
    if path is not None:
        try:
            data = tomllib.loads(path.read_text())
        except OSError as e:
            raise SpecError(f"{path}: cannot read the config: {e.strerror}") from e
        except tomllib.TOMLDecodeError as e:
            raise SpecError(f"{path}: not valid TOML: {e}") from e
        values.update(data)
        source.update(dict.fromkeys(data, str(path)))
    fields = ServiceConfig.model_fields
    for name, text in environ.items():
        if not name.startswith(ENV_PREFIX):
            continue
        key = name[len(ENV_PREFIX):].lower()
        if key not in fields:
            continue  # TSUP_CONFIG, supervisorctl's and the trainer's variables share the prefix
        values[key] = _from_env(key, text)
        source[key] = f"environment {name}"
    try:
        return ServiceConfig.model_validate(values)
    except ValidationError as e:
        problems = []
        for err in e.errors():
            key = ".".join(str(p) for p in err["loc"]) or "(config)"
            where = source.get(str(err["loc"][0]) if err["loc"] else "", str(path) if path else "config")
            message = err["msg"].removeprefix("Value error, ")
            if err["type"] == "extra_forbidden":
                message = f"unknown key (known: {', '.join(sorted(fields))})"
            problems.append(f"{where}: {key}: {message}")
        raise SpecError("\n".join(problems)) from None


def _from_env(key: str, text: str) -> object:
    """An environment value in the field's shape: lists as JSON or words, the rest as text."""
    if key == "sweep_args":
        try:
            parsed = json.loads(text)
        except ValueError:
            return text.split()
        return parsed
    return text

"""What starts an attempt, or what to look for of one after a restart: one description
for both (a ``LaunchSpec``)."""

from __future__ import annotations

import sys
from pathlib import Path

from supervisor.domain import Attempt, Run
from supervisor.launchers.base import LaunchSpec
from supervisor.runfiles import trainer_cmd
from supervisor.spec import RunSpec
from supervisor.telemetry.view import TelemetryView
from wire import KEY_ENV, PASSWORD_ENV, USERNAME_ENV, attempt_key, attempt_login, parse_broker_url


class LaunchSpecs:
    """Each attempt's LaunchSpec: the trainer command (supervisor/runfiles/trainer_cmd.py) and the
    telemetry settings its ranks get (the broker, and the attempt's own key and login)."""

    def __init__(self, telemetry: TelemetryView, *, mqtt_url: str | None,
                 mqtt_ca_file: Path | None = None, node_python: str = sys.executable) -> None:
        self.telemetry = telemetry
        self.mqtt_url = mqtt_url
        self.mqtt_ca_file = mqtt_ca_file
        self.node_python = node_python  # the supervisor's node programs' interpreter on the nodes

    def broker_probe_args(self) -> tuple[str, ...]:
        """The options of ``python -m health`` that prove, from each node, the broker its
        ranks will be told (health/broker.py); its address only, never a login."""
        if not self.mqtt_url:
            return ()
        b = parse_broker_url(self.mqtt_url)
        host = f"[{b.host}]" if ":" in b.host else b.host
        ca = ("--broker-ca", str(self.mqtt_ca_file)) if b.tls and self.mqtt_ca_file is not None else ()
        return ("--broker", f"{'mqtts' if b.tls else 'mqtt'}://{host}:{b.port}", *ca)

    def of(self, run: Run, spec: RunSpec, run_dir: Path, a: Attempt,
           skip_to_step: int | None = None) -> LaunchSpec:
        """``skip_to_step``: the step of the data stream the attempt's first step reads (None:
        the one after its checkpoint's)."""
        config_path = trainer_cmd.config_path(run_dir, a.number)
        data_step = a.resume_step + 1 if skip_to_step is None else skip_to_step
        env = {**trainer_cmd.attempt_env(spec, run_dir, data_step, precompile=a.precompile is not None),
               **trainer_cmd.attempt_ids(run.run_id, a.number)}
        if "TSUP_PYTHON" in env:  # the compile cache's sync runs on the node (trainer_cmd)
            env["TSUP_PYTHON"] = self.node_python
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

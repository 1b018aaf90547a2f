"""`training-supervisor`: the daemon (`serve`) and the foreground runner (`run`).

    training-supervisor run SPEC.toml [--state-dir DIR] [--chaos KIND@STEP ...] [--json]
    training-supervisor serve [--state-dir DIR] [--api-bind HOST:PORT] [--mqtt-url URL]
    training-supervisor advise --nodes N --checkpoint-s S [--step-time-s S] [--json]
    training-supervisor token issue|revoke|list [USER] [--operator] [--json]

`advise` prints the Young/Daly checkpoint interval for a job (supervisor/planning.py);
`token` issues people their own API tokens (cli/tokens.py).

Exit codes: 0 the run succeeded (run), a clean shutdown (serve), or advice printed
(advise); 1 the run failed or was cancelled, or the daemon stopped on an error; 2 bad
input (usage, spec, flags, state directory in use); 130 interrupted.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import faulthandler
import json
import logging
import os
import shlex
import signal
import sys
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path

from pydantic import ValidationError

from api.app import daemon_app
from cli import tokens
from supervisor import logs, planning, report
from supervisor.chaos import TRAINER_KINDS, ChaosAction, ChaosMonkey, parse_chaos, trainer_faults
from supervisor.config import ServiceConfig, default_state_dir, load_service_config, parse_bind
from supervisor.daemon import Daemon, DaemonSettings
from supervisor.domain import TERMINAL_RUN_STATES, CommandKind, DrainBudget
from supervisor.errors import SpecError, StateDirLocked, SupervisorError
from supervisor.launchers.base import ChaosHooks
from supervisor.recorder import Retention
from supervisor.runfiles import trainer_cmd
from supervisor.spec import load_spec
from supervisor.views import RunDetail

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130

log = logging.getLogger("training_supervisor")


# The chaos hooks of a Slurm cluster, from its SLURM_CONF: only a development box has them,
# and only its entry point hands them in (slurmbox/tsup.py); nothing kills a real node on request.
SlurmChaos = Callable[[str | None], ChaosHooks]


def main(argv: list[str] | None = None, *, slurm_chaos: SlurmChaos | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        if args.command == "run":
            return asyncio.run(_run(args, slurm_chaos))
        if args.command == "advise":
            return _advise(args)
        if args.command == "token":
            return tokens.run(args)
        return asyncio.run(_serve(args))
    except (SpecError, StateDirLocked) as e:
        print(f"training-supervisor: {e}", file=sys.stderr)
        return EXIT_USAGE
    except SupervisorError as e:
        print(f"training-supervisor: {e}", file=sys.stderr)
        return EXIT_FAILED
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="training-supervisor", description=__doc__.split("\n\n")[0])
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging on stderr")
    sub = parser.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="supervise one run in the foreground, then exit")
    run.add_argument("spec", type=Path, help="the run spec (TOML)")
    run.add_argument("--state-dir", type=Path, default=None,
                     help=f"SQLite, checkpoints and logs (default {default_state_dir()})")
    run.add_argument("--chaos", action="append", default=[], metavar="KIND@STEP[:TARGET]",
                     help="inject a fault (repeatable): kill-rank, kill-node, freeze-node, hang-rank@STEP, "
                          "corrupt-ckpt@STEP from outside; crash@STEP, nan@STEP, spike@STEP:LEN, "
                          "slow@STEP[:RANK], device@STEP[:RANK], kill-in-save@STEP[:RANK], "
                          "tamper-ckpt@STEP[:RANK], slow-save@STEP[:MBPS] in the trainer")
    run.add_argument("--json", action="store_true", help="print one JSON summary object on stdout")
    run.add_argument("--quiet", action="store_true", help="no progress on stderr")
    run.add_argument("--launcher", choices=("local", "slurm"), default=None,
                     help="where the ranks run (default: the spec's resources.launcher); slurm uses the "
                          "cluster SLURM_CONF names")
    run.add_argument("--api-port", type=int, default=0,
                     help="serve the API on 127.0.0.1:PORT while running (0: any free port, -1: none)")
    run.add_argument("--local-nodes", type=int, default=64, metavar="N",
                     help="the local launcher's cluster size: it simulates at most N nodes (default 64); "
                          "a run that loses nodes beyond them has no new ones to get")

    advise = sub.add_parser("advise", help="how often to checkpoint: the Young/Daly interval for a job")
    advise.add_argument("--nodes", type=int, required=True, help="nodes the job trains on")
    advise.add_argument("--checkpoint-s", type=float, required=True, help="what one checkpoint costs the job")
    advise.add_argument("--step-time-s", type=float, default=None, help="also give the interval in steps")
    advise.add_argument("--failures-per-node-day", type=float,
                        default=planning.LLAMA3_FAILURES_PER_NODE_DAY,
                        help="the cluster's interruption rate (default: Llama 3's, 419 in 54 days on 2,048 "
                             "nodes)")
    advise.add_argument("--json", action="store_true", help="print one JSON object")
    tokens.add_parser(sub)

    serve = sub.add_parser(
        "serve", help="run the daemon until SIGTERM",
        description="Settings come from --config (or TSUP_CONFIG), then TSUP_<KEY> environment "
                    "variables, then these flags, each overriding the one before (supervisor/config.py).")
    serve.add_argument("--config", type=Path, default=None, metavar="FILE",
                       help="the daemon's TOML config (default: TSUP_CONFIG, else none)")
    serve.add_argument("--state-dir", type=Path, default=None,
                       help=f"SQLite, checkpoints and logs (default {default_state_dir()})")
    serve.add_argument("--api-bind", default=None, metavar="HOST:PORT",
                       help="where the API listens (default 127.0.0.1:8470)")
    serve.add_argument("--mqtt-url", default=None,
                       help="an external MQTT broker, mqtt://HOST:PORT (default: an embedded one)")
    serve.add_argument("--no-api", action="store_true", help="do not serve the API")
    serve.add_argument("--launcher", choices=("local", "slurm"), default=None,
                       help="where runs go: simulated local nodes (default), or the Slurm cluster "
                            "SLURM_CONF names")
    serve.add_argument("--sweep-every", type=float, default=None, metavar="SECONDS",
                       help="probe idle nodes and the nodes this supervisor drained this often "
                            "(default 900; 0: never)")
    serve.add_argument("--sweep-args", default=None, metavar="ARGS",
                       help="extra arguments to the sweep's python -m health, "
                            "e.g. '--instance-type trn1.32xlarge'")
    serve.add_argument("--return-after", type=int, default=None, metavar="N",
                       help="return a node this supervisor drained to service after N clean sweep probes "
                            "in a row (default 3; 0: never, an operator does)")
    serve.add_argument("--log-format", choices=("text", "json"), default=None,
                       help="text (default) or json: one object per line, for journald and log shippers")
    return parser


# --- advise -------------------------------------------------------------------------


def _advise(args: argparse.Namespace) -> int:
    if args.nodes < 1 or args.checkpoint_s < 0 or args.failures_per_node_day <= 0 or (
            args.step_time_s is not None and args.step_time_s <= 0):
        raise SpecError("--nodes >= 1, --checkpoint-s >= 0, --failures-per-node-day > 0, --step-time-s > 0")
    rate = args.failures_per_node_day / 86_400
    mtbf = planning.job_mtbf_s(args.nodes, rate)
    every = planning.young_daly_interval_s(args.checkpoint_s, mtbf)
    steps = (planning.advise_every_steps(args.checkpoint_s, args.step_time_s, args.nodes, rate)
             if args.step_time_s else None)
    doc = {"nodes": args.nodes, "failures_per_node_day": args.failures_per_node_day,
           "job_mtbf_s": round(mtbf, 1), "checkpoint_s": args.checkpoint_s,
           "checkpoint_every_s": round(every, 1), "checkpoint_every_steps": steps}
    if args.json:
        print(json.dumps(doc))
    else:
        in_steps = f" (every {steps} steps of {args.step_time_s:g} s)" if steps else ""
        print(f"job MTBF {mtbf / 3600:.2f} h on {args.nodes} nodes; a {args.checkpoint_s:g} s checkpoint is "
              f"best taken every {every:.0f} s{in_steps}: sqrt(2 x checkpoint cost x MTBF), Young/Daly")
    return EXIT_OK


# --- serve --------------------------------------------------------------------------


_FLAGS = {"state_dir": "--state-dir", "api_bind": "--api-bind", "mqtt_url": "--mqtt-url",
          "launcher": "--launcher", "sweep_every_s": "--sweep-every", "sweep_args": "--sweep-args",
          "return_after": "--return-after", "log_format": "--log-format"}


def serve_settings(args: argparse.Namespace, environ: Mapping[str, str]) -> tuple[DaemonSettings, str]:
    """The daemon's settings: the config file, the environment, then the flags. Also the
    log format."""
    path = args.config or (Path(environ["TSUP_CONFIG"]) if environ.get("TSUP_CONFIG") else None)
    config = load_service_config(path, environ)
    flags: dict[str, object] = {
        "state_dir": args.state_dir, "api_bind": args.api_bind, "mqtt_url": args.mqtt_url,
        "launcher": args.launcher, "sweep_every_s": args.sweep_every, "return_after": args.return_after,
        "log_format": args.log_format,
    }
    if args.sweep_args is not None:
        try:
            flags["sweep_args"] = shlex.split(args.sweep_args)
        except ValueError as e:
            raise SpecError(f"--sweep-args: {e}") from e
    if args.no_api:
        flags["api_bind"] = ""
    try:
        config = ServiceConfig.model_validate(
            {**config.model_dump(), **{k: v for k, v in flags.items() if v is not None}})
    except ValidationError as e:
        err = e.errors()[0]
        key = str(err["loc"][0]) if err["loc"] else ""
        msg = err["msg"].removeprefix("Value error, ")
        raise SpecError(f"{_FLAGS.get(key, key)}: {msg}" if key else msg) from None
    host, port = parse_bind(config.api_bind) if config.api_bind else ("127.0.0.1", None)
    settings = DaemonSettings(
        state_dir=config.state_dir or default_state_dir(), mqtt_url=config.mqtt_url, api_host=host,
        api_port=port, launcher=config.launcher, slurm_conf=config.slurm_conf,
        slurm_bin_dir=config.slurm_bin_dir, tick_s=config.tick_s,
        sweep_every_s=config.sweep_every_s or None, sweep_args=tuple(config.sweep_args),
        return_after=config.return_after, api_token_file=config.api_token_file,
        drain_budget=DrainBudget(per_window=config.drains_per_window, window_s=config.drain_window_s),
        mqtt_bind=config.mqtt_bind, mqtt_advertise_url=config.mqtt_advertise_url,
        mqtt_ca_file=config.mqtt_ca_file,
        cluster_id=config.cluster_id, run_as=config.run_as, allow_root_runs=config.allow_root_runs,
        run_users=tuple(config.run_users) if config.run_users is not None else None,
        shared_dir=config.shared_dir, slurm_admin_prefix=tuple(config.slurm_admin_prefix),
        runs_share_admin_rights=config.runs_share_admin_rights,
        hyperpod=config.hyperpod,
        retention=Retention(metrics_days=config.retention_metrics_days,
                            events_days=config.retention_events_days),
        tls_cert=config.tls_cert, tls_key=config.tls_key, notify=tuple(config.notify),
        node_python=str(config.node_python or sys.executable),
    )
    return settings, config.log_format


# A stop still going after this long ends the process (systemd's TimeoutStopSec is 30):
# whatever holds it (a tick that does not return, a connection that does not close) is
# logged, and the process ends with status 1, as a SIGKILL would end it, losing as little.
STOP_WITHIN_S = 20.0


async def _serve(args: argparse.Namespace) -> int:
    settings, log_format = serve_settings(args, os.environ)
    logs.configure(log_format, logging.DEBUG if args.verbose else logging.INFO)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()

    def on_stop() -> None:
        if not stop.is_set():
            _stop_deadline(loop, EXIT_FAILED)
        stop.set()

    _on_signals(on_stop, on_stop)
    async with Daemon(settings, api=daemon_app) as daemon:
        print(f"training-supervisor: serving {settings.state_dir}"
              + (f", API on {daemon.api_url}" if daemon.api_url else "")
              + f", MQTT {daemon.mqtt_url}", file=sys.stderr, flush=True)
        await daemon.run(stop)
    return EXIT_OK


# --- run ----------------------------------------------------------------------------


async def _run(args: argparse.Namespace, slurm_chaos: SlurmChaos | None) -> int:
    spec = load_spec(args.spec)
    if args.launcher is not None and args.launcher != spec.resources.launcher:
        resources = spec.resources.model_copy(update={"launcher": args.launcher})
        spec = spec.model_copy(update={"resources": resources})
    chaos = [parse_chaos(c) for c in args.chaos]
    in_trainer = [str(c) for c in chaos if c.kind in TRAINER_KINDS]
    if in_trainer and spec.trainer is None:
        raise SpecError(f"--chaos {', '.join(in_trainer)}: only the reference trainer ([trainer]) "
                        "injects these")
    if spec.trainer is not None and (for_trainer := trainer_faults(chaos)):
        # validated again, as a stored spec will be when the reconciler reads it back
        spec = type(spec).model_validate({**spec.model_dump(), "chaos": [*spec.chaos, *for_trainer]})
    outside = [c for c in chaos if c.kind not in TRAINER_KINDS]
    needs_hooks = any(c.kind != "corrupt-ckpt" for c in outside)
    if needs_hooks and spec.resources.launcher == "slurm" and slurm_chaos is None:  # refused before a submit
        raise SpecError(f"--chaos {', '.join(str(c) for c in outside)} on Slurm: only a development "
                        "Slurm box can do that to its nodes (python -m slurmbox.tsup run ...)")
    state_dir: Path = args.state_dir or default_state_dir()
    trainer_cmd.check_trainer_config(spec, state_dir / "runs" / "run-check")
    settings = DaemonSettings(
        state_dir=state_dir, mqtt_url=spec.telemetry.mqtt_url,
        api_port=None if args.api_port < 0 else args.api_port, check_trainer_config=False,
        launcher=spec.resources.launcher, max_local_nodes=args.local_nodes,
        allow_root_runs=True,  # the trainer runs as whoever ran this (unless the spec names a user)
    )
    async with Daemon(settings, api=daemon_app) as daemon:
        assert daemon.service is not None and daemon.reconciler is not None
        summary = daemon.service.submit(spec)
        run_id = summary.run_id
        number = int(run_id.removeprefix("run-"))
        out = _Progress(daemon, run_id, quiet=args.quiet)
        out.say(f"{run_id} submitted; state in {state_dir}"
                + (f"; API on {daemon.api_url}" if daemon.api_url else ""))
        hooks = None
        if needs_hooks:
            slurm = daemon.cluster.slurm
            hooks = slurm_chaos(slurm.commands.slurm_conf) if slurm_chaos and slurm else daemon.cluster.chaos
        monkey = ChaosMonkey(outside, number, daemon.store, hooks, daemon.telemetry, daemon.reconciler,
                             trainer_cmd.checkpoint_dir(spec, state_dir / "runs" / run_id))
        daemon.reconciler.hooks.append(monkey.poll)  # on the reconciler's thread, before each tick
        stop = asyncio.Event()
        interrupted = asyncio.Event()

        def cancel() -> None:
            if interrupted.is_set():
                stop.set()  # a second signal: stop now, leave the trainers to a later daemon
                return
            interrupted.set()
            assert daemon.service is not None
            daemon.service.request(run_id, CommandKind.CANCEL)
            out.say("interrupted: cancelling the run (again to quit at once)")

        _on_signals(cancel, cancel)
        task = asyncio.create_task(daemon.run(stop), name="daemon")
        code: int | None = None  # the run's exit status, once said
        try:
            while not task.done():
                if await asyncio.to_thread(out.poll):  # its reads off the loop that hears the nodes
                    # The run is over: said before the daemon stops, so that a stop that
                    # hangs (ended by the deadline below) does not cost the run's summary.
                    code = _say_result(args, daemon.service.get_run(run_id), chaos, interrupted.is_set())
                    break
                await asyncio.sleep(0.2)
        finally:
            monkey.heal_all()  # no link is left cut behind the run
            deadline = _stop_deadline(asyncio.get_running_loop(), EXIT_FAILED if code is None else code)
            stop.set()
            try:
                await task
            finally:
                deadline.cancel()
        if code is None:  # the daemon stopped before the run was over
            code = _say_result(args, daemon.service.get_run(run_id), chaos, interrupted.is_set())
    return code


def _say_result(args: argparse.Namespace, detail: RunDetail, chaos: list[ChaosAction],
                interrupted: bool) -> int:
    """Print the run's summary (JSON with --json); its exit status."""
    if args.json:
        print(json.dumps(_summary_json(detail.model_dump(), chaos), indent=2), flush=True)
    elif not args.quiet:
        print(report.run_detail(detail), file=sys.stderr, flush=True)
    if interrupted and detail.state != "SUCCEEDED":
        return EXIT_INTERRUPTED
    return EXIT_OK if detail.state == "SUCCEEDED" else EXIT_FAILED


class _Progress:
    """Streams a run's events and a line of progress every few steps to stderr."""

    def __init__(self, daemon: Daemon, run_id: str, *, quiet: bool) -> None:
        assert daemon.service is not None
        self.service = daemon.service
        self.run_id = run_id
        self.quiet = quiet
        self.t0 = time.time()
        self.last_event = 0
        self.last_step_shown = 0

    def say(self, text: str) -> None:
        if not self.quiet:
            print(f"[+{time.time() - self.t0:6.1f}s] {text}", file=sys.stderr, flush=True)

    def poll(self) -> bool:
        """Print what is new; True once the run is over and its attempt torn down."""
        for e in self.service.events(self.run_id, self.last_event):
            self.last_event = e.id
            if not self.quiet:
                print(report.event_line(e, self.t0), file=sys.stderr, flush=True)
        run = self.service.summary(self.run_id)
        every = max(1, run.total_steps // 12)
        if run.step and run.step >= self.last_step_shown + every and run.state == "RUNNING":
            self.last_step_shown = run.step - run.step % every
            loss = f"{run.loss:.4f}" if run.loss is not None else "-"
            self.say(f"{self.run_id} step {run.step}/{run.total_steps} loss {loss}")
        settled = run.attempt_state in (None, "ENDED")
        return run.state in {s.value for s in TERMINAL_RUN_STATES} and settled


def _summary_json(d: dict[str, object], chaos: list[ChaosAction]) -> dict[str, object]:
    out = {
        "run_id": d["run_id"], "name": d["name"], "state": d["state"], "reason": d["reason"],
        "final_step": d["final_step"], "model_digest": d["model_digest"], "loss": d["loss"],
        "attempts": d["attempts"], "faults": d["faults"], "faults_total": d["faults_total"],
        "ettr": d["ettr"],
        "goodput": d["goodput"], "drained_nodes": d["drained_nodes"],
        "attempt_history": d["attempt_history"], "stragglers": d["stragglers"],
        "transient_spikes": d["transient_spikes"], "chaos": [str(c) for c in chaos],
    }
    return out


def _stop_deadline(loop: asyncio.AbstractEventLoop, code: int) -> threading.Timer:
    """Started as a stop begins: past STOP_WITHIN_S it ends the process with ``code``
    (``_stopped_too_slowly``); cancel it once the stop is done."""
    deadline = threading.Timer(STOP_WITHIN_S, _stopped_too_slowly, args=(loop, code))
    deadline.daemon = True
    deadline.start()
    return deadline


def _stopped_too_slowly(loop: asyncio.AbstractEventLoop, code: int) -> None:
    """The stop's deadline passed (on a timer's thread): say what held it, and end with
    ``code`` (``run``: the run's own status, its summary already printed)."""
    log.error("still stopping after %.0f s: ending the process now (the next start takes over what ran); "
              "the stacks of every thread and task follow on stderr", STOP_WITHIN_S)
    with contextlib.suppress(Exception):
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
    with contextlib.suppress(Exception):  # read from another thread: at best effort
        for task in list(asyncio.all_tasks(loop)):
            task.print_stack(limit=8, file=sys.stderr)
    with contextlib.suppress(Exception):
        sys.stderr.flush()
    os._exit(code)


def _on_signals(on_int: Callable[[], None], on_term: Callable[[], None]) -> None:
    """Signal handlers only set flags; the loops notice and act."""
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGINT, on_int)
    loop.add_signal_handler(signal.SIGTERM, on_term)


if __name__ == "__main__":
    sys.exit(main())

"""`supervisorctl`: the command-line client of a running training-supervisor.

    supervisorctl runs [-q]                     every run (-q: ids only)
    supervisorctl status RUN                    state, attempts, faults, checkpoints, goodput
    supervisorctl events RUN [--follow]         its event log (--follow: live, until it ends)
    supervisorctl submit SPEC.toml [--dry-run]  a new run
    supervisorctl pause|resume|restart|cancel RUN
    supervisorctl resume RUN --from-step N      go on from the checkpoint of step N
    supervisorctl resume RUN --force            resume though it would fail again as it did
    supervisorctl checkpoints RUN               the checkpoints it made or found
    supervisorctl logs RUN [--attempt N] [--rank R | --node NODE] [--follow]
                                                an attempt's log (rank 0's by default)
    supervisorctl goodput RUN                   where its wall-clock time went
    supervisorctl nodes [-q]                    every node, its state, drain reason, last probe
    supervisorctl drain NODE --reason TEXT      take a node out of service
    supervisorctl undrain NODE                  return it
    supervisorctl probe NODE [--wait S]         run the health probes on it; say what they found
    supervisorctl completion bash|zsh           a shell completion script

Every command takes --json (one JSON document; with events --follow, one object per
line). The daemon's address: --url, else $TSUP_URL, else the config file's ``url``,
else http://127.0.0.1:8470. Every command but completion needs a token: writes the
daemon's API token or your own, reads any token. The token is --token-file's,
else $TSUP_API_TOKEN (the token itself), else $TSUP_API_TOKEN_FILE's, else the config
file's ``token_file``'s, else your own ~/.config/training-supervisor/token (refused when
others may read it), else the first readable of api-token and then api-read-token in
/var/lib/training-supervisor and in the default state directory. The config file is $TSUP_CTL_CONFIG or
~/.config/training-supervisor/supervisorctl.toml (keys: url, token_file, ca_file; a CA
bundle for an HTTPS daemon with its own certificate; also $TSUP_CA_FILE).

Exit codes: 0 ok; 1 error (the daemon is unreachable, or refused or failed the
command); 2 usage or invalid input; 3 not found; 4 unauthorized (no token, or not the
daemon's).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import tomllib
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from pydantic import TypeAdapter

from cli.client import DEFAULT_URL, ApiError, Client
from cli.completion import completion_script
from cli.ctl_settings import UsageError, daemon_settings
from supervisor import report
from supervisor.domain.step import Step, rdzv_id
from supervisor.errors import SpecError
from supervisor.goodput import Goodput
from supervisor.logs import printable, printable_tree
from supervisor.runfiles import trainer_cmd
from supervisor.slurm import requests
from supervisor.spec import parse_spec
from supervisor.views import CheckpointView, EventView, NodeView, RunDetail, RunSummary

EXIT_OK, EXIT_ERROR, EXIT_USAGE, EXIT_NOT_FOUND, EXIT_UNAUTHORIZED = 0, 1, 2, 3, 4
_PAGE = 1000
_GOODPUT = TypeAdapter(Goodput)  # as the views: a field a newer daemon adds is passed over
_STATUS_EXIT = {404: EXIT_NOT_FOUND, 401: EXIT_UNAUTHORIZED, 403: EXIT_UNAUTHORIZED, 413: EXIT_USAGE,
                422: EXIT_USAGE}
RUN_COMMANDS = {"pause": "pause a run (its attempt stops; resume goes on from the newest checkpoint)",
                "resume": "resume a paused or failed run",
                "restart": "stop the live attempt and start another from the newest checkpoint",
                "cancel": "cancel a run"}


def main(argv: list[str] | None = None, environ: Mapping[str, str] | None = None) -> int:
    env = os.environ if environ is None else environ
    args = _parser().parse_args(argv)
    args.json = getattr(args, "json", False)
    if args.command == "completion":
        print(completion(args.shell))
        return EXIT_OK
    try:
        settings = daemon_settings(args, env)
        client = Client(settings["url"], token=settings["token"], verify=settings["verify"],
                        token_hint=settings["token_hint"])
    except UsageError as e:
        print(f"supervisorctl: {e}", file=sys.stderr)
        return EXIT_USAGE
    try:
        return int(args.handler(client, args))
    except ApiError as e:
        detail = "\n".join(printable(line) for line in str(e.detail).splitlines())  # its own lines kept
        print(f"supervisorctl: {detail}", file=sys.stderr)
        return _STATUS_EXIT.get(e.status, EXIT_ERROR)
    except UsageError as e:
        print(f"supervisorctl: {e}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        return 130
    finally:
        client.close()


def _parser() -> argparse.ArgumentParser:
    # Accepted before and after the subcommand; SUPPRESS keeps a subcommand's default
    # from overwriting a value given before it.
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--url", default=argparse.SUPPRESS,
                        help=f"the daemon's API (default $TSUP_URL, the config's url, or {DEFAULT_URL})")
    common.add_argument("--json", action="store_true", default=argparse.SUPPRESS,
                        help="machine-readable output")
    common.add_argument("--token-file", type=Path, default=argparse.SUPPRESS, metavar="FILE",
                        help="the daemon's API token (default: see supervisorctl --help)")
    common.add_argument("--config", type=Path, default=argparse.SUPPRESS, metavar="FILE",
                        help="supervisorctl's config (default $TSUP_CTL_CONFIG or "
                             "~/.config/training-supervisor/supervisorctl.toml)")
    parser = argparse.ArgumentParser(prog="supervisorctl", description=__doc__.split("\n\n")[0],
                                     epilog=__doc__.split("\n\n", 2)[2],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, parents=[common])
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def command(name: str, text: str, handler: Handler,
                **defaults: Any) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=text, description=text, parents=[common])
        p.set_defaults(handler=handler, **defaults)
        return p

    p = command("runs", "list runs", _runs)
    p.add_argument("-q", "--quiet", action="store_true", help="print run ids only")
    command("status", "show one run", _status).add_argument("run")
    p = command("events", "a run's event log", _events)
    p.add_argument("run")
    p.add_argument("--after", type=int, default=0, help="only events after this id")
    p.add_argument("--follow", "-f", action="store_true",
                   help="keep printing as they happen, until the run has ended (server-sent events)")
    p = command("submit", "submit a run spec (TOML)", _submit)
    p.add_argument("spec", type=Path)
    p.add_argument("--dry-run", action="store_true",
                   help="validate the spec and print what would run (sbatch, batch script, srun); "
                        "submit nothing")
    for kind, text in RUN_COMMANDS.items():
        p = command(kind, text, _run_command, kind=kind)
        p.add_argument("run")
        if kind == "resume":
            p.add_argument("--from-step", type=int, metavar="N", default=None,
                           help="go on from the complete checkpoint of step N (newer ones are set aside, "
                                "nothing deleted); default: the newest")
            p.add_argument("--force", action="store_true",
                           help="resume a run that failed to resume from its checkpoint though nothing the "
                                "job reads changed since (refused otherwise: it would fail the same way)")
        _wait_option(p)
    command("checkpoints", "a run's checkpoints", _checkpoints).add_argument("run")
    p = command("logs", "an attempt's log: rank 0's, a rank's or a node's", _logs)
    p.add_argument("run")
    p.add_argument("--attempt", type=int, metavar="N", help="default: the newest")
    whose = p.add_mutually_exclusive_group()
    whose.add_argument("--rank", type=int, metavar="R", help="rank R's output (its node's file where the "
                                                             "node's torchrun or train.sh writes it)")
    whose.add_argument("--node", metavar="NODE",
                       help="the node's output (train.sh's llama.out), or its first rank's")
    p.add_argument("--follow", "-f", action="store_true",
                   help="keep printing as it grows, until the attempt ends; without --attempt, on into the "
                        "run's next attempts until the run stops")
    command("goodput", "where a run's wall-clock time went", _goodput).add_argument("run")
    p = command("nodes", "list nodes, with their last probe", _nodes)
    p.add_argument("-q", "--quiet", action="store_true", help="print node names only")
    p = command("drain", "take a node out of service (a running attempt trains on; the next "
                         "leaves it out)", _node_command, kind="drain")
    p.add_argument("node")
    p.add_argument("--reason", required=True, help="why, for whoever looks at the node next")
    _wait_option(p)
    p = command("undrain", "return a drained node to service", _node_command, kind="undrain")
    p.add_argument("node")
    p.add_argument("--reason", default="", help="a note for the event log")
    _wait_option(p)
    p = command("probe", "run the health probes on a node (after any round that probes it now)", _probe)
    p.add_argument("node")
    _wait_option(p, default=90.0)
    p = sub.add_parser("completion", help="print a shell completion script",
                       description="eval \"$(supervisorctl completion bash)\", or put it in "
                                   "/etc/bash_completion.d/supervisorctl")
    p.add_argument("shell", choices=("bash", "zsh"))
    return parser


def _wait_option(p: argparse.ArgumentParser, default: float = 10.0) -> None:
    p.add_argument("--wait", type=float, default=default, metavar="SECONDS",
                   help=f"how long to wait for the daemon to act on it (default {default:g})")


# --- commands -----------------------------------------------------------------------


def _print_json(value: Any) -> None:
    print(json.dumps(value, indent=2))


Handler = Callable[[Client, argparse.Namespace], int]


def _show(path: Callable[[argparse.Namespace], str], render: Callable[[Any, argparse.Namespace], str],
          names: Callable[[Any], list[str]] | None = None) -> Handler:
    """A read command: GET ``path``, then print it as JSON, as names (-q), or rendered."""
    def handler(c: Client, args: argparse.Namespace) -> int:
        data = c.get(path(args))
        if args.json:
            _print_json(data)
        elif names is not None and args.quiet:
            print("\n".join(names(data)))
        else:
            print(render(printable_tree(data), args))
        return EXIT_OK

    return handler


_runs = _show(lambda a: "/v1/runs",
              lambda d, a: report.runs_table([RunSummary.model_validate(r) for r in d]),
              lambda d: [r["run_id"] for r in d])
_status = _show(lambda a: f"/v1/runs/{_segment(a.run)}",
                lambda d, a: report.run_detail(RunDetail.model_validate(d)))
_checkpoints = _show(lambda a: f"/v1/runs/{_segment(a.run)}/checkpoints",
                     lambda d, a: report.checkpoints_table([CheckpointView.model_validate(x) for x in d]))
_goodput = _show(lambda a: f"/v1/runs/{_segment(a.run)}/goodput",
                 lambda d, a: f"{a.run}: {report.goodput_line(_GOODPUT.validate_python(d))}")
_nodes = _show(lambda a: "/v1/nodes",
               lambda d, a: report.nodes_table([NodeView.model_validate(n) for n in d]),
               lambda d: [n["name"] for n in d])


def _events(c: Client, args: argparse.Namespace) -> int:
    """--json prints one array; with --follow, one JSON object per line as they come."""
    run = _segment(args.run)
    if args.follow:
        for e in c.stream_events(run, args.after):
            if args.json:
                print(json.dumps(e), flush=True)
            else:
                print(report.event_line(EventView.model_validate(printable_tree(e))), flush=True)
        return EXIT_OK
    everything: list[dict[str, Any]] = []
    after = args.after
    while page := c.get(f"/v1/runs/{run}/events", params={"after": after, "limit": _PAGE}):
        everything += page
        after = page[-1]["id"]
        if len(page) < _PAGE:
            break
    if args.json:
        _print_json(everything)
    else:
        for e in everything:
            print(report.event_line(EventView.model_validate(printable_tree(e))))
    return EXIT_OK


_STOPPED = {"SUCCEEDED", "FAILED", "CANCELLED", "PAUSED"}


def _logs(c: Client, args: argparse.Namespace) -> int:
    """Print the log; a trainer's bytes are shown safely (each redraw of a progress bar on a
    line of its own, control characters escaped). --json: one object, or with --follow one
    per piece read."""
    run, attempt, offset = _segment(args.run), args.attempt, 0
    whose = {k: v for k, v in (("rank", args.rank), ("node", args.node)) if v is not None}
    merged: dict[str, Any] | None = None
    while True:
        try:
            piece = c.get(f"/v1/runs/{run}/logs", params={**whose, "offset": offset, "max_bytes": 1 << 20,
                                                           **({"attempt": attempt} if attempt else {})})
        except ApiError as e:
            if not (args.follow and e.status == 404 and offset == 0):
                raise
            time.sleep(1.0)  # an attempt that has not written its log yet
            continue
        if attempt is None or piece["attempt"] != attempt:
            attempt, offset = piece["attempt"], 0
            if args.follow and not args.json:
                print(f"--- {piece['run_id']} attempt {attempt}, {piece['file']} ---", file=sys.stderr,
                      flush=True)
            continue
        offset = piece["next_offset"]
        if args.json and args.follow:
            print(json.dumps(piece), flush=True)
        elif args.json:
            merged = piece if merged is None else {**piece, "offset": merged["offset"],
                                                    "text": merged["text"] + piece["text"]}
        else:
            sys.stdout.write(_shown(piece["text"]))
            sys.stdout.flush()
        if offset < piece["size"]:
            continue  # more is there already
        if not args.follow:
            break
        if piece["attempt_state"] == "ENDED":
            if args.attempt is not None or piece["run_state"] in _STOPPED:
                break
            if c.get(f"/v1/runs/{run}")["attempts"] <= attempt:  # attempts are numbered 1, 2, ...
                time.sleep(1.0)
                continue
            attempt = None  # on to the newest
            continue
        time.sleep(1.0)
    if merged is not None:
        _print_json(merged)
    return EXIT_OK


def _shown(text: str) -> str:
    """A trainer's output for a terminal: \r redraws as lines, control characters escaped."""
    return "\n".join(printable(line) for line in text.replace("\r\n", "\n").replace("\r", "\n").split("\n"))


def _submit(c: Client, args: argparse.Namespace) -> int:
    try:
        spec = tomllib.loads(args.spec.read_text())
    except (OSError, UnicodeDecodeError) as e:
        raise UsageError(f"{args.spec}: cannot read: {e}") from e
    except tomllib.TOMLDecodeError as e:
        raise UsageError(f"{args.spec}: not valid TOML: {e}") from e
    if args.dry_run:
        return _dry_run(args, spec)
    run = c.post("/v1/runs", json={"spec": spec})
    if args.json:
        _print_json(run)
    else:
        print(f"{run['run_id']} submitted ({run['name']})")
    return EXIT_OK


def _dry_run(args: argparse.Namespace, data: dict[str, Any]) -> int:
    """Pure: nothing is asked of the daemon or of Slurm."""
    try:
        spec = parse_spec(data, str(args.spec))
    except SpecError as e:
        raise UsageError(str(e)) from e
    run_dir = Path("<state-dir>/runs/run-N")
    argv = trainer_cmd.attempt_argv(spec, run_dir, 1, None, 0)
    # What the ranks' environment adds, as the daemon builds it (observe.launch_spec) less
    # the telemetry's broker and key, which only the daemon knows.
    env = {**trainer_cmd.attempt_env(spec, run_dir), **trainer_cmd.attempt_ids("run-N", 1)}
    res = spec.resources
    launch = trainer_cmd.launch_mode(spec)
    precompiles = spec.command is not None and spec.command.precompiles
    if res.launcher == "slurm":
        def slurm_plan(env: dict[str, str]) -> dict[str, Any]:
            return requests.dry_run(
                job_name="tsup-<state-dir hash>.run-N.1", nodes=res.nodes, spares=res.spares,
                ranks_per_node=res.ranks_per_node, argv=argv, partition=res.partition,
                time_limit_min=res.time_limit_min, log_dir=run_dir, handles_usr1=spec.handles_usr1,
                cwd=trainer_cmd.attempt_cwd(spec, run_dir), srun_args=trainer_cmd.attempt_srun_args(spec),
                launch=launch, rdzv_id=rdzv_id("run-N", 1), env=env)

        plan: dict[str, Any] = {"launcher": "slurm", **slurm_plan(env)}
        if precompiles:  # the same step with precompile_env over its environment
            pre = slurm_plan({**trainer_cmd.attempt_env(spec, run_dir, precompile=True),
                              **trainer_cmd.attempt_ids("run-N", 1)})
            plan["precompile"] = {"srun": pre["srun"], "srun_env": pre["srun_env"]}
    else:
        step = Step(nnodes=res.nodes, nproc_per_node=res.ranks_per_node, master_addr="127.0.0.1",
                    master_port="<free port>", rdzv_id=rdzv_id("run-N", 1))
        argv = step.fill_all(argv)
        plan = {"launcher": "local", "launch": launch, "argv": list(argv),
                "processes": res.nodes * (1 if launch == "node" else res.ranks_per_node)}
    if args.json:
        _print_json(plan)
    elif res.launcher == "slurm":
        print(f"# the allocation: {res.nodes} node(s) to train on + {res.spares} hot spare(s)")
        print(requests.describe(plan["sbatch"]) + " <<'EOF'")
        print(plan["batch_script"] + "EOF")
        tasks = "one task per node" if launch == "node" else f"{res.ranks_per_node} task(s) per node"
        if precompiles:
            assert spec.command is not None
            over = " ".join(f"{k}={v}" for k, v in spec.command.precompile_env.items())
            print(f"# first, the job's precompile pass ({over}): once per run, and again only when its "
                  "inputs change; the same step:")
            print(requests.describe(plan["precompile"]["srun"], plan["precompile"]["srun_env"],
                                    one_per_line=True))
        print(f"# each attempt: a job step on {res.nodes} healthy node(s) of the allocation, {tasks};")
        print("# srun passes its environment on to every task (--export=ALL, Slurm's default)")
        print(requests.describe(plan["srun"], plan["srun_env"], one_per_line=True))
    else:
        print(f"# {plan['processes']} process(es) on this machine, one per {launch}, each running:")
        print(requests.describe(argv))
    return EXIT_OK


def _run_command(c: Client, args: argparse.Namespace) -> int:
    from_step = getattr(args, "from_step", None)
    if from_step is not None and from_step < 1:
        raise UsageError(f"--from-step must be a checkpoint's step (1 or more), not {from_step}")
    params: dict[str, object] = {"from_step": from_step} if from_step is not None else {}
    if getattr(args, "force", False):
        params["force"] = "true"
    accepted = c.post(f"/v1/runs/{_segment(args.run)}/{args.kind}", params=params or None)
    return _await_command(c, args, accepted, args.run)


def _node_command(c: Client, args: argparse.Namespace) -> int:
    accepted = c.post(f"/v1/nodes/{_segment(args.node)}/{args.kind}", json={"reason": args.reason})
    return _await_command(c, args, accepted, args.node)


def _await_command(c: Client, args: argparse.Namespace, accepted: dict[str, Any], target: str) -> int:
    """Wait up to --wait for the reconciler to carry the command out, and say what came of it."""
    result = _result(c, args, accepted)
    outcome = {"target": target, "command": args.kind, "command_id": accepted["command_id"],
               "result": result or "queued"}
    if args.json:
        _print_json(outcome)
    else:
        print(printable(f"{target}: {args.kind} {outcome['result']}"))
    return EXIT_ERROR if result is not None and result.startswith("rejected") else EXIT_OK


def _result(c: Client, args: argparse.Namespace, accepted: dict[str, Any]) -> str | None:
    """The command's result, waited for up to --wait (None: not carried out yet)."""
    deadline = time.monotonic() + args.wait
    while True:
        result: str | None = c.get(f"/v1/commands/{accepted['command_id']}")["result"]
        if result is not None or time.monotonic() >= deadline:
            return result
        time.sleep(0.2)


def _probe(c: Client, args: argparse.Namespace) -> int:
    """The probe is a queued command: its result once the daemon has it, and the findings
    of the node's last probe (the one it made)."""
    node = _segment(args.node)
    accepted = c.post(f"/v1/nodes/{node}/probe")
    result = _result(c, args, accepted)
    last = None
    if result is not None:
        last = next((n["last_probe"] for n in c.get("/v1/nodes") if n["name"] == args.node), None)
    if args.json:
        _print_json({"target": args.node, "command": "probe", "command_id": accepted["command_id"],
                     "result": result or "queued", "probe": last})
    elif last is None:
        print(printable(f"{args.node}: probe {result or 'queued'} (command {accepted['command_id']})"))
    else:
        p = printable_tree(last)
        why = f": {p['reason']}" if p["reason"] else ""
        print(f"{p['node']}: {p['status']} (action: {p['action']}){why}")
        for f in p["findings"]:
            print(f"  {f.get('probe', ''):<18} {f.get('status', ''):<9} {f.get('evidence', '')}")
    healthy = last is not None and last["status"] in ("healthy", "degraded")
    return EXIT_OK if healthy else EXIT_ERROR


def _segment(text: str) -> str:
    """A run id or node name as one path segment: nothing that could change the path."""
    if not text or any(ch in text for ch in "/?#%\\") or text in (".", ".."):
        raise UsageError(f"{text!r} is not a run id or node name")
    return text


def completion(shell: str) -> str:
    """``supervisorctl completion SHELL``'s script, made from this parser (cli/completion.py)."""
    return completion_script(shell, _parser(), RUN_COMMANDS)


if __name__ == "__main__":
    sys.exit(main())

"""`supervisorctl`: the command-line client of a running training-supervisor.

    supervisorctl [--url URL] [--json] runs
    supervisorctl status RUN            a run's state, attempts, faults, goodput
    supervisorctl events RUN [--follow] its event log
    supervisorctl submit SPEC.toml [--dry-run]
    supervisorctl resume RUN | pause RUN | cancel RUN
    supervisorctl nodes                 each node's state, drain reason and last probe
    supervisorctl probe NODE            run the health probes on NODE now

The daemon's address comes from --url, else $TSUP_URL, else http://127.0.0.1:8470.
Exit codes: 0 ok; 1 error (daemon unreachable, request rejected); 2 usage or invalid
input; 3 not found; 4 unauthorized (401/403, once the API requires a token).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import tomllib
from pathlib import Path
from typing import Any

from api.client import DEFAULT_URL, ApiError, Client
from supervisor import report, trainer_cmd
from supervisor.domain import TERMINAL_RUN_STATES
from supervisor.errors import SpecError
from supervisor.slurm import requests
from supervisor.spec import parse_spec
from supervisor.views import EventView, NodeView, RunDetail, RunSummary

EXIT_OK, EXIT_ERROR, EXIT_USAGE, EXIT_NOT_FOUND, EXIT_UNAUTHORIZED = 0, 1, 2, 3, 4
_PAGE = 1000
_STATUS_EXIT = {404: EXIT_NOT_FOUND, 401: EXIT_UNAUTHORIZED, 403: EXIT_UNAUTHORIZED, 422: EXIT_USAGE}


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    args.json = getattr(args, "json", False)
    client = Client(getattr(args, "url", None) or os.environ.get("TSUP_URL") or DEFAULT_URL)
    try:
        return int(args.handler(client, args))
    except ApiError as e:
        print(f"supervisorctl: {e.detail}", file=sys.stderr)
        return _STATUS_EXIT.get(e.status, EXIT_ERROR)
    except KeyboardInterrupt:
        return 130
    finally:
        client.close()


def _parser() -> argparse.ArgumentParser:
    # Accepted before and after the subcommand; SUPPRESS keeps a subcommand's default
    # from overwriting a value given before it.
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--url", default=argparse.SUPPRESS,
                        help=f"the daemon's API (default $TSUP_URL or {DEFAULT_URL})")
    common.add_argument("--json", action="store_true", default=argparse.SUPPRESS,
                        help="machine-readable output")
    parser = argparse.ArgumentParser(prog="supervisorctl", description=__doc__.split("\n\n")[0],
                                     parents=[common])
    sub = parser.add_subparsers(dest="command", required=True)

    sub.add_parser("runs", help="list runs", parents=[common]).set_defaults(handler=_runs)
    p = sub.add_parser("status", help="show one run", parents=[common])
    p.add_argument("run")
    p.set_defaults(handler=_status)
    p = sub.add_parser("events", help="a run's event log", parents=[common])
    p.add_argument("run")
    p.add_argument("--after", type=int, default=0, help="only events after this id")
    p.add_argument("--follow", "-f", action="store_true", help="keep printing until the run ends")
    p.set_defaults(handler=_events)
    p = sub.add_parser("submit", help="submit a run spec (TOML)", parents=[common])
    p.add_argument("spec", type=Path)
    p.add_argument("--dry-run", action="store_true",
                   help="validate the spec and print what would run (sbatch, batch script, srun); "
                        "submit nothing")
    p.set_defaults(handler=_submit)
    for kind, text in (("resume", "resume a paused or failed run"), ("pause", "pause a run"),
                       ("cancel", "cancel a run")):
        p = sub.add_parser(kind, help=text, parents=[common])
        p.add_argument("run")
        p.add_argument("--wait", type=float, default=10.0,
                       help="seconds to wait for the daemon to act on it (default 10)")
        p.set_defaults(handler=_command, kind=kind)
    sub.add_parser("nodes", help="list nodes, with their last probe", parents=[common]).set_defaults(
        handler=_nodes)
    p = sub.add_parser("probe", help="run the health probes on a node now", parents=[common])
    p.add_argument("node")
    p.set_defaults(handler=_probe)
    return parser


def _print_json(value: Any) -> None:
    print(json.dumps(value, indent=2))


def _runs(c: Client, args: argparse.Namespace) -> int:
    runs = c.runs()
    if args.json:
        _print_json(runs)
    else:
        print(report.runs_table([RunSummary.model_validate(r) for r in runs]))
    return EXIT_OK


def _status(c: Client, args: argparse.Namespace) -> int:
    run = c.run(args.run)
    if args.json:
        _print_json(run)
    else:
        print(report.run_detail(RunDetail.model_validate(run)))
    return EXIT_OK


def _events(c: Client, args: argparse.Namespace) -> int:
    """--json prints one array; with --follow, one JSON object per line as they come."""
    after = args.after
    if args.json and not args.follow:
        everything: list[dict[str, Any]] = []
        while page := c.events(args.run, after, limit=_PAGE):
            everything += page
            after = page[-1]["id"]
        _print_json(everything)
        return EXIT_OK
    terminal = {s.value for s in TERMINAL_RUN_STATES}
    while True:
        events = c.events(args.run, after, limit=_PAGE)
        for e in events:
            after = e["id"]
            if args.json:
                print(json.dumps(e), flush=True)
            else:
                print(report.event_line(EventView.model_validate(e)), flush=True)
        if len(events) == _PAGE:
            continue  # more are waiting
        if not args.follow:
            return EXIT_OK
        if not events:
            run = c.run(args.run)
            if run["state"] in terminal and run["attempt_state"] in (None, "ENDED"):
                return EXIT_OK  # finished and torn down: no more events will come
        time.sleep(1.0)


def _submit(c: Client, args: argparse.Namespace) -> int:
    try:
        spec = tomllib.loads(args.spec.read_text())
    except (OSError, UnicodeDecodeError) as e:
        print(f"supervisorctl: {args.spec}: cannot read: {e}", file=sys.stderr)
        return EXIT_USAGE
    except tomllib.TOMLDecodeError as e:
        print(f"supervisorctl: {args.spec}: not valid TOML: {e}", file=sys.stderr)
        return EXIT_USAGE
    if args.dry_run:
        return _dry_run(args, spec)
    run = c.submit(spec)
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
        print(f"supervisorctl: {e}", file=sys.stderr)
        return EXIT_USAGE
    run_dir = Path("<state-dir>/runs/run-N")
    argv = trainer_cmd.attempt_argv(spec, run_dir, 1, None, 0)
    res = spec.resources
    if res.launcher == "slurm":
        plan: dict[str, Any] = {"launcher": "slurm", **requests.dry_run(
            job_name="tsup-<state-dir hash>.run-N.1", nodes=res.nodes, spares=res.spares,
            ranks_per_node=res.ranks_per_node, argv=argv, partition=res.partition,
            time_limit_min=res.time_limit_min, log_dir=run_dir)}
    else:
        plan = {"launcher": "local", "ranks": res.nodes * res.ranks_per_node, "argv": list(argv)}
    if args.json:
        _print_json(plan)
    elif res.launcher == "slurm":
        print(f"# the allocation: {res.nodes} node(s) to train on + {res.spares} hot spare(s)")
        print(requests.describe(plan["sbatch"]) + " <<'EOF'")
        print(plan["batch_script"] + "EOF")
        print(f"# each attempt: a job step on {res.nodes} healthy node(s) of the allocation")
        print(requests.describe(plan["srun"]))
    else:
        print(f"# {plan['ranks']} rank(s) on this machine, each running:")
        print(requests.describe(argv))
    return EXIT_OK


def _command(c: Client, args: argparse.Namespace) -> int:
    accepted = c.command(args.run, args.kind)
    deadline = time.monotonic() + args.wait
    result = None
    while time.monotonic() < deadline:
        result = c.command_result(accepted["command_id"])["result"]
        if result is not None:
            break
        time.sleep(0.2)
    outcome = {"run_id": args.run, "command": args.kind, "command_id": accepted["command_id"],
               "result": result or "queued"}
    if args.json:
        _print_json(outcome)
    else:
        print(f"{args.run}: {args.kind} {outcome['result']}")
    return EXIT_ERROR if result is not None and result.startswith("rejected") else EXIT_OK


def _probe(c: Client, args: argparse.Namespace) -> int:
    p = c.probe(args.node)
    if args.json:
        _print_json(p)
    else:
        why = f": {p['reason']}" if p["reason"] else ""
        print(f"{p['node']}: {p['status']} (action: {p['action']}){why}")
        for f in p["findings"]:
            print(f"  {f.get('probe', ''):<18} {f.get('status', ''):<9} {f.get('evidence', '')}")
    return EXIT_OK if p["status"] in ("healthy", "degraded") else EXIT_ERROR


def _nodes(c: Client, args: argparse.Namespace) -> int:
    nodes = c.nodes()
    if args.json:
        _print_json(nodes)
    else:
        print(report.nodes_table([NodeView.model_validate(n) for n in nodes]))
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())

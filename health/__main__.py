"""`python -m health`: probe this node; exit 0 healthy, 1 degraded, 2 unhealthy or unknown.

Needs no supervisor. Runs the host checks, then the Neuron probes where ``neuron-ls``
is installed, the NVIDIA probes where ``nvidia-smi`` is, and the EFA checks where
``fi_info`` is; a node with neither accelerator says so plainly. ``--broker`` also proves
the run's MQTT broker answers from this node (health/broker.py).
``--json`` prints the verdict (``--compact``: on one line; ``--wire``: in short tagged
lines, as the supervisor reads it through srun), a line per finding otherwise.

As Slurm's HealthCheckProgram (``--drain-self``), an unhealthy verdict drains this node
with the findings as the Reason. Every tool has a timeout; the default checks stay inside
Slurm's 60-second budget, but ``--dcgm`` (dcgmi diag, up to 60 s by itself) and
``--bandwidth`` (up to 50 s) do not: leave them out of a HealthCheckProgram line.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

from health import broker, efa, host, neuron, nvidia, wire
from health.model import Finding, Status, Verdict, verdict


def node_name() -> str:
    env = os.environ
    return env.get("SLURMD_NODENAME") or env.get("TSUP_NODE") or socket.gethostname().split(".")[0]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m health", description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint-dir", type=Path, default=Path.cwd(),
                        help="the filesystem checkpoints are written to (default: the current directory); "
                             "one not made yet is measured at its nearest existing parent")
    parser.add_argument("--min-free-gib", type=float, default=10.0,
                        help="unhealthy below this much free space (default 10)")
    parser.add_argument("--instance-type", default=None,
                        help="e.g. trn1.32xlarge: the expected Neuron devices")
    parser.add_argument("--neuron-devices", type=int, default=None, help="expected Neuron devices")
    parser.add_argument("--gpus", type=int, default=None, help="expected NVIDIA GPUs")
    parser.add_argument("--dcgm", action="store_true", help="also run `dcgmi diag -r 1` (NVIDIA)")
    parser.add_argument("--kernel-log", type=Path, default=None,
                        help="a kernel log (a dmesg dump) to scan for NEURON_HW_ERR and NVIDIA XID lines")
    parser.add_argument("--bandwidth", action="store_true",
                        help="also run the collective bandwidth test (nccom-test / nccl-tests)")
    parser.add_argument("--min-busbw-gbps", type=float, default=None,
                        help="bus bandwidth floor for --bandwidth")
    parser.add_argument("--json", action="store_true", help="print the verdict as JSON")
    parser.add_argument("--compact", action="store_true", help="with --json: on one line")
    parser.add_argument("--wire", action="store_true",
                        help="the verdict in short tagged lines, as the supervisor reads it through srun "
                             "(health/wire.py)")
    parser.add_argument("--require", type=Path, action="append", default=[], metavar="PATH",
                        help="a file or directory a run needs on this node (its command, its working "
                             "directory): unhealthy when missing (repeatable)")
    parser.add_argument("--run-user", default=None, metavar="NAME",
                        help="the account a run executes as: unhealthy when this node does not know it")
    parser.add_argument("--broker", default=None, metavar="URL",
                        help="mqtt://HOST:PORT or mqtts://HOST:PORT: the MQTT broker the ranks will be told; "
                             "unhealthy when it does not answer from this node (no login in the URL)")
    parser.add_argument("--broker-ca", type=Path, default=None, metavar="FILE",
                        help="with an mqtts:// --broker: the CA the ranks are told (absent: the system's)")
    parser.add_argument("--shared-host", action="store_true",
                        help="this node shares its host with other nodes (simulated nodes, a Slurm box): "
                             "report the host's load and trainer processes, do not judge them "
                             f"(also {host.SHARED_HOST_ENV}=1)")
    parser.add_argument("--drain-self", action="store_true",
                        help="Slurm HealthCheckProgram mode: drain this node when unhealthy")
    args = parser.parse_args(argv)

    shared = args.shared_host or os.environ.get(host.SHARED_HOST_ENV) == "1"
    place = host.nearest_existing(args.checkpoint_dir)
    findings = [
        host.disk(place, min_free_gib=args.min_free_gib, degraded_free_gib=max(args.min_free_gib, 50.0)),
        host.write_latency(place, runs=args.run_user is not None,
                           ahead=args.checkpoint_dir if place != args.checkpoint_dir else None),
        host.memory(),
        host.load(shared=shared),
        host.leftover_trainers(shared=shared),
        *host.required(args.require),
    ]
    if args.run_user:
        findings.append(host.run_user(args.run_user))
    if args.broker:
        findings.append(broker.probe(args.broker, ca_file=args.broker_ca))
    kernel_log = _read(args.kernel_log, findings) if args.kernel_log else None
    findings += neuron.run_all(expected_devices=args.neuron_devices, instance_type=args.instance_type,
                               min_busbw_gbps=args.min_busbw_gbps, run_bandwidth=args.bandwidth,
                               kernel_log=kernel_log)
    findings += nvidia.run_all(expected_gpus=args.gpus, kernel_log=kernel_log, run_dcgmi=args.dcgm,
                               run_bandwidth=args.bandwidth, min_busbw_gbps=args.min_busbw_gbps)
    findings += efa.probe(args.instance_type, state_file=efa.state_path())
    v = verdict(findings)
    node = node_name()
    summary = _summary(v)
    if args.drain_self and v.status is Status.UNHEALTHY:
        findings.append(_drain(node, v))
    doc = {"node": node, **v.to_json(), "reason": v.reason() if v.status is not Status.HEALTHY else "",
           "summary": summary}
    if args.wire:
        print("\n".join(wire.lines(node, json.dumps(doc))), flush=True)
    elif args.json:
        print(json.dumps(doc) if args.compact else json.dumps(doc, indent=2))
    else:
        print(f"{node}: {v.status.value} (action: {v.action.value}); {summary}")
        for f in v.findings:
            print(f"  {f.probe:<18} {f.status.value:<9} {f.evidence}")
    return v.exit_code


def _read(path: Path, findings: list[Finding]) -> str | None:
    try:
        return path.read_text(errors="replace")
    except OSError as e:
        findings.append(Finding(probe="kernel-log", status=Status.UNKNOWN,
                                evidence=f"unknown: probe failed: {path}: {e.strerror}"))
        return None


def _summary(v: Verdict) -> str:
    """What kind of node this is, in words: which accelerator probes ran."""
    absent = {f.probe for f in v.findings if f.evidence.startswith("no ") and "devices found" in f.evidence}
    if {"neuron-ls", "nvidia-smi"} <= absent:
        return ("no Neuron or NVIDIA devices found (neither neuron-ls nor nvidia-smi is installed); "
                "host checks only")
    ran = [kind for kind, tool in (("Neuron", "neuron-ls"), ("NVIDIA", "nvidia-smi")) if tool not in absent]
    return f"{' and '.join(ran)} probes ran"


def _drain(node: str, v: Verdict) -> Finding:
    reason = f"health: {v.reason()}"[:250]
    try:
        done = subprocess.run(["scontrol", "update", f"NodeName={node}", "State=DRAIN", f"Reason={reason}"],
                              capture_output=True, text=True, timeout=10, check=False)
        ok, why = done.returncode == 0, done.stderr.strip()
    except (OSError, subprocess.TimeoutExpired) as e:
        ok, why = False, str(e)
    if ok:
        return Finding(probe="drain-self", status=Status.UNHEALTHY, evidence=f"drained {node}: {reason}")
    return Finding(probe="drain-self", status=Status.UNKNOWN, evidence=f"unknown: probe failed: cannot drain "
                   f"{node}: {why}")


if __name__ == "__main__":
    sys.exit(main())

"""`python -m health`: probe this node; exit 0 healthy, 1 degraded, 2 unhealthy.

Needs no supervisor. Prints the verdict as JSON with --json, a line per finding
otherwise. The Neuron and NVIDIA probes come next; today it checks the host.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from health import host
from health.model import verdict


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m health", description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint-dir", type=Path, default=Path.cwd(),
                        help="the filesystem checkpoints are written to (default: the current directory)")
    parser.add_argument("--min-free-gib", type=float, default=10.0,
                        help="unhealthy below this much free space (default 10)")
    parser.add_argument("--json", action="store_true", help="print the verdict as JSON")
    args = parser.parse_args(argv)

    findings = [
        host.disk(args.checkpoint_dir, min_free_gib=args.min_free_gib,
                  degraded_free_gib=max(args.min_free_gib, 50.0)),
        host.write_latency(args.checkpoint_dir),
        host.memory(),
        host.load(),
        host.leftover_trainers(),
    ]
    v = verdict(findings)
    if args.json:
        print(json.dumps(v.to_json(), indent=2))
    else:
        print(f"{v.status.value}")
        for f in v.findings:
            print(f"  {f.probe:<18} {f.status.value:<9} {f.evidence}")
    return v.exit_code


if __name__ == "__main__":
    sys.exit(main())

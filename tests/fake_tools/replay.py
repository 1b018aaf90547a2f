"""Stand-in for a hardware tool (neuron-ls, neuron-monitor, nccom-test, nvidia-smi ...):
prints a recorded output chosen per node, so a test can give one node of a Slurm box a
bad device. Stdlib only; run through a shim named after the tool (see make_tools).

    $TSUP_FAKE_HW/<node>/<tool>       the output for that node (node: SLURMD_NODENAME,
    $TSUP_FAKE_HW/default/<tool>      else TSUP_NODE), else the default
    ...<tool>.rc                      optional exit code (default 0)
"""

from __future__ import annotations

import os
import sys
from pathlib import Path


def main() -> int:
    tool, args = sys.argv[1], sys.argv[2:]
    root = Path(os.environ.get("TSUP_FAKE_HW", "/nonexistent"))
    node = os.environ.get("SLURMD_NODENAME") or os.environ.get("TSUP_NODE") or "default"
    names = [tool]
    if args and args[0].startswith("--"):
        names.insert(0, f"{tool}.{args[0][2:].split('=', 1)[0]}")
    for d in (root / node, root / "default"):
        for name in names:
            out = d / name
            if out.exists():
                sys.stdout.write(out.read_text())
                rc = d / f"{name}.rc"
                return int(rc.read_text()) if rc.exists() else 0
    print(f"{tool}: no recorded output for node {node} in {root}", file=sys.stderr)
    return 1


def make_tools(directory: Path, tools: list[str]) -> Path:
    """Executable shims named after ``tools`` in ``directory`` (for TSUP_HEALTH_TOOLS)."""
    directory.mkdir(parents=True, exist_ok=True)
    for tool in tools:
        shim = directory / tool
        shim.write_text(f'#!/bin/sh\nexec "{sys.executable}" "{Path(__file__).resolve()}" {tool} "$@"\n')
        shim.chmod(0o755)
    return directory


if __name__ == "__main__":
    sys.exit(main())

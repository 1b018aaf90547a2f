"""How the supervisor drives the reference trainer (trainer/README.md is the contract).

Per run:     <run_dir>/checkpoints/           the trainer's checkpoint.dir (unless the spec sets one)
             <run_dir>/output/result.json     written by rank 0 after a successful finish
Per attempt: <run_dir>/attempts/<n>/trainer.json   the trainer config of that attempt
             <run_dir>/attempts/<n>/rank-*.log     each rank's output

The daemon never imports the trainer (it would import torch): configs are checked by
running ``python -m trainer --check-config``, which imports no torch.
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from supervisor.domain import TrainerResult
from supervisor.errors import SpecError
from supervisor.spec import RunSpec

CHECK_TIMEOUT_S = 60.0


def checkpoint_dir(spec: RunSpec, run_dir: Path) -> Path:
    ck = spec.trainer.get("checkpoint", {})
    return Path(ck["dir"]) if "dir" in ck else run_dir / "checkpoints"


def result_path(spec: RunSpec, run_dir: Path) -> Path:
    return Path(spec.trainer.get("output_dir", run_dir / "output")) / "result.json"


def trainer_config(spec: RunSpec, run_dir: Path) -> dict[str, Any]:
    """The spec's [trainer] table with the run's own paths filled in."""
    config = copy.deepcopy(spec.trainer)
    config.setdefault("checkpoint", {})["dir"] = str(checkpoint_dir(spec, run_dir))
    config["output_dir"] = str(result_path(spec, run_dir).parent)
    return config


def attempt_dir(run_dir: Path, attempt: int) -> Path:
    return run_dir / "attempts" / str(attempt)


def write_attempt_config(spec: RunSpec, run_dir: Path, attempt: int) -> Path:
    path = attempt_dir(run_dir, attempt) / "trainer.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(trainer_config(spec, run_dir), indent=2, sort_keys=True))
    os.replace(tmp, path)
    return path


def trainer_argv(config_path: Path, resume_from: str | None) -> tuple[str, ...]:
    return (sys.executable, "-m", "trainer", "--config", str(config_path),
            "--resume", resume_from or "none")


def check_trainer_config(spec: RunSpec, run_dir: Path) -> None:
    """Raise SpecError naming every bad key of the spec's [trainer] table."""
    with tempfile.TemporaryDirectory(prefix="tsup-check-") as tmp:
        path = Path(tmp) / "trainer.json"
        path.write_text(json.dumps(trainer_config(spec, run_dir)))
        try:
            proc = subprocess.run(
                [sys.executable, "-m", "trainer", "--check-config", str(path)],
                capture_output=True, text=True, timeout=CHECK_TIMEOUT_S, check=False,
            )
        except (OSError, subprocess.TimeoutExpired) as e:
            raise SpecError(f"cannot check the trainer config: {e}") from e
    if proc.returncode == 0:
        return
    lines = [ln.strip() for ln in (proc.stdout + proc.stderr).splitlines() if ln.strip()]
    if proc.returncode == 2 and lines:
        raise SpecError("; ".join(f"[trainer] {ln}" for ln in lines))
    raise SpecError(f"trainer config check failed (exit {proc.returncode}): {' '.join(lines)[-500:]}")


def read_result(path: Path, run_id: str, attempt: int) -> TrainerResult | None:
    """The trainer's result.json for this very attempt, or None.

    A result written by another run or attempt (a shared output_dir, a stale file)
    is no proof that this attempt succeeded.
    """
    try:
        data = json.loads(path.read_text())
        if data.get("run_id") != run_id or data.get("attempt") != attempt:
            return None
        return TrainerResult(final_step=int(data["final_step"]), model_digest=str(data["model_digest"]))
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None

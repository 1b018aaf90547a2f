"""What a node's probe says when the run cannot run there at all: the supervisor's
interpreter missing (the guard of node_health.probe_argv), or the run's command and
working directory (python -m health --require, named by trainer_cmd.node_requirements)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from supervisor import node_health
from supervisor.domain import ProbeRecord
from supervisor.runfiles import trainer_cmd
from supervisor.spec import load_spec
from tests.conftest import REPO


def probe(argv: tuple[str, ...], node: str) -> ProbeRecord:
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120, check=False,
                          env={**os.environ, "TSUP_NODE": node, "SLURMD_NODENAME": ""})
    return node_health.record(node, done.stdout, "preflight", 1, 0.0)


def test_a_node_without_the_interpreter_answers_unhealthy_naming_itself_and_the_path() -> None:
    absent = "/opt/nowhere/.venv/bin/python"
    record = probe(node_health.probe_argv(["--min-free-gib", "0"], interpreter=absent), "trn-17")
    assert record.node == "trn-17" and record.status == "unhealthy"
    assert record.reason.startswith(f"deploy: {absent}, the supervisor's interpreter, is missing on this node")


def test_with_the_interpreter_the_probe_runs_and_checks_the_runs_files(tmp_path: Path) -> None:
    script = tmp_path / "train.sh"
    argv = node_health.probe_argv(["--min-free-gib", "0", "--checkpoint-dir", str(tmp_path)],
                                  [str(tmp_path), str(script)], interpreter=sys.executable)
    record = probe(argv, "trn-3")
    assert record.status == "unhealthy" and record.reason == (
        f"run-files: {script} is missing on this node (or not executable): the run's command needs it")
    script.write_text("#!/bin/sh\n")
    assert probe(argv, "trn-3").status == "unhealthy", "a script that is not executable cannot run"
    script.chmod(0o755)
    assert probe(argv, "trn-3").status in ("healthy", "degraded")


def test_an_nxd_training_job_needs_its_examples_directory_and_train_sh_on_every_node() -> None:
    spec = load_spec(REPO / "examples" / "nxdt-llama3-70b-trn1.toml")
    examples = "/fsx/ubuntu/training_artifacts/neuronx-distributed-training/examples"
    assert trainer_cmd.node_requirements(spec, Path("/state/runs/run-1")) == [examples, f"{examples}/train.sh"]
    reference = load_spec(REPO / "examples" / "tiny-llama.toml")
    assert trainer_cmd.node_requirements(reference, Path("/state/runs/run-1")) == []

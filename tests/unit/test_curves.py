"""Where a run's own curves are (supervisor/runfiles/trainer_cmd.py: curves)."""

from __future__ import annotations

from pathlib import Path


def test_nxd_trainings_curves_are_in_its_per_job_directory_once_the_run_has_a_job(tmp_path: Path) -> None:
    from supervisor.runfiles import trainer_cmd
    from supervisor.spec import parse_spec

    nemo = parse_spec({"name": "nxdt", "resources": {"launcher": "slurm", "nodes": 2},
                       "command": {"argv": ["./train.sh"], "launch": "node", "checkpoint_layout": "nemo",
                                   "checkpoint_dir": "/fsx/nemo_experiments/hf_llama"}}, "spec")
    assert trainer_cmd.curves(nemo, "run-3", tmp_path, None) == (None, None), "no job yet: nothing to show"
    assert trainer_cmd.curves(nemo, "run-3", tmp_path, "4711") == ("/fsx/nemo_experiments/hf_llama/4711", None)
    plain = parse_spec({"name": "fsdp", "command": {"argv": ["torchrun", "train.py"], "checkpoint_dir": "/fsx/ck"},
                        "curves": {"tensorboard": "{run_dir}/tb", "url": "https://mlflow.example/{run_id}"}}, "spec")
    assert trainer_cmd.curves(plain, "run-4", tmp_path, None) == (f"{tmp_path}/tb", "https://mlflow.example/run-4")
    bare = parse_spec({"name": "fsdp", "command": {"argv": ["torchrun", "train.py"], "checkpoint_dir": "/fsx/ck"}}, "spec")
    assert trainer_cmd.curves(bare, "run-5", tmp_path, "9") == (None, None), "nothing said, nothing guessed"

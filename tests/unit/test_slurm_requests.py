"""supervisor/slurm/requests.py: the whole sbatch and srun command lines, the batch
script, the rank wrapper (run once under /bin/sh with a fake Slurm environment) and
``describe``. No Slurm."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from supervisor.slurm.requests import (
    RANK_WRAPPER,
    SbatchRequest,
    StepRequest,
    allocation_script,
    describe,
    sbatch_argv,
    srun_argv,
)

TRICKY = ("a b", "$HOME", "x; echo pwned", "'q'", '"dq"', "*", "")


# --- sbatch -----------------------------------------------------------------------


def test_sbatch_argv_whole() -> None:
    req = SbatchRequest(job_name="tsup.run-7.a1", nodes=3, min_nodes=2, partition="train", time_limit_min=90,
                        signal_before_s=300, exclude=("node9", "node10", "node2"), output=Path("/var/log/alloc.out"))
    assert sbatch_argv(req) == [
        "sbatch", "--parsable", "--job-name=tsup.run-7.a1", "--nodes=2-3", "--exclusive", "--no-kill",
        "--requeue", "--output=/var/log/alloc.out", "--partition=train", "--time=90", "--signal=USR1@300",
        "--exclude=node10,node2,node9",
    ]


def test_sbatch_argv_equal_min_max_nodes() -> None:
    argv = sbatch_argv(SbatchRequest(job_name="j", nodes=3, min_nodes=3))
    assert "--nodes=3" in argv
    assert not any(a.startswith("--nodes=") and "-" in a.removeprefix("--nodes=") for a in argv)


def test_sbatch_argv_minimal() -> None:
    assert sbatch_argv(SbatchRequest(job_name="j", nodes=1, min_nodes=1)) == [
        "sbatch", "--parsable", "--job-name=j", "--nodes=1", "--exclusive", "--no-kill", "--requeue",
        "--output=/dev/null",
    ]


def test_sbatch_argv_no_signal_without_time_limit() -> None:
    argv = sbatch_argv(SbatchRequest(job_name="j", nodes=2, min_nodes=1, signal_before_s=300))
    assert not any(a.startswith(("--time", "--signal", "--partition", "--exclude", "--chdir")) for a in argv)


def test_sbatch_argv_default_signal_lead() -> None:
    argv = sbatch_argv(SbatchRequest(job_name="j", nodes=2, min_nodes=2, time_limit_min=60))
    assert argv[-2:] == ["--time=60", "--signal=USR1@120"]


def test_sbatch_argv_no_signal_for_a_trainer_that_does_not_handle_usr1() -> None:
    argv = sbatch_argv(SbatchRequest(job_name="j", nodes=2, min_nodes=2, time_limit_min=60, signal_before_s=None))
    assert argv[-1] == "--time=60" and not any(a.startswith("--signal") for a in argv)


def test_dry_run_signals_only_trainers_that_handle_usr1(tmp_path: Path) -> None:
    """The reference trainer handles SIGUSR1; a user's torchrun or train.sh would die of
    it, so a [command] is signalled only with handles_usr1 = true."""
    def signalled(table: str) -> bool:
        spec = tmp_path / "spec.toml"
        spec.write_text('name = "x"\n[resources]\nlauncher = "slurm"\ntime_limit_min = 60\n' + table)
        out = subprocess.run([sys.executable, "-m", "cli.ctl", "--json", "submit", "--dry-run", str(spec)],
                             capture_output=True, text=True, check=True, cwd=Path(__file__).parents[2],
                             env={**os.environ, "TSUP_CTL_CONFIG": os.devnull})
        return any(a.startswith("--signal=USR1@") for a in json.loads(out.stdout)["sbatch"])

    command = '[command]\nargv = ["torchrun", "train.py"]\ncheckpoint_dir = "{run_dir}/ck"\n'
    assert signalled("[trainer]\nsteps = 10\n")
    assert not signalled(command)
    assert signalled(command + "handles_usr1 = true\n")


def test_sbatch_argv_always_has_the_allocation_flags() -> None:
    for req in (SbatchRequest(job_name="j", nodes=1, min_nodes=1),
                SbatchRequest(job_name="j", nodes=4, min_nodes=2, partition="p", time_limit_min=5)):
        argv = sbatch_argv(req)
        assert argv[:2] == ["sbatch", "--parsable"]
        for flag in ("--exclusive", "--no-kill", "--requeue"):
            assert argv.count(flag) == 1, flag


def test_sbatch_argv_exclude_sorted_comma_joined() -> None:
    argv = sbatch_argv(SbatchRequest(job_name="j", nodes=2, min_nodes=2, exclude=("node3", "node1")))
    assert [a for a in argv if a.startswith("--exclude")] == ["--exclude=node1,node3"]


def test_sbatch_argv_workdir_and_site_extras_last() -> None:
    argv = sbatch_argv(SbatchRequest(job_name="j", nodes=2, min_nodes=2, workdir=Path("/shared/run 7"),
                                     extra=("--account=llm", "--qos=high")))
    assert argv[-3:] == ["--chdir=/shared/run 7", "--account=llm", "--qos=high"]


def test_allocation_script_holds_nodes_and_sleeps() -> None:
    script = allocation_script(SbatchRequest(job_name="tsup.run-7.a1", nodes=3, min_nodes=2))
    assert script.startswith("#!/bin/sh\n")
    lines = script.splitlines()
    assert lines[-1] == "exec sleep infinity"
    assert all(line.startswith("#") for line in lines[:-1])  # nothing else runs
    assert "tsup.run-7.a1" in script
    assert script.endswith("\n")


# --- srun -------------------------------------------------------------------------


def step(**kw: object) -> StepRequest:
    base: dict[str, object] = {"job_id": "4711", "step_name": "tsup.run-7.a2", "nodes": ("node1", "node3"),
                               "ranks_per_node": 4, "argv": ("python3", "-m", "trainer", "--steps", "10"),
                               "log_dir": Path("/logs/run-7/a2")}
    base.update(kw)
    return StepRequest(**base)  # type: ignore[arg-type]


def test_srun_argv_whole() -> None:
    assert srun_argv(step()) == [
        "srun", "--jobid=4711", "--job-name=tsup.run-7.a2", "--nodes=2", "--nodelist=node1,node3", "--ntasks=8",
        "--ntasks-per-node=4", "--distribution=block", "--overlap", "--kill-on-bad-exit=0",
        "--output=/logs/run-7/a2/rank-%t.log",
        "/bin/sh", "-c", RANK_WRAPPER, "tsup-rank", "python3", "-m", "trainer", "--steps", "10",
    ]


def test_srun_argv_task_counts() -> None:
    argv = srun_argv(step(nodes=("a", "b", "c"), ranks_per_node=1))
    assert {"--nodes=3", "--ntasks=3", "--ntasks-per-node=1", "--nodelist=a,b,c"} <= set(argv)


def test_srun_trainer_argv_passed_as_separate_arguments() -> None:
    argv = srun_argv(step(argv=("python3", *TRICKY)))
    i = argv.index("/bin/sh")
    assert argv[i:i + 4] == ["/bin/sh", "-c", RANK_WRAPPER, "tsup-rank"]
    assert argv[i + 4:] == ["python3", *TRICKY]
    # Never pasted into the shell text.
    for arg in ("python3", "a b", "$HOME", "x; echo pwned", "'q'"):
        assert arg not in RANK_WRAPPER
    # srun options all come before the command: nothing of the trainer's among them.
    assert all(a.startswith("--") for a in argv[1:i])


def test_rank_wrapper_sets_torchrun_env_and_passes_argv_verbatim(tmp_path: Path) -> None:
    probe = ("import json, os, sys; print(json.dumps({'argv': sys.argv[1:], 'env': {k: os.environ.get(k) for k "
             "in ('RANK', 'LOCAL_RANK', 'WORLD_SIZE', 'GROUP_RANK', 'TSUP_NODE')}}))")
    argv = srun_argv(step(argv=(sys.executable, "-c", probe, *TRICKY)))
    command = argv[argv.index("/bin/sh"):]
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(tmp_path / "home-should-not-expand"),
           "SLURM_PROCID": "3", "SLURM_LOCALID": "1", "SLURM_NTASKS": "8", "SLURM_NODEID": "1",
           "SLURMD_NODENAME": "node3"}
    done = subprocess.run(command, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    assert out["env"] == {"RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "8", "GROUP_RANK": "1",
                          "TSUP_NODE": "node3"}
    assert out["argv"] == list(TRICKY)


def test_inside_a_step_the_job_wide_slurm_variables_describe_the_step(tmp_path: Path) -> None:
    """SLURM_JOB_NODELIST is the whole allocation in a step (spares, drained nodes): a
    script that takes its master from it must find the step's nodes there."""
    names = ("SLURM_JOB_NODELIST", "SLURM_NODELIST", "SLURM_JOB_NUM_NODES", "SLURM_NNODES")
    probe = f"import json, os; print(json.dumps({{k: os.environ.get(k) for k in {names!r}}}))"
    command = srun_argv(step(argv=(sys.executable, "-c", probe)))
    command = command[command.index("/bin/sh"):]
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "SLURM_PROCID": "0", "SLURM_LOCALID": "0",
           "SLURM_NTASKS": "2", "SLURM_NODEID": "0", "SLURMD_NODENAME": "node2",
           "SLURM_JOB_NODELIST": "node[1-3]", "SLURM_NODELIST": "node[1-3]", "SLURM_JOB_NUM_NODES": "3",
           "SLURM_NNODES": "3", "SLURM_STEP_NODELIST": "node[2-3]", "SLURM_STEP_NUM_NODES": "2"}
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=60, check=True)
    assert json.loads(done.stdout) == {"SLURM_JOB_NODELIST": "node[2-3]", "SLURM_NODELIST": "node[2-3]",
                                       "SLURM_JOB_NUM_NODES": "2", "SLURM_NNODES": "2"}


def test_a_commands_cwd_and_srun_args_come_after_the_supervisors_options() -> None:
    argv = srun_argv(step(cwd=Path("/fsx/job"), extra=("-l", "--container-image=nvcr.io/x:1")))
    i = argv.index("/bin/sh")
    assert argv[i - 3:i] == ["--chdir=/fsx/job", "-l", "--container-image=nvcr.io/x:1"]
    assert argv.index("--overlap") < i - 3


# --- describe ---------------------------------------------------------------------


def test_describe_quotes_arguments_with_spaces() -> None:
    assert describe(["srun", "--chdir=/a b", "python3", "$HOME"]) == "srun '--chdir=/a b' python3 '$HOME'"


def test_describe_env_prefix_sorted_and_quoted() -> None:
    assert describe(["run"], {"Z": "1", "A": "x y"}) == "A='x y' Z=1 run"
    assert describe(["run"], {}) == "run"


@pytest.mark.parametrize("argv", [["sbatch", "--parsable"], ["python3", *TRICKY]])
def test_describe_round_trips_through_a_shell_split(argv: list[str]) -> None:
    assert shlex.split(describe(argv)) == argv


def test_describe_of_whole_srun_round_trips() -> None:
    argv = srun_argv(step(argv=("python3", *TRICKY), log_dir=Path("/logs/with space")))
    assert shlex.split(describe(argv)) == argv


def test_the_node_wrapper_gives_a_nodes_torchrun_its_node_and_the_steps_view(tmp_path: Path) -> None:
    names = ("GROUP_RANK", "NODE_RANK", "TSUP_NODE", "RANK", "SLURM_JOB_NODELIST", "SLURM_NTASKS")
    probe = f"import json, os; print(json.dumps({{k: os.environ.get(k) for k in {names!r}}}))"
    argv = srun_argv(step(argv=(sys.executable, "-c", probe), launch="node"))
    assert {"--ntasks=2", "--ntasks-per-node=1", "--output=/logs/run-7/a2/node-%t.log"} <= set(argv)
    command = argv[argv.index("/bin/sh"):]
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "SLURM_PROCID": "1", "SLURM_LOCALID": "0",
           "SLURM_NTASKS": "2", "SLURM_NODEID": "1", "SLURMD_NODENAME": "node3",
           "SLURM_JOB_NODELIST": "node[1-3]", "SLURM_STEP_NODELIST": "node[1,3]"}
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=60, check=True)
    assert json.loads(done.stdout) == {"GROUP_RANK": "1", "NODE_RANK": "1", "TSUP_NODE": "node3", "RANK": None,
                                       "SLURM_JOB_NODELIST": "node[1,3]", "SLURM_NTASKS": "2"}


def test_the_step_placeholders_are_filled_by_srun_argv() -> None:
    from supervisor.domain.step import DEFERRED, Step

    rendezvous = Step(nnodes=2, nproc_per_node=4, master_addr="10.1.0.2", master_port=21000, rdzv_id="run-7.a2")
    argv = srun_argv(step(argv=("torchrun", "--rdzv_endpoint={master_addr}:{master_port}".format(**DEFERRED)),
                          launch="node", step=rendezvous))
    assert argv[-2:] == ["torchrun", "--rdzv_endpoint=10.1.0.2:21000"]


def test_a_specs_env_changes_the_defaults_never_the_rendezvous() -> None:
    from supervisor.domain.step import Step
    from supervisor.slurm.requests import step_env

    rendezvous = Step(nnodes=2, nproc_per_node=4, master_addr="10.1.0.2", master_port=21000, rdzv_id="run-7.a2")
    env = step_env({"OMP_NUM_THREADS": "8", "MASTER_PORT": "1", "CONF_FILE": "hf_llama3_8B_config"}, rendezvous,
                   ranks_per_node=4, launch="node", marker="/m")
    assert (env["OMP_NUM_THREADS"], env["PYTHONUNBUFFERED"], env["CONF_FILE"]) == ("8", "1", "hf_llama3_8B_config")
    assert (env["MASTER_ADDR"], env["MASTER_PORT"], env["TSUP_MARKER"]) == ("10.1.0.2", "21000", "/m")
    assert step_env({}, rendezvous, ranks_per_node=4, launch="node", marker="/m")["OMP_NUM_THREADS"] == "1"

"""Run specs: the example loads, and every kind of mistake is named."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from supervisor.errors import SpecError
from supervisor.runfiles.trainer_cmd import attempt_env
from supervisor.spec import load_spec, parse_spec, spec_from_json
from tests.conftest import REPO
from wire import parse_mqtt_url

GOOD = {"name": "t", "trainer": {"steps": 10}}


def test_the_example_spec_loads() -> None:
    spec = load_spec(REPO / "examples" / "tiny-llama.toml")
    assert (spec.resources.nodes, spec.resources.ranks_per_node, spec.resources.spares) == (2, 2, 1)
    assert spec.total_steps == 80
    assert spec.trainer["checkpoint"]["every_steps"] == 20
    assert spec.policy.to_policy().failures_without_progress == 4


def test_make_run_runs_the_example_with_the_fast_recovery_on() -> None:
    """`make run`'s spec is the embedded example plus warm standbys and the memory tier, nothing else."""
    assert "examples/tiny-llama-fast.toml" in (REPO / "Makefile").read_text()
    fast = load_spec(REPO / "examples" / "tiny-llama-fast.toml").model_dump()
    plain = load_spec(REPO / "examples" / "tiny-llama.toml").model_dump()
    assert fast["resources"]["standby"] and fast["trainer"]["checkpoint"]["memory_every_steps"] == 5
    fast["resources"]["standby"] = plain["resources"]["standby"]
    del fast["trainer"]["checkpoint"]["memory_every_steps"]
    assert {**fast, "name": plain["name"]} == plain


@pytest.mark.parametrize(
    ("data", "complaint"),
    [
        ({"trainer": {"steps": 1}}, "missing required key 'name'"),
        ({**GOOD, "resources": {"nodse": 2}}, "unknown key 'resources.nodse'"),
        ({**GOOD, "resources": {"nodes": 0}}, "resources.nodes: Input should be greater than 0"),
        ({**GOOD, "resources": {"nodes": "two"}}, "resources.nodes: Input should be a valid integer"),
        ({**GOOD, "resources": {"launcher": "k8s"}}, "resources.launcher"),
        ({**GOOD, "policy": {"failures_without_progress": 0}}, "policy.failures_without_progress"),
        ({"name": "t", "trainer": {}}, "trainer.steps: expected a positive integer"),
        ({"name": "t", "trainer": {"steps": 0}}, "trainer.steps: expected a positive integer"),
        ({"name": "has space", "trainer": {"steps": 1}}, "name: String should match pattern"),
        ({**GOOD, "telemetry": {"mqtt_url": "http://x"}}, "expected mqtt://HOST:PORT"),
        ({**GOOD, "telemetry": {"aggregate": "host"}}, "telemetry.aggregate: Input should be 'rank' or 'node'"),
        ({**GOOD, "surprise": 1}, "unknown key 'surprise'"),
        ({"name": "t", "command": {"argv": ["true"], "checkpoint_dir": "ck"}, "resources": {"standby": True}},
         "resources.standby: only the reference trainer"),
    ],
)
def test_spec_errors_name_the_key(data: dict[str, object], complaint: str) -> None:
    with pytest.raises(SpecError) as e:
        parse_spec(data, "my.toml")
    assert str(e.value).startswith("my.toml: ")
    assert complaint in str(e.value)


def test_telemetry_aggregation_reaches_the_reference_trainer_only(tmp_path: Path) -> None:
    assert parse_spec(GOOD).telemetry.aggregate == "rank"
    spec = parse_spec({**GOOD, "telemetry": {"aggregate": "node"}})
    assert attempt_env(spec, tmp_path)["TSUP_TELEMETRY_AGGREGATE"] == "node"
    assert attempt_env(parse_spec(GOOD), tmp_path)["TSUP_TELEMETRY_AGGREGATE"] == "rank"
    command = parse_spec({"name": "t", "command": {"argv": ["true"], "checkpoint_dir": "ck"},
                          "telemetry": {"aggregate": "node"}})
    assert "TSUP_TELEMETRY_AGGREGATE" not in attempt_env(command, tmp_path)


def test_the_neuron_compile_cache_is_node_local_unless_the_spec_says_otherwise(tmp_path: Path) -> None:
    assert attempt_env(parse_spec(GOOD), tmp_path)["NEURON_COMPILE_CACHE_URL"] == f"/var/tmp/neuron-compile-cache-{os.geteuid()}"
    own = parse_spec({"name": "t", "command": {"argv": ["true"], "checkpoint_dir": "ck",
                                               "env": {"NEURON_COMPILE_CACHE_URL": "/local/nvme/cache"}}})
    assert attempt_env(own, tmp_path)["NEURON_COMPILE_CACHE_URL"] == "/local/nvme/cache"


def test_skip_to_step_is_where_the_data_goes_on_and_says_the_trainer_can_skip(tmp_path: Path) -> None:
    from supervisor.runfiles import trainer_cmd

    told = parse_spec({"name": "t", "command": {"argv": ["train", "--data-step={skip_to_step}"], "checkpoint_dir": "ck",
                                                "resume": ["--from={checkpoint}"], "env": {"SKIP": "{skip_to_step}"}}})
    assert told.data_skip_unit == "steps" and parse_spec(GOOD).data_skip_unit == "samples"
    assert parse_spec({"name": "t", "command": {"argv": ["train"], "checkpoint_dir": "ck"}}).data_skip_unit is None
    assert trainer_cmd.attempt_argv(told, tmp_path, 1, None, 0) == ("train", "--data-step=1")
    assert trainer_cmd.attempt_argv(told, tmp_path, 2, "/ck/20", 20) == ("train", "--data-step=21", "--from=/ck/20")
    assert trainer_cmd.attempt_argv(told, tmp_path, 2, "/ck/20", 20, 60)[1] == "--data-step=60"
    env = attempt_env(told, tmp_path, 60)
    assert env["TSUP_SKIP_TO_STEP"] == env["SKIP"] == "60"


def test_unreadable_and_invalid_files_are_spec_errors(tmp_path: Path) -> None:
    with pytest.raises(SpecError, match="no such file"):
        load_spec(tmp_path / "absent.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("name = \n")
    with pytest.raises(SpecError, match="not valid TOML"):
        load_spec(bad)


def test_a_stored_spec_that_no_longer_validates_names_the_key() -> None:
    """A spec stored before a rule changed: the same words as for a file, with no file."""
    assert spec_from_json(parse_spec(GOOD).model_dump_json()).name == "t"
    with pytest.raises(SpecError) as e:
        spec_from_json('{"name": "t", "trainer": {"steps": 1}, "resources": {"nodse": 2}}')
    assert str(e.value) == "unknown key 'resources.nodse'"


def test_mqtt_urls() -> None:
    assert parse_mqtt_url("mqtt://127.0.0.1:1884") == ("127.0.0.1", 1884)
    assert parse_mqtt_url("mqtt://broker") == ("broker", 1883)
    with pytest.raises(ValueError, match="bad port"):
        parse_mqtt_url("mqtt://h:99999")


def test_an_auto_checkpoint_interval_is_the_supervisors_to_set(tmp_path: Path) -> None:
    from supervisor.runfiles import trainer_cmd

    base = {"name": "a", "trainer": {"steps": 30, "checkpoint": {"every_steps": "auto"}}}
    spec = parse_spec(base)
    assert spec.auto_checkpoints and not parse_spec({"name": "b", "trainer": {"steps": 3}}).auto_checkpoints
    assert trainer_cmd.trainer_config(spec, tmp_path)["checkpoint"]["every_steps"] == 30, "at most the run's length"
    assert trainer_cmd.trainer_config(spec, tmp_path, every_steps=7)["checkpoint"]["every_steps"] == 7
    trainer_cmd.check_trainer_config(spec, tmp_path)  # the trainer accepts what it is given
    with pytest.raises(SpecError, match="every_steps: expected a number of steps or 'auto'"):
        parse_spec({"name": "c", "trainer": {"steps": 3, "checkpoint": {"every_steps": "often"}}})


def test_the_memory_tiers_auto_interval_is_set_apart_from_the_persistent_one(tmp_path: Path) -> None:
    from supervisor.runfiles import trainer_cmd

    spec = parse_spec({"name": "a", "trainer": {"steps": 300, "checkpoint": {
        "every_steps": 40, "memory_every_steps": "auto", "asynchronous": True}}})
    assert spec.auto_memory_checkpoints and not spec.auto_checkpoints
    config = trainer_cmd.trainer_config(spec, tmp_path)["checkpoint"]
    assert (config["every_steps"], config["memory_every_steps"]) == (40, 10), "a fifth of the first persistent one"
    assert trainer_cmd.trainer_config(spec, tmp_path, memory_every_steps=3)["checkpoint"]["memory_every_steps"] == 3
    trainer_cmd.check_trainer_config(spec, tmp_path)  # the trainer accepts what it is given
    with pytest.raises(SpecError, match="memory_every_steps: expected a number of steps or 'auto'"):
        parse_spec({"name": "c", "trainer": {"steps": 3, "checkpoint": {"memory_every_steps": "often"}}})
    env = trainer_cmd.attempt_env(spec, tmp_path)
    assert env["TSUP_MEMORY_DIR"] == str(trainer_cmd.memory_dir(tmp_path, os.geteuid())), "one memory directory per run"
    assert trainer_cmd.memory_dir(tmp_path, 0) != trainer_cmd.memory_dir(tmp_path / "other", 0)


COMMAND = {"argv": ["torchrun", "train.py"], "checkpoint_dir": "{run_dir}/ck"}


def test_exit_codes_mean_something_only_where_declared() -> None:
    from supervisor.domain import TSUP_EXIT_CODES, ExitMeaning

    assert parse_spec(GOOD).exit_meanings == TSUP_EXIT_CODES, "the reference trainer's table"
    assert parse_spec({"name": "t", "command": COMMAND}).exit_meanings == {}
    assert parse_spec({"name": "t", "command": {**COMMAND, "exit_codes": "tsup"}}).exit_meanings == TSUP_EXIT_CODES
    own = parse_spec({"name": "t", "command": {**COMMAND, "exit_codes": {"7": "device", "9": "do-not-retry"}}})
    assert own.exit_meanings == {7: ExitMeaning.DEVICE, 9: ExitMeaning.DO_NOT_RETRY}


@pytest.mark.parametrize(("exit_codes", "complaint"), [
    ("tsupp", """command.exit_codes: expected "none", "tsup" or a table of codes, got 'tsupp'"""),
    ({"seven": "device"}, "command.exit_codes: 'seven': an exit code is a number from 1 to 255"),
    ({"0": "device"}, "'0': an exit code is a number from 1 to 255"),
    ({"7": "fried"}, "command.exit_codes: 7 = 'fried': expected one of do-not-retry, checkpoint-unreadable, "
                     "device, storage-full"),
])
def test_a_bad_exit_code_table_is_named(exit_codes: object, complaint: str) -> None:
    with pytest.raises(SpecError) as e:
        parse_spec({"name": "t", "command": {**COMMAND, "exit_codes": exit_codes}})
    assert complaint in str(e.value), str(e.value)


def test_cwd_and_srun_args_reach_the_dry_run(tmp_path: Path) -> None:
    spec = tmp_path / "s.toml"
    spec.write_text('name = "t"\n[resources]\nlauncher = "slurm"\n[command]\nargv = ["./train.sh"]\n'
                    'checkpoint_dir = "{run_dir}/ck"\ncwd = "{run_dir}/work"\nsrun_args = ["-l"]\n')
    srun = dry_run(spec)["srun"]
    assert isinstance(srun, list)
    i = srun.index("/bin/sh")
    assert srun[i - 2:i] == ["--chdir=<state-dir>/runs/run-N/work", "-l"] and srun[-1] == "./train.sh"


@pytest.mark.parametrize(("command", "complaint"), [
    ({"srun_args": ["--nodes=3"]}, "command: srun_args: --nodes is the supervisor's to set, for every step"),
    ({"srun_args": ["-N2"]}, "srun_args: -N is the supervisor's to set"),
    ({"srun_args": ["label"]}, "srun_args: 'label' is not an option"),
    ({"cwd": "{workdir}/x"}, "cwd: '{workdir}/x' uses an unknown placeholder"),
    ({"launch": "pod"}, "command.launch: Input should be 'rank' or 'node'"),
    ({"argv": ["torchrun", "--rdzv_endpoint={master}:29500"]}, "argv: '--rdzv_endpoint={master}:29500' uses an "
                                                               "unknown placeholder"),
    ({"env": {"X": "{node_rank}"}}, "env: '{node_rank}' uses an unknown placeholder"),
    ({"cwd": "{master_addr}"}, "cwd: '{master_addr}' uses an unknown placeholder"),
    ({"progress_pattern": "Batch (?P<step>\\d+"}, "command.progress_pattern: 'Batch (?P<step>\\\\d+' is not a "
                                                   "regular expression: missing ), unterminated subpattern"),
    ({"progress_pattern": "Batch (\\d+)"}, "has no (?P<step>...) group"),
    ({"progress_pattern": "(?P<step>\\d+) (?P<lr>\\S+)"}, "unknown group(s) lr; known: step, loss, grad_norm"),
    ({"progress_pattern": "(?P<step>\\d+)(?=ms)"}, "is not a pattern RE2 can match in linear time"),
    ({"progress_pattern": "(?P<step>(\\d)\\2)"}, "no backreferences or lookarounds"),
])
def test_a_bad_command_key_is_named(command: dict[str, object], complaint: str) -> None:
    with pytest.raises(SpecError) as e:
        parse_spec({"name": "t", "command": {**COMMAND, **command}})
    assert complaint in str(e.value), str(e.value)


def dry_run(spec: Path) -> dict[str, object]:
    """`supervisorctl --json submit --dry-run SPEC`, which asks nothing of any daemon."""
    import json
    import os
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "cli.ctl", "--json", "submit", "--dry-run", str(spec)],
                         capture_output=True, text=True, check=True, cwd=REPO,
                         env={**os.environ, "TSUP_CTL_CONFIG": os.devnull})
    return json.loads(out.stdout)  # type: ignore[no-any-return]


def test_a_per_node_torchrun_gets_its_step_in_the_dry_run(tmp_path: Path) -> None:
    """One task per node, the FSDP test case's torchrun line with the step's own values."""
    spec = tmp_path / "s.toml"
    spec.write_text(
        'name = "t"\n[resources]\nlauncher = "slurm"\nnodes = 3\nranks_per_node = 8\n[command]\nlaunch = "node"\n'
        'argv = ["torchrun", "--nnodes={nnodes}", "--nproc_per_node={nproc_per_node}", "--rdzv_id={rdzv_id}",'
        ' "--rdzv_backend=c10d", "--rdzv_endpoint={master_addr}:{master_port}", "train.py"]\n'
        'checkpoint_dir = "{run_dir}/ck"\nenv = {NCCL_SOCKET_IFNAME = "^lo", FIRST = "{master_addr}"}\n')
    srun = dry_run(spec)["srun"]
    assert isinstance(srun, list)
    assert {"--nodes=3", "--ntasks=3", "--ntasks-per-node=1", "--output=<state-dir>/runs/run-N/attempts/1/"
            "node-%t.log"} <= set(srun)
    i = srun.index("/bin/sh")
    assert "NODE_RANK=\"$GROUP_RANK\"" in srun[i + 2] and "SLURM_PROCID" not in srun[i + 2]
    assert srun[i + 4:] == ["torchrun", "--nnodes=3", "--nproc_per_node=8", "--rdzv_id=run-N.a1",
                            "--rdzv_backend=c10d", "--rdzv_endpoint=<address of the first node>:<port>", "train.py"]
    spec.write_text(spec.read_text().replace('launcher = "slurm"', 'launcher = "local"'))
    plan = dry_run(spec)
    assert plan["processes"] == 3 and plan["launch"] == "node"
    assert "--rdzv_endpoint=127.0.0.1:<free port>" in plan["argv"]  # type: ignore[operator]


def test_the_step_fills_only_its_own_markers() -> None:
    from supervisor.domain.step import DEFERRED, Step, readable

    step = Step(nnodes=2, nproc_per_node=4, master_addr="10.0.0.1", master_port=29500, rdzv_id="run-3.a2")
    text = "--rdzv_endpoint={master_addr}:{master_port} --nnodes={nnodes} {{literal}}".format(**DEFERRED)
    assert step.fill(text) == "--rdzv_endpoint=10.0.0.1:29500 --nnodes=2 {literal}"
    assert readable(text) == "--rdzv_endpoint={master_addr}:{master_port} --nnodes={nnodes} {literal}"
    assert step.fill("no markers {here}") == "no markers {here}"


def test_the_probes_options_are_typed_keys_and_an_open_argument_list_is_refused() -> None:
    """H5 of issue 37: health.args was an open argv to a root program on every node
    (--checkpoint-dir with planted links overwrote a root-only file, --drain-self drained
    with no budget, --kernel-log read any file as root)."""
    for args in (["--drain-self"], ["--kernel-log", "/etc/shadow"], ["--instance-type", "trn1.32xlarge"]):
        with pytest.raises(SpecError, match="args is no key of \\[health\\] any more"):
            parse_spec({"name": "t", "trainer": {"steps": 5}, "health": {"args": args}})
    health = parse_spec({"name": "t", "trainer": {"steps": 5}, "health": {
        "instance_type": "trn1.32xlarge", "min_free_gib": 0.5, "bandwidth": True}}).health
    assert health.probe_args() == ("--instance-type", "trn1.32xlarge", "--min-free-gib", "0.5", "--bandwidth")
    with pytest.raises(SpecError, match=r"health\.instance_type"):
        parse_spec({"name": "t", "trainer": {"steps": 5}, "health": {"instance_type": "--drain-self"}})

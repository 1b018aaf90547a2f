"""The reference trainer's memory tier and asynchronous persistent saves, with real ranks
on gloo and no supervisor: two one-rank "nodes" (TSUP_NODE), each node's memory a
directory of its own.

One module-scoped scenario runs the processes once:

1. fault-free: 30 steps, a memory save every 5, persistent saves every 20 beside training;
2. crashed: the same after step 27 (rank 1 raises), leaving the memory saves of steps 20
   and 25 on both nodes;
3. the crashed run's memory, with node n0's memory gone (the node was lost), resumed
   from on the spare n2 and n1.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from supervisor.ports import free_port
from trainer.checkpoint_layout import complete_checkpoints
from wire.files import MANIFEST_FILE

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
TIMEOUT_S = 180


def write_config(directory: Path) -> Path:
    config = directory / "config.toml"
    config.write_text(f'model = "tiny"\nsteps = 30\nglobal_batch_size = 8\noutput_dir = "{directory / "out"}"\n'
                      f'[checkpoint]\ndir = "{directory / "ck"}"\nevery_steps = 20\nasynchronous = true\n'
                      f'memory_every_steps = 5\nmemory_dir = "{directory / "memory"}"\n')
    return config


def launch(config: Path, resume: str, nodes: tuple[str, ...], attempt: int, fault: str = "") -> list[int]:
    """One rank per node; returns the exit codes. Rank r logs to ``rank-r.log`` beside the config."""
    port, procs = free_port(), []
    for rank, node in enumerate(nodes):
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(len(nodes)), "LOCAL_RANK": "0",
               "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
               "TSUP_NODE": node, "TSUP_ATTEMPT": str(attempt), "TSUP_FAULT": fault, "OMP_NUM_THREADS": "1"}
        env.pop("TSUP_MQTT_URL", None)
        with open(config.parent / f"rank-{rank}.log", "w") as log:
            procs.append(subprocess.Popen([sys.executable, "-m", "trainer", "--config", str(config),
                                           "--resume", resume], env=env, stdout=log, stderr=subprocess.STDOUT,
                                          cwd=REPO))
    return [p.wait(timeout=TIMEOUT_S) for p in procs]


def held(memory: Path) -> dict[str, list[str]]:
    """Each node's memory: its save directories' files."""
    return {node.name: sorted(str(f.relative_to(node)) for f in node.rglob("*.pt"))
            for node in sorted(memory.iterdir())} if memory.exists() else {}


@dataclass
class Scenario:
    fault_free: Path
    crashed: Path
    crashed_memory: dict[str, list[str]]
    crash_codes: list[int]


@pytest.fixture(scope="module")
def scenario(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Scenario]:
    fault_free, crashed = tmp_path_factory.mktemp("fault-free"), tmp_path_factory.mktemp("crashed")
    assert launch(write_config(fault_free), "none", ("n0", "n1"), 1) == [0, 0], \
        (fault_free / "rank-0.log").read_text()[-3000:]
    codes = launch(write_config(crashed), "none", ("n0", "n1"), 1, fault="crash@27:1")
    memory = held(crashed / "memory")
    shutil.copytree(crashed / "memory", crashed / "memory-after-crash")
    yield Scenario(fault_free=fault_free, crashed=crashed, crashed_memory=memory, crash_codes=codes)


def digest(directory: Path) -> str:
    return str(json.loads((directory / "out" / "result.json").read_text())["model_digest"])


def test_saves_beside_training_commit_verified_checkpoints_and_a_finished_run_frees_its_memory(
        scenario: Scenario) -> None:
    log = (scenario.fault_free / "rank-0.log").read_text()
    assert "checkpoint step 20 committed to" in log and "(beside training; it blocked" in log
    assert [step for step, _ in complete_checkpoints(scenario.fault_free / "ck")] == [20, 30]
    assert all((path / MANIFEST_FILE).is_file() for _, path in complete_checkpoints(scenario.fault_free / "ck"))
    whole = [int(x) for x in re.findall(r"memory checkpoint step (\d+) whole", log)]
    assert whole == [5, 10, 15, 20, 25], "every 5 steps but the last (the final persistent save covers it)"
    assert held(scenario.fault_free / "memory") == {}, "a finished run leaves nothing in node memory"


def test_each_node_holds_its_ranks_saves_and_the_previous_nodes_replicas(scenario: Scenario) -> None:
    assert scenario.crash_codes == [1, 1]
    assert scenario.crashed_memory == {
        "n0": ["a0001-s00000020/rank_00000.pt", "a0001-s00000020/replica_00001.pt",
               "a0001-s00000025/rank_00000.pt", "a0001-s00000025/replica_00001.pt"],
        "n1": ["a0001-s00000020/rank_00001.pt", "a0001-s00000020/replica_00000.pt",
               "a0001-s00000025/rank_00001.pt", "a0001-s00000025/replica_00000.pt"],
    }, "the two newest whole saves per node: the older goes when the save after the newest starts"
    assert all((scenario.crashed / "memory-after-crash" / node / "a0001-s00000025" / "whole").is_file()
               for node in ("n0", "n1")), "each marked whole once every rank's file and replica were in"


def _restore_memory(scenario: Scenario, lost: tuple[str, ...]) -> None:
    memory = scenario.crashed / "memory"
    shutil.rmtree(memory, ignore_errors=True)
    shutil.copytree(scenario.crashed / "memory-after-crash", memory)
    for node in lost:
        shutil.rmtree(memory / node)
    shutil.rmtree(scenario.crashed / "out", ignore_errors=True)


def test_a_lost_nodes_rank_is_restored_from_its_replica_on_the_other_node_to_the_same_model(
        scenario: Scenario) -> None:
    _restore_memory(scenario, lost=("n0",))
    assert launch(scenario.crashed / "config.toml", "memory:1:25", ("n2", "n1"), 2) == [0, 0], \
        (scenario.crashed / "rank-0.log").read_text()[-3000:]
    log = (scenario.crashed / "rank-0.log").read_text()
    assert "resumed from memory:1:25 at step 25 in " in log
    assert "step 26/30" in log and "step 25/30" not in log
    assert digest(scenario.crashed) == digest(scenario.fault_free)


def test_a_save_whose_node_and_replica_holder_are_both_lost_is_unreadable_exit_3(scenario: Scenario) -> None:
    _restore_memory(scenario, lost=("n0", "n1"))
    assert launch(scenario.crashed / "config.toml", "memory:1:25", ("n2", "n3"), 2) == [3, 3]
    log = (scenario.crashed / "rank-0.log").read_text()
    assert "memory:1:25: rank 0's state after step 25 is on no node of this attempt" in log
    assert not (scenario.crashed / "out" / "result.json").exists()


def test_a_malformed_memory_resume_is_a_usage_error_exit_2(scenario: Scenario) -> None:
    assert launch(scenario.crashed / "config.toml", "memory:one", ("n0",), 3) == [2]
    assert "--resume memory:one: expected memory:ATTEMPT:STEP" in (scenario.crashed / "rank-0.log").read_text()

"""The reference trainer as a pre-training program, on the real data path: a corpus and a
byte-level BPE tokenizer written here (trainer/corpus.py), packed from arrow shards,
trained by real ranks on gloo.

One module-scoped set of runs, all of the same config (global batch 16 in micro-batches
of 2), checked by the tests:

- ``two``: 2 ranks, uninterrupted, 60 steps, validation every 30, a checkpoint every 20;
- ``four``: 4 ranks, the same 60 steps;
- ``killed`` then ``resumed``: 2 ranks SIGKILLed after step 50, then a new attempt
  resuming from the newest checkpoint (step 40).

A last test streams the raw text set, tokenizing it as it goes, killed and resumed.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import REPO, free_port, wait_for
from trainer.corpus import TinyCorpus, write_tiny_corpus

# One worker runs them all: their runs are module-scoped, made once per worker that runs one.
pytestmark = [pytest.mark.integration, pytest.mark.xdist_group("pretraining")]

STEPS = 60
TIMEOUT_S = 300
# 4 ranks against 2 at the same global batch: the same samples in the same steps, the
# gradient means summed in another order. Float rounding is all that may differ; the
# losses must agree to this relative tolerance at every step (as logged, to 4 decimals,
# they were equal at all 120 steps of a longer run when this was written).
CURVE_RTOL = 2e-3
_STEP_LINE = re.compile(r"^step (\d+)/\d+ loss ([0-9.]+) .*?(?: val_loss ([0-9.]+))?$", re.M)


@dataclass
class Trained:
    directory: Path
    codes: list[int]
    log: str

    @property
    def result(self) -> dict[str, Any]:
        data: dict[str, Any] = json.loads((self.directory / "out" / "result.json").read_text())
        return data

    def losses(self) -> dict[int, float]:
        return {int(m[1]): float(m[2]) for m in _STEP_LINE.finditer(self.log)}

    def val_losses(self) -> dict[int, float]:
        return {int(m[1]): float(m[3]) for m in _STEP_LINE.finditer(self.log) if m[3]}


def config(directory: Path, corpus: TinyCorpus, *, streamed_text: bool = False, steps: int = STEPS) -> Path:
    """The tokenized arrow set with a validation split; or (``streamed_text``) the raw text
    set, tokenized as it is streamed. A checkpoint every third of the steps, validation
    at the half and the end."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "config.toml"
    if streamed_text:
        data = f'kind = "text"\npath = "{corpus.text}"\ntokenizer = "{corpus.tokenizer}"\nstreaming = true\n'
        validation = ""
    else:
        data = f'kind = "arrow"\npath = "{corpus.tokens}"\nvalidation_fraction = 0.02\n'
        validation = f"validation_every_steps = {steps // 2}\nvalidation_samples = 32\n"
    path.write_text(
        f"steps = {steps}\nglobal_batch_size = 16\nmicro_batch_size = 2\nseq_len = 64\n{validation}"
        f'output_dir = "{directory / "out"}"\n[data]\n{data}'
        f'[checkpoint]\ndir = "{directory / "ckpt"}"\nevery_steps = {steps // 3}\nkeep = 2\n')
    return path


def train(path: Path, world: int, *, kill_after: int | None = None) -> Trained:
    """``world`` ranks of ``python -m trainer`` with torchrun's variables; rank 0's output.
    ``kill_after``: every rank hangs after that step (TSUP_FAULT) and is SIGKILLed there,
    as the supervisor does to a hung attempt."""
    port, procs = free_port(), []
    log = path.parent / f"rank0-{len(list(path.parent.glob('rank0-*.log')))}.log"
    for rank in range(world):
        env = {k: v for k, v in os.environ.items() if not k.startswith("TSUP_") and k != "OMP_NUM_THREADS"}
        env.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), PYTHONPATH=str(REPO))
        if kill_after is not None:
            env["TSUP_FAULT"] = f"hang@{kill_after}"
        with open(log if rank == 0 else os.devnull, "w") as out:
            procs.append(subprocess.Popen([sys.executable, "-m", "trainer", "--config", str(path)], env=env,
                                          cwd=path.parent, stdout=out, stderr=subprocess.STDOUT))
    if kill_after is not None:
        wait_for(lambda: f"step {kill_after}/" in log.read_text(), TIMEOUT_S, f"step {kill_after}")
        for proc in procs:
            proc.send_signal(signal.SIGKILL)
    codes = [proc.wait(timeout=TIMEOUT_S) for proc in procs]
    return Trained(path.parent, codes, log.read_text())


@dataclass
class Runs:
    corpus: TinyCorpus
    two: Trained
    four: Trained
    killed: Trained
    resumed: Trained


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> TinyCorpus:
    return write_tiny_corpus(tmp_path_factory.mktemp("corpus"), seed=7)


@pytest.fixture(scope="module")
def runs(corpus: TinyCorpus, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Runs]:
    root = tmp_path_factory.mktemp("pretraining")
    two = train(config(root / "two", corpus), 2)
    four = train(config(root / "four", corpus), 4)
    killed_config = config(root / "killed", corpus)
    killed = train(killed_config, 2, kill_after=50)
    resumed = train(killed_config, 2)
    yield Runs(corpus, two, four, killed, resumed)


def test_the_loss_falls_far_below_its_start_on_the_written_corpus(runs: Runs) -> None:
    assert runs.two.codes == [0, 0], runs.two.log[-3000:]
    losses = runs.two.losses()
    assert sorted(losses) == list(range(1, STEPS + 1))
    first, last = losses[1], losses[STEPS]
    assert first > 5.0  # about ln(256): the untrained model guesses
    assert last < 0.5 * first, (first, last)
    # Held out, at steps 30 and 60: falling too (the documents share their grammar).
    val = runs.two.val_losses()
    assert sorted(val) == [30, 60] and val[60] < val[30] < first, val
    print(f"loss {first:.4f} -> {last:.4f}; validation {val}")


def test_four_ranks_and_two_at_the_same_global_batch_follow_the_same_loss_curve(runs: Runs) -> None:
    assert runs.four.codes == [0, 0, 0, 0], runs.four.log[-3000:]
    assert "global batch 16 = 4 x 2 x 2" in runs.four.log and "global batch 16 = 2 x 4 x 2" in runs.two.log
    two, four = runs.two.losses(), runs.four.losses()
    assert sorted(four) == sorted(two)
    worst = max(abs(four[s] - two[s]) / two[s] for s in two)
    assert worst < CURVE_RTOL, f"the curves part by {worst:.2e} (relative) at worst"
    # The held-out loss is shared out over the ranks too: the same number on 4 and 2.
    val_two, val_four = runs.two.val_losses(), runs.four.val_losses()
    assert sorted(val_four) == sorted(val_two) == [30, 60]
    assert all(val_four[s] == pytest.approx(val_two[s], rel=CURVE_RTOL) for s in val_two)
    print(f"largest relative difference over {STEPS} steps: {worst:.2e}")
    assert runs.four.result["consumed_samples"] == runs.two.result["consumed_samples"] == STEPS * 16


def test_a_run_killed_and_resumed_on_the_arrow_data_ends_with_the_uninterrupted_model(runs: Runs) -> None:
    assert runs.killed.codes == [-signal.SIGKILL] * 2 and "step 51/" not in runs.killed.log
    assert runs.resumed.codes == [0, 0], runs.resumed.log[-3000:]
    assert "resumed from" in runs.resumed.log and "step_00000040 at step 40" in runs.resumed.log
    assert runs.resumed.result["model_digest"] == runs.two.result["model_digest"]
    assert runs.resumed.result["final_loss"] == runs.two.result["final_loss"]


def test_mfu_and_tokens_per_s_are_reported(runs: Runs) -> None:
    line = runs.two.log.splitlines()
    last = next(x for x in reversed(line) if x.startswith(f"step {STEPS}/"))
    tokens = float(re.search(r"tokens_per_s (\d+)", last)[1])  # type: ignore[index]
    mfu = re.search(r"mfu ([0-9.]+)%", last)
    assert tokens > 0 and mfu is not None and 0 < float(mfu[1]) < 100, last
    # TensorBoard has every step's numbers and the validation points, as logged.
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    board = EventAccumulator(str(runs.two.directory / "out" / "tensorboard"))
    board.Reload()
    losses = {e.step: e.value for e in board.Scalars("train/loss")}
    assert sorted(losses) == list(range(1, STEPS + 1))
    assert losses[STEPS] == pytest.approx(runs.two.losses()[STEPS], abs=1e-4)
    assert {e.step for e in board.Scalars("val/loss")} == {30, 60}
    assert {"train/mfu", "train/param_norm", "train/tokens_per_s"} <= set(board.Tags()["scalars"])


def test_streamed_text_tokenized_on_the_fly_resumes_after_a_kill_to_the_same_model(
        corpus: TinyCorpus, tmp_path: Path) -> None:
    """The raw text set, tokenized with the written tokenizer as it is streamed: killed
    after step 25 and resumed from step 20, the reader skips to position 20 x 16 and the
    run ends with the model of one that never stopped."""
    whole = train(config(tmp_path / "whole", corpus, streamed_text=True, steps=30), 2)
    assert whole.codes == [0, 0], whole.log[-3000:]
    assert whole.losses()[30] < whole.losses()[1] - 1.0
    path = config(tmp_path / "stopped", corpus, streamed_text=True, steps=30)
    killed = train(path, 2, kill_after=25)
    assert killed.codes == [-signal.SIGKILL] * 2
    resumed = train(path, 2)
    assert resumed.codes == [0, 0], resumed.log[-3000:]
    assert "step_00000020 at step 20" in resumed.log
    assert resumed.result["model_digest"] == whole.result["model_digest"]

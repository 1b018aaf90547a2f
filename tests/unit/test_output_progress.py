"""Progress and fatal errors read from a trainer's own output (supervisor/gathering/output_progress.py)."""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from supervisor.domain import Policy
from supervisor.gathering.output_progress import (
    PATTERNS,
    AttemptOutput,
    ProgressLine,
    fatal_signature,
    formats_for,
    parse_progress,
    read_output,
)
from supervisor.policy import hang_limit
from supervisor.telemetry.view import TelemetryView
from tests.conftest import REPO
from tests.unit.policy_world import obs, rank

FIXTURES = REPO / "tests" / "fixtures" / "output"
NEURON_LOGS = REPO / "tests" / "fixtures" / "health" / "neuron"


def steps_in(name: str) -> list[ProgressLine]:
    lines = (FIXTURES / name).read_text().replace("\r", "\n").splitlines()
    return [x for x in (parse_progress(line, PATTERNS) for line in lines) if x is not None]


def test_the_fsdp_test_cases_batch_lines_are_steps_counted_from_one() -> None:
    got = steps_in("fsdp-test-case.log")
    assert [(x.step, x.loss, x.grad_norm) for x in got[:2]] == [(1, 11.63412, None), (2, 11.60127, None)]
    assert got[2].step == 3 and got[2].loss is not None and math.isnan(got[2].loss)


def test_nxd_step_lines_with_and_without_a_grad_norm() -> None:
    assert [(x.step, x.loss, x.grad_norm) for x in steps_in("nxd.log")] == [(1, 10.875, None), (2, 10.625, 4.125)]


def test_nemo_progress_bar_redraws_are_steps() -> None:
    got = steps_in("nemo.log")
    assert [(x.step, x.loss) for x in got] == [(4, 6.79), (5, 6.702)]
    assert got[0].grad_norm == 6.59 and got[1].grad_norm == math.inf
    assert got[0].step_time_s == pytest.approx(1 / 0.015), "0.02it/s: the slowest rate that prints so"


def test_the_tutorials_progress_bar_is_steps_with_its_step_time() -> None:
    """Seed 003 (HyperPod, Llama 3 8B on NxD Training), its llama.out, lines quoted as
    they are: "Epoch 0:   1%|          | 1/91 [10:35<15:52:47, 635.19s/it]"."""
    got = steps_in("nxdt-tutorial-llama.out")
    assert [(x.step, x.loss, x.grad_norm) for x in got] == [(1, None, None), (2, None, None), (10, None, None)]
    assert [x.step_time_s for x in got] == pytest.approx([635.195, 632.235, 625.595])


@pytest.mark.parametrize(("line", "step", "loss"), [
    # tqdm's format_num writes a float as "{:.3g}" where that is shorter: 2000.0 is "2e+3"
    ("Epoch 0:  40%|####      | 2001/5000 [1:00:00<1:30:00, 1.80s/it, reduced_train_loss=2.350, "
     "global_step=2e+3, consumed_samples=2.05e+6]", 2001, 2.35),
    ("Epoch 0:  40%|####      | 12001/30000 [1:00:00<1:30:00, 1.80s/it, reduced_train_loss=2.35, "
     "global_step=1.2e+4]", 12001, 2.35),
    ("Epoch 0:  40%|####      | 1001/30000 [1:00:00<1:30:00, 1.80s/it, global_step=999.0, loss=nan]", 1000,
     math.nan),
    # NxD Training's own tutorial (docs/tutorials/hf_llama3_8B_pretraining.rst, Lightning 1.8):
    # the running "loss" comes before NeMo's reduced_train_loss, which is the one read.
    ("Epoch 0:   0%|          | 189/301501 [59:12<1573:03:24, 18.79s/it, loss=7.75, v_num=3-16, "
     "reduced_train_loss=7.560, global_step=188.0, consumed_samples=24064.0]", 189, 7.56),
    # The bar's own count, made global with the epoch's length; no total, no rate.
    ("Epoch 2:   6%|6         | 4/62 [03:24<49:27, 14.10it/s]", 2 * 62 + 4, None),
    ("Epoch 0: 10it [1:44:15, 625.59s/it, train_loss=3.1]", 10, 3.1),
    ("Epoch 1:  50%|#####     | 31/62 [03:24<03:24, v_num=3, reduced_train_loss=6.790]", 62 + 31, 6.79),
])
def test_progress_bar_numbers_in_every_form_tqdm_prints_them(line: str, step: int, loss: float | None) -> None:
    got = parse_progress(line, PATTERNS)
    assert got is not None and got.step == step
    assert (got.loss is None) if loss is None else (got.loss == loss or (math.isnan(loss) and math.isnan(got.loss)))


@pytest.mark.parametrize("line", [
    "Validation DataLoader 0:  50%|#####     | 5/10 [00:01<00:01,  4.50it/s]",  # not a training step
    "Map: 100%|##########| 1000/1000 [00:00<00:00, 9431.83 examples/s]",  # a data set's preparation
    "Sanity Checking DataLoader 0: 100%|##########| 2/2 [00:00<00:00,  5.00it/s]",
])
def test_other_progress_bars_are_not_steps(line: str) -> None:
    assert parse_progress(line, PATTERNS) is None


@pytest.mark.parametrize("line", [
    "Epoch 0:   0%|          | 0/91 [00:00<?, ?it/s]",
    # Lightning resets the bar at each epoch's start, a resumed run's too: here one resumed
    # at step 30 of epochs of 16 batches, whose next line is 14/16 with global_step=29.0
    "Epoch 1:   0%|          | 0/16 [00:00<?, ?it/s]",
])
def test_a_bar_reset_to_0_is_no_step(line: str) -> None:
    assert parse_progress(line, PATTERNS) is None


def test_a_635_s_step_read_from_the_bar_sets_the_hang_limit_before_a_second_step_is_read(tmp_path: Path) -> None:
    """The first step's rate is the trainer's own timing: a step read by the poll alone
    would be untimed, and 300 s (hang_timeout_s) would call the tutorial's second step a hang."""
    (tmp_path / "rank-0000.log").write_text((FIXTURES / "nxdt-tutorial-llama.out").read_text().splitlines()[0] + "\r")
    view = TelemetryView()
    for read in read_output(AttemptOutput(), tmp_path, run_id="run-1", attempt=1, ranks_per_node=1,
                            formats=PATTERNS, now=700.0):
        view.apply_from_output(read.msg, 700.0, printed=read.printed)
    p99, samples = view.step_time_p99("run-1", 1)
    assert (p99, samples) == (pytest.approx(635.195), 1)
    limit, why = hang_limit(Policy(), obs(rank(0), step_time_p99_s=p99, step_time_samples=samples),
                            first_step_seen=True)
    assert limit == pytest.approx(3 * 635.195) and "slowest step so far" in why


def test_a_specs_own_pattern_comes_first() -> None:
    formats = formats_for(r"it=(?P<step>\d+) l=(?P<loss>\S+)")
    assert parse_progress("it=7 l=0.5", formats) == ProgressLine(7, 0.5, None)
    assert parse_progress("nothing here", formats) is None


def test_an_exponential_pattern_of_a_spec_is_matched_in_linear_time() -> None:
    """H7 of issue 37: a spec's pattern such as (a+)+ took Python's re exponential time on
    a line that almost matches; RE2 matches it in one pass."""
    formats = formats_for(r"(?:a+)+x (?P<step>\d+)")
    assert parse_progress("aaaa" * 16 + "x 12", formats) == ProgressLine(12, None, None)
    assert _best_time(parse_progress, "a" * 4000 + "!", formats) < 0.05  # Python's re: far beyond


def _best_time(f: Callable[..., object], *args: object) -> float:
    best = math.inf
    for _ in range(3):
        began = time.perf_counter()
        f(*args)
        best = min(best, time.perf_counter() - began)
    return best


@pytest.mark.parametrize("crafted", [
    "Epoch 1 " * 8192,  # the progress bar's pattern: each "Epoch 1" ran to the line's end (1.1 s)
    "Xid (" * 13000,  # the Xid pattern's [^)]* from each "Xid"
    "step 1 step_time " * 3800,  # nxd-pp's ".*step loss"
    "NEURON_HW_ERR=X " * 4000,  # a lookahead of health.neuron's table: bounded, not RE2
])
def test_a_line_crafted_against_a_pattern_is_read_about_as_fast_as_any_line(crafted: str) -> None:
    """H7 of issue 37: crafted 64 KiB lines took Python's re quadratic time on the tick
    (0.53 s a line, 9 s a log file a tick). Every pattern is now one RE2 pass over the line."""
    crafted = crafted[:65536]
    benign = ("LOG Thu - (0, 5) step_loss : 2.34 learning_rate : 1e-4 throughput : 55.5 " * 900)[:65536]
    ratio = _best_time(PATTERNS.read, crafted) / _best_time(PATTERNS.read, benign)
    assert ratio < 20, f"a crafted line took {ratio:.0f} times a benign one of the same length"


@pytest.mark.parametrize(("line", "kind"), [
    ("RuntimeError: CUDA error: uncorrectable ECC error encountered", "device"),
    ("torch.distributed.DistBackendError: NCCL error in: ProcessGroupNCCL.cpp:1970, remote process exited or "
     "there was a network error, NCCL version 2.21.5\nncclRemoteError: A call failed possibly due to a network "
     "error or a remote process exiting prematurely.", "peer"),
    ("[Rank 3] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=9, OpType=ALLREDUCE) ran for 600000 "
     "milliseconds before timing out.", "peer"),
    ("[12345.678] NVRM: Xid (PCI:0000:53:00): 79, pid=1234, GPU has fallen off the bus.", "device"),
    ("NVRM: Xid (PCI:0000:10:1c): 48, pid=1, An uncorrectable double bit error", "device"),
    ("health: Xid 74 on GPU 3", "device"),  # a plain "Xid N", as a tool quotes one
    # An application's own fault, or an event the node survives: not the node's.
    ("NVRM: Xid (PCI:0000:53:00): 13, pid=1234, Graphics SM Warp Exception", None),
    ("NVRM: Xid (PCI:0000:53:00): 31, pid=1234, Ch 00000008, MMU Fault", None),
    ("NVRM: Xid (PCI:0000:53:00): 63, pid=1234, Row Remapper: New row marked for remapping", None),
    ("NVRM: Xid (PCI:0000:53:00): 94, pid=1234, Contained: SM ECC error", None),
    ("NVRM: Xid (PCI:0000:53:00): 999, pid=1, something new", None),  # not in the table: watched
    # The job's configuration: no restart fixes it.
    ("2026-Jan-14 11:23:49.987594 95431:108485 ERROR   ENC:enc_init_comm                           [rank 0] "
     "failed (2) to init a collective algorithm for provided replica group.", "config"),  # seed 003
    ("Cannot find primary config 'hf_llama3_8B_confg'. Check that it's in your config search path.", "config"),
    ("Error: YAML file './conf/hf_llama3_8B_confg.yaml' not found!", "config"),  # NxD Training's train.sh
    ("AssertionError: 32 is not divisible by 12", "config"),
    ("Batch 3 Loss: 1.2, Speed: 2 samples/sec, lr: 0.1", None),
    ("Timeout waiting for RX (waited 120 sec) - retrying", None),  # Neuron: transient, nobody's fault
])
def test_fatal_signatures(line: str, kind: str | None) -> None:
    assert fatal_signature(line) == kind


def test_neuron_runtime_errors_from_real_logs_are_device_or_peer() -> None:
    hw = (NEURON_LOGS / "neuron_runtime_hw_faults_SYNTHESIZED_prefix.log").read_text().splitlines()
    kinds = [fatal_signature(line) for line in hw]
    assert kinds[:4] == ["device"] * 4, "uncorrectable SRAM/HBM errors and a DMA abort are the node's"
    assert kinds[4] == "peer", "a hang in collectives may be a peer's fault"


def test_read_output_turns_new_lines_into_steps_and_times_them(tmp_path: Path) -> None:
    state = AttemptOutput()
    log = tmp_path / "node-0001.local-2.log"
    log.write_text("starting\nBatch 0 Loss: 2.0, Speed: 1 samples/sec, lr: 0.1\nBatch 1 Loss: 1.9, Sp")

    def read(now: float) -> list[tuple[int, int, float, float]]:
        got = read_output(state, tmp_path, run_id="run-1", attempt=2, ranks_per_node=4, formats=PATTERNS, now=now)
        return [(r.msg.rank, r.msg.step, r.msg.loss, r.msg.step_time_s) for r in got]

    assert read(100.0) == [(4, 1, 2.0, 0.0)], "a node's lines are its first rank's; the first step is untimed"
    with open(log, "a") as f:
        f.write("eed: 1 samples/sec, lr: 0.1\nBatch 2 Loss: 1.8, Speed: 1 samples/sec, lr: 0.1\n")
    assert read(103.0) == [(4, 2, 1.9, 1.5), (4, 3, 1.8, 1.5)], "a line completed later; 3 s over 2 steps"
    assert read(104.0) == [] and state.line_at == 103.0
    with open(log, "a") as f:  # the next epoch: the batch index starts again
        f.write("Batch 0 Loss: 1.7, Speed: 1 samples/sec, lr: 0.1\n")
    assert read(104.5) == [] and state.line_at == 104.5, "no new step, but training goes on"
    with open(log, "a") as f:
        f.write("RuntimeError: CUDA error: uncorrectable ECC error encountered\n")
    read(105.0)
    assert state.fatal[4].kind == "device" and "ECC" in state.fatal[4].line


def test_a_restarted_reader_reads_on_from_the_offsets_kept_not_from_the_start(tmp_path: Path) -> None:
    """Issue 37, item 5: the restarted daemon re-read every log from offset 0 (weeks of
    output, its steps replayed). The offsets kept end at a whole line: a line half
    written when they were taken is read whole."""
    log = tmp_path / "rank-0000.log"
    log.write_text("".join(f"Batch {i} Loss: 2.0, Speed: 1 samples/sec, lr: 0.1\n" for i in range(1000))
                   + "Batch 1000 Lo")
    first = AttemptOutput()
    read_output(first, tmp_path, run_id="r", attempt=1, ranks_per_node=1, formats=PATTERNS, now=1.0)
    kept = json.dumps(first.offsets())
    assert first.offsets() == {"rank-0000.log": log.stat().st_size - len("Batch 1000 Lo")}
    with open(log, "a") as f:
        f.write("ss: 1.9, Speed: 1 samples/sec, lr: 0.1\nBatch 1001 Loss: 1.8, Speed: 1 samples/sec, lr: 0.1\n")
    again = AttemptOutput()
    again.resume(kept)
    got = read_output(again, tmp_path, run_id="r", attempt=1, ranks_per_node=1, formats=PATTERNS, now=2.0)
    assert [(r.msg.step, r.msg.loss) for r in got] == [(1001, 1.9), (1002, 1.8)]


@pytest.mark.parametrize("kept", ['{"rank-0000.log": -5}', '{"rank-0000.log": "x"}', "[1]", "not json",
                                  json.dumps({f"rank-{i}.log": 0 for i in range(9000)})])
def test_offsets_that_are_not_ones_are_ignored(kept: str) -> None:
    state = AttemptOutput()
    state.resume(kept)
    assert state.files == {}


def test_a_tick_reads_until_its_budget_is_spent_and_the_next_begins_with_the_files_left(tmp_path: Path) -> None:
    for i in range(6):
        (tmp_path / f"rank-{i:04d}.log").write_text(f"Batch {i} Loss: 2.0, Speed: 1 samples/sec, lr: 0.1\n")
    state = AttemptOutput()

    def ranks_read(budget_s: float) -> list[int]:
        got = read_output(state, tmp_path, run_id="r", attempt=1, ranks_per_node=1, formats=PATTERNS,
                          now=1.0, budget_s=budget_s)
        return [r.msg.rank for r in got]

    assert ranks_read(0.0) == [0], "one file at least, whatever the budget"
    assert ranks_read(0.0) == [1], "the next tick begins where the last stopped"
    assert sorted(ranks_read(10.0)) == [2, 3, 4, 5]


def test_a_missing_log_directory_reads_as_nothing(tmp_path: Path) -> None:
    assert read_output(AttemptOutput(), tmp_path / "absent", run_id="run-1", attempt=1, ranks_per_node=1,
                       formats=PATTERNS, now=1.0) == []


def test_a_configuration_error_outranks_the_collectives_errors_printed_before_it(tmp_path: Path) -> None:
    state = AttemptOutput()
    (tmp_path / "rank-0000.log").write_text(
        "ncclRemoteError: A call failed possibly due to a network error or a remote process exiting prematurely.\n"
        "ERROR   ENC:enc_init_comm   [rank 0] failed (2) to init a collective algorithm for provided replica group.\n"
        "RuntimeError: CUDA error: uncorrectable ECC error encountered\n")
    read_output(state, tmp_path, run_id="run-1", attempt=1, ranks_per_node=1, formats=PATTERNS, now=1.0)
    assert state.fatal[0].kind == "config" and "replica group" in state.fatal[0].line


@pytest.mark.parametrize("line", [
    "2024-11-07 09:57:13.000144:  39810  INFO ||NEURON_PARALLEL_COMPILE||: Total graphs: 12",
    "INFO ||PARALLEL_COMPILE||: Total successful compilations: 12",  # NxD Training's 8B tutorial's spelling
    "INFO ||NEURON_CC_WRAPPER||: Extracting graphs (/tmp/x.hlo) for ahead-of-time parallel compilation. "
    "No compilation was done.",
    "Compiler status PASS",
])
def test_neuron_compile_lines_put_the_rank_in_its_compile_phase(tmp_path: Path, line: str) -> None:
    state = AttemptOutput()
    (tmp_path / "node-0000.log").write_text(line + "\n")
    read_output(state, tmp_path, run_id="run-1", attempt=1, ranks_per_node=32, formats=PATTERNS, now=1.0)
    assert state.phases == {0: "compile"}

"""Progress and fatal errors read from a trainer's own output (supervisor/output_progress.py)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from supervisor.output_progress import (
    PATTERNS,
    AttemptOutput,
    ProgressLine,
    fatal_signature,
    formats_for,
    parse_progress,
    read_output,
)
from tests.conftest import REPO

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


def test_a_specs_own_pattern_comes_first() -> None:
    formats = formats_for(r"it=(?P<step>\d+) l=(?P<loss>\S+)")
    assert parse_progress("it=7 l=0.5", formats) == ProgressLine(7, 0.5, None)
    assert parse_progress("nothing here", formats) is None


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


def test_a_missing_log_directory_reads_as_nothing(tmp_path: Path) -> None:
    assert read_output(AttemptOutput(), tmp_path / "absent", run_id="run-1", attempt=1, ranks_per_node=1,
                       formats=PATTERNS, now=1.0) == []

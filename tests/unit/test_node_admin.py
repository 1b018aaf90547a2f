"""systemd/node-admin, the one program the daemon's sudo rule admits: which forms it takes
whole and which it refuses, without sudo or Slurm (tests/e2e/test_least_privilege.py runs
it through real sudo against the box's real scontrol)."""

from __future__ import annotations

import importlib.machinery
import importlib.util
import subprocess
from types import ModuleType
from typing import Any

import pytest

from tests.conftest import REPO


@pytest.fixture
def helper(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    loader = importlib.machinery.SourceFileLoader("node_admin", str(REPO / "systemd" / "node-admin"))
    spec = importlib.util.spec_from_loader("node_admin", loader)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    known = {"node1", "node2", "trn-17"}

    def run(scontrol: str, slurm_conf: str | None, args: list[str]) -> Any:
        ok = args[:3] == ["-o", "show", "node"] and args[3] in known
        return subprocess.CompletedProcess(args, 0 if ok else 1, f"NodeName={args[3]} Arch=x86_64" if ok else "", "")

    monkeypatch.setattr(module, "run", run)
    monkeypatch.setenv("SUDO_USER", "tsup-op")
    return module


ADMITTED = [
    ["update", "NodeName=node1", "State=DRAIN", "Reason=training-supervisor: probe: neuron-ls: 15 of 16 (run-1)"],
    ["update", "NodeName=trn-17", "State=FAIL", "Reason=Action:Replace"],
    ["update", "NodeName=node1,node2", "State=RESUME"],
    ["create", "reservation", "ReservationName=tsup-0a1b2c3d-probe", "Nodes=node1,node2", "Users=tsup-op",
     "StartTime=now", "Duration=3", "Flags=MAINT,IGNORE_JOBS"],
    ["delete", "ReservationName=tsup-0a1b2c3d-probe"],
]
REFUSED = [
    ["update", "NodeName=ALL", "State=RESUME"],
    ["update", "NodeName=node[1-2]", "State=RESUME"],
    ["update", "NodeName=node9", "State=DRAIN", "Reason=x"],
    ["update", "NodeName=node1", "State=DRAIN", "Reason=x", "NodeAddr=10.6.6.6"],
    ["update", "NodeName=node1", "State=DRAIN", "Reason=x Weight=1"],
    ["update", "NodeName=node1", "State=DRAIN", "Reason=a\nb"],
    ["update", "NodeName=node1", "State=DOWN", "Reason=x"],
    ["update", "NodeName=node1", "State=RESUME", "NodeAddr=1.2.3.4"],
    ["create", "reservation", "ReservationName=tsup-0a1b2c3d-probe", "Nodes=ALL", "Users=tsup-op",
     "StartTime=now", "Duration=3", "Flags=MAINT,IGNORE_JOBS"],
    ["create", "reservation", "ReservationName=tsup-0a1b2c3d-probe", "Nodes=node1", "Users=root",
     "StartTime=now", "Duration=3", "Flags=MAINT,IGNORE_JOBS"],
    ["create", "reservation", "ReservationName=tsup-0a1b2c3d-probe", "Nodes=node1", "Users=tsup-op",
     "StartTime=now", "Duration=999999999", "Flags=MAINT,IGNORE_JOBS"],
    ["create", "reservation", "ReservationName=mine", "Nodes=node1", "Users=tsup-op", "StartTime=now",
     "Duration=3", "Flags=MAINT,IGNORE_JOBS"],
    ["delete", "ReservationName=someone-elses"],
    ["update", "PartitionName=debug", "State=DOWN"],
    ["write", "batch_script", "5", "/etc/passwd"],
    ["cancel", "5"],
    [],
]


@pytest.mark.parametrize("argv", ADMITTED)
def test_the_daemons_node_commands_are_taken_whole(helper: ModuleType, argv: list[str]) -> None:
    assert helper.checked(argv, "/usr/bin/scontrol", None) == argv


@pytest.mark.parametrize("argv", REFUSED)
def test_anything_else_is_refused(helper: ModuleType, argv: list[str]) -> None:
    with pytest.raises(helper.Refused):
        helper.checked(argv, "/usr/bin/scontrol", None)


def test_the_daemons_own_commands_are_among_the_admitted_forms(helper: ModuleType) -> None:
    """What supervisor/slurm/nodes.py sends for a drain and an undrain, checked by the helper."""
    from supervisor.slurm.nodes import SlurmNodes

    class Recorder:
        def __init__(self) -> None:
            self.ran: list[list[str]] = []

        def admin(self, argv: list[str]) -> Any:
            self.ran.append(argv)
            return type("Reply", (), {"ok": True, "why": "", "out": ""})()

        def run(self, argv: list[str], **_: Any) -> Any:
            return self.admin(argv)

    recorder = Recorder()
    nodes = SlurmNodes(recorder, type("State", (), {"refresh": lambda self: None})(),  # type: ignore[arg-type]
                       prefix="tsup-0a1b2c3d")
    nodes.drain("node1", "training-supervisor: device fault reported by the trainer: loss=nan (run-1)")
    nodes.undrain("node1")
    assert recorder.ran
    for argv in recorder.ran:
        assert argv[0] == "scontrol" and helper.checked(argv[1:], "/usr/bin/scontrol", None) == argv[1:]


def test_a_call_that_is_not_scontrol_is_refused_before_anything_runs(helper: ModuleType,
                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    assert helper.main(["/bin/sh", "-c", "id"]) == 2
    assert "node-admin: refused" in capsys.readouterr().err

"""The EFA checks (health/efa.py) on real fi_info outputs and a real hw_counters listing
(tests/fixtures/health/efa/README.md says where each comes from)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from health import efa
from health.model import Action, Status
from tests.conftest import REPO
from tests.fake_tools.replay import make_tools

FIXTURES = REPO / "tests" / "fixtures" / "health" / "efa"


def fixture(name: str) -> str:
    return (FIXTURES / name).read_text()


def sysfs_from_more(listing: str, root: Path, state: str = "4: ACTIVE") -> Path:
    """A /sys/class/infiniband tree from ``more .../hw_counters/* | cat``'s output: each
    path line followed by its value."""
    lines = [ln for ln in listing.splitlines() if ln and not set(ln) <= {":"}]
    for path, value in zip(lines[::2], lines[1::2], strict=True):
        f = root / Path(path).relative_to("/sys/class/infiniband")
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text(value + "\n")
        (f.parent.parent / "state").write_text(state + "\n")
    return root


def test_fi_info_lists_the_devices_once_each_whatever_the_libfabric() -> None:
    assert efa.parse_fi_info(fixture("fi_info_p4de.24xlarge_rdm.txt")) == {
        "rdmap16s27", "rdmap32s27", "rdmap144s27", "rdmap160s27"}
    assert efa.parse_fi_info(fixture("fi_info_hpc6a_rdm_dgram.txt")) == {"rdmap0s6"}
    assert efa.parse_fi_info(fixture("fi_info_libfabric2_efa_direct.txt")) == {"rdmap49s0"}
    assert efa.parse_fi_info(fixture("fi_info_no_device.txt")) == set()


@pytest.mark.parametrize("garbage", ["", "fi_info: command failed\n", "provider: tcp\n    domain: eth0\n",
                                     fixture("fi_info_p4de.24xlarge_rdm.txt")[:20]])
def test_output_that_lists_no_efa_endpoint_is_no_answer(garbage: str) -> None:
    found = efa.parse_fi_info(garbage)
    assert isinstance(found, str) and found.startswith("no EFA endpoint")
    f = efa.check_devices(found, "p4d.24xlarge")
    assert f.status is Status.UNKNOWN and f.evidence.startswith("unknown: probe failed:")


def test_the_device_count_is_held_against_the_instance_type() -> None:
    four = efa.parse_fi_info(fixture("fi_info_p4de.24xlarge_rdm.txt"))
    ok = efa.check_devices(four, "p4de.24xlarge")
    assert ok.status is Status.HEALTHY and ok.evidence == "4 EFA devices of the 4 a p4de.24xlarge has"
    short = efa.check_devices(four, "p5.48xlarge")
    assert (short.status, short.action) == (Status.UNHEALTHY, Action.REPLACE)
    assert short.evidence.startswith("4 EFA devices of the 32 a p5.48xlarge has (rdmap144s27, ")
    none = efa.check_devices(set(), "trn1.32xlarge")
    assert none.status is Status.UNHEALTHY and "(none: fi_getinfo -61)" in none.evidence
    unknown_type = efa.check_devices(four, None)
    assert unknown_type.status is Status.HEALTHY and "no count known for this node" in unknown_type.evidence


def test_the_counters_are_read_from_sysfs_and_a_port_not_active_is_unhealthy(tmp_path: Path) -> None:
    root = sysfs_from_more(fixture("hw_counters_rdmap0s31_more.txt"), tmp_path / "ib")
    [port] = efa.read_ports(root)
    assert (port.key, port.state) == ("rdmap0s31/1", "ACTIVE")
    assert port.counters["lifespan"] == 12 and port.counters["retrans_timeout_events"] == 0
    assert set(efa.ERROR_COUNTERS) <= set(port.counters)
    assert efa.check_ports([port]) is None
    (root / "rdmap0s31" / "ports" / "1" / "state").write_text("1: DOWN\n")
    down = efa.check_ports(efa.read_ports(root))
    assert down is not None and down.status is Status.UNHEALTHY and down.evidence == \
        "EFA port not active: rdmap0s31/1 DOWN"


def test_error_counters_that_grew_since_the_last_probe_are_reported_never_judged(tmp_path: Path) -> None:
    root = sysfs_from_more(fixture("hw_counters_rdmap0s31_more.txt"), tmp_path / "ib")
    before = {p.key: p.counters for p in efa.read_ports(root)}
    assert efa.check_growth(efa.read_ports(root), before) is None
    counters = root / "rdmap0s31" / "ports" / "1" / "hw_counters"
    (counters / "unresponsive_remote_events").write_text("3\n")
    (counters / "tx_pkts").write_text("123456\n")  # traffic is no error
    grew = efa.check_growth(efa.read_ports(root), before)
    assert grew is not None and grew.status is Status.DEGRADED and grew.action is Action.NONE
    assert grew.evidence == "EFA error counters grew since the last probe: rdmap0s31/1 unresponsive_remote_events +3"
    reset = {"rdmap0s31/1": {**before["rdmap0s31/1"], "unresponsive_remote_events": 9}}
    after_reset = efa.check_growth(efa.read_ports(root), reset)
    assert after_reset is not None and "unresponsive_remote_events +3" in after_reset.evidence, \
        "a counter that went down was reset: its growth is its value"


def test_the_probe_keeps_its_reading_and_compares_the_next_with_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TSUP_HEALTH_TOOLS", str(make_tools(tmp_path / "tools", ["fi_info"])))
    hw = tmp_path / "hw" / "default"
    hw.mkdir(parents=True)
    (hw / "fi_info").write_text(fixture("fi_info_hpc6a_rdm_dgram.txt"))
    monkeypatch.setenv("TSUP_FAKE_HW", str(tmp_path / "hw"))
    root = sysfs_from_more(fixture("hw_counters_rdmap0s31_more.txt"), tmp_path / "ib")
    state = tmp_path / "efa-state.json"
    first = efa.probe(None, root=root, state_file=state)
    assert [f.status for f in first] == [Status.HEALTHY] and "1 EFA devices (rdmap0s6)" in first[0].evidence
    assert json.loads(state.read_text())["rdmap0s31/1"]["lifespan"] == 12
    (root / "rdmap0s31" / "ports" / "1" / "hw_counters" / "rx_drops").write_text("40\n")
    second = efa.probe(None, root=root, state_file=state)
    assert [f.status for f in second] == [Status.HEALTHY, Status.DEGRADED]
    assert "rx_drops +40" in second[1].evidence
    assert [f.status for f in efa.probe(None, root=root, state_file=state)] == [Status.HEALTHY]


def test_a_reading_that_is_not_this_users_own_file_is_not_read(tmp_path: Path) -> None:
    real = tmp_path / "planted.json"
    real.write_text(json.dumps({"rdmap0s31/1": {"rx_drops": 0}}))
    link = tmp_path / "state.json"
    link.symlink_to(real)
    assert efa._last(link) == {}, "a symlink is not followed"
    assert efa._last(real) == {"rdmap0s31/1": {"rx_drops": 0}}
    if os.geteuid() == 0:
        os.chown(real, 65534, 65534)
        assert efa._last(real) == {}, "another user's file is not read"
    fifo = tmp_path / "fifo.json"
    os.mkfifo(fifo)
    assert efa._last(fifo) == {}, "a FIFO neither blocks the probe nor is read"


def test_a_node_without_fi_info_has_no_efa(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.delenv("TSUP_HEALTH_TOOLS", raising=False)
    [f] = efa.probe("p5.48xlarge", root=tmp_path, state_file=None)
    assert f.status is Status.HEALTHY and f.evidence == "no EFA devices found (fi_info not installed)"

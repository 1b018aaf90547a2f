"""The status page (api/status.html) rendered by real headless Chromium, against the real
app over a real socket and a real SQLite store holding one recorded run (two attempts,
a fault between them, a loss curve), a newer cancelled run that must not be the default
selection, and three nodes, one drained. And the page of an empty store.

Chromium dumps the DOM after its scripts ran (virtual time lets the page's fetches and
first render finish), and takes a screenshot that is checked for the curve's and the
fault marker's colours.
"""

from __future__ import annotations

import math
import re
import shutil
import subprocess
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from html.parser import HTMLParser
from pathlib import Path

import pytest
import uvicorn

import wire as p
from api.app import create_app
from api.auth import TokenAuth
from supervisor.domain import (
    Attempt,
    AttemptOutcome,
    AttemptState,
    FaultKind,
    Node,
    NodeState,
    Policy,
    ProbeRecord,
    RunState,
)
from supervisor.launchers.local import LocalLauncher
from supervisor.metrics import SupervisorMetrics
from supervisor.recorder import TelemetryRecorder
from supervisor.service import SupervisorService
from supervisor.store import SqlStore
from supervisor.telemetry.view import TelemetryView
from tests.conftest import free_port, port_open, require, wait_for

pytestmark = pytest.mark.e2e

LOSS_RGB = (0x1F, 0x77, 0xB4)
FAULT_RGB = (0xD6, 0x27, 0x28)
DRAIN_REASON = "ECC errors on GPU 3 (probe)"
RESUME_STEP = 40  # attempt 2 resumes from the checkpoint at step 40
STEPS_1, STEPS_2 = range(1, 51), range(RESUME_STEP + 1, 81)  # attempt 1 reached 50, attempt 2 is at 80
FINAL_STEPS = 80  # the final trajectory: 1..40 of attempt 1, 41..80 of attempt 2


def _loss(step: int, attempt: int) -> float:
    return 1.5 + 4.0 * math.exp(-step / 30) + 0.03 * math.sin(step * 1.7 + attempt)


def _record_run(store: SqlStore, tmp_path: Path) -> None:
    now = time.time()
    t0 = now - 600
    with store.tx() as tx:
        run = tx.create_run(name="tiny-llama", spec_json="{}", run_dir_root=tmp_path / "runs", nodes=2,
                            ranks_per_node=2, spares=1, total_steps=100, policy=Policy(), now=t0)
        n = run.number
        tx.update_run(n, state=RunState.RUNNING, reason="attempt 2 is training", started_at=t0 + 5)
        # Attempt 1: steps 1..50 every 5 s, then a rank exits on node-c.
        tx.add_attempt(Attempt(run_number=n, number=1, state=AttemptState.LAUNCHING, nodes=("node-a", "node-c"),
                               resume_from=None, resume_step=0, created_at=t0))
        tx.update_attempt(n, 1, state=AttemptState.RUNNING, started_at=t0 + 5, first_step_at=t0 + 30)
        steps = [(1, step, t0 + 25 + 5 * step) for step in STEPS_1]
        tx.record_checkpoint(n, step=RESUME_STEP, path=str(tmp_path / "ckpt" / "step-40"), complete=True,
                             duration_s=2.0, attempt=1, now=t0 + 25 + 5 * RESUME_STEP)
        tx.add_fault(n, attempt=1, kind=FaultKind.RANK_EXIT, ranks=[2], nodes=["node-c"], step=50,
                     summary="rank 2 exited with signal 9", now=t0 + 285)
        tx.update_attempt(n, 1, state=AttemptState.ENDED, ended_at=t0 + 295, outcome=AttemptOutcome.FAILED,
                          reason="rank-exit", final_step=50)
        tx.mark_faults_recovered(n, t0 + 340)
        # Attempt 2: resumed at step 40 on a spare, now at step 80 and still training.
        tx.add_attempt(Attempt(run_number=n, number=2, state=AttemptState.RUNNING, nodes=("node-a", "node-b"),
                               resume_from=str(tmp_path / "ckpt" / "step-40"), resume_step=RESUME_STEP,
                               created_at=t0 + 300, started_at=t0 + 305, first_step_at=t0 + 330))
        steps += [(2, step, t0 + 330 + 5 * (step - RESUME_STEP)) for step in STEPS_2]
        tx.put_node(Node(name="node-a", state=NodeState.ALLOCATED, run_number=n), now)
        tx.put_node(Node(name="node-b", state=NodeState.ALLOCATED, run_number=n), now)
        tx.put_node(Node(name="node-c", state=NodeState.DRAINED, reason=DRAIN_REASON), now)
        tx.add_probe(ProbeRecord(node="node-c", at=t0 + 290, kind="diagnosis", status="unhealthy",
                                 action="replace", reason=DRAIN_REASON, findings=[], run_number=n))
        # A newer run, already cancelled: the page selects the newest run that is still live.
        other = tx.create_run(name="smoke", spec_json="{}", run_dir_root=tmp_path / "runs", nodes=1,
                              ranks_per_node=1, spares=0, total_steps=10, policy=Policy(), now=t0 + 400)
        tx.update_run(other.number, state=RunState.CANCELLED, reason="cancelled by an operator",
                      ended_at=t0 + 410)
    telemetry = TelemetryView()  # rank 0's steps, recorded as the daemon records them
    for attempt, step, at in steps:
        telemetry.ingest(*p.encode(p.StepMetrics(run="run-1", attempt=attempt, rank=0, ts=0.0, step=step,
                                                 loss=_loss(step, attempt), grad_norm=1.0, lr=3e-4, step_time_s=5.0,
                                                 tokens_per_s=1000.0)), at)
    TelemetryRecorder(store, telemetry).record()


@dataclass
class _Element:
    tag: str
    attrs: dict[str, str]
    content: list[_Element | str] = field(default_factory=list)  # children and text, in document order

    @property
    def children(self) -> list[_Element]:
        return [c for c in self.content if isinstance(c, _Element)]

    def cls(self) -> set[str]:
        return set(self.attrs.get("class", "").split())

    def all_text(self) -> str:
        return "".join(c if isinstance(c, str) else c.all_text() for c in self.content)

    def find(self, tag: str | None = None, *, id: str | None = None, cls: str | None = None) -> list[_Element]:
        found = []
        for c in self.children:
            if ((tag is None or c.tag == tag) and (id is None or c.attrs.get("id") == id)
                    and (cls is None or cls in c.cls())):
                found.append(c)
            found.extend(c.find(tag, id=id, cls=cls))
        return found

    def one(self, tag: str | None = None, *, id: str | None = None) -> _Element:
        [found] = self.find(tag, id=id)
        return found


class _Tree(HTMLParser):
    """Just enough of a DOM: elements, their attributes and text."""

    VOID = frozenset({"meta", "link", "br", "hr", "img", "input", "col", "area", "base", "source", "wbr"})

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.root = _Element("#root", {})
        self.stack = [self.root]

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        e = _Element(tag, {k: v or "" for k, v in attrs})
        self.stack[-1].content.append(e)
        if tag not in self.VOID:
            self.stack.append(e)

    def handle_startendtag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.stack[-1].content.append(_Element(tag, {k: v or "" for k, v in attrs}))

    def handle_endtag(self, tag: str) -> None:
        for i in range(len(self.stack) - 1, 0, -1):
            if self.stack[i].tag == tag:
                del self.stack[i:]
                return

    def handle_data(self, data: str) -> None:
        self.stack[-1].content.append(data)


def _parse(html: str) -> _Element:
    tree = _Tree()
    tree.feed(html)
    tree.close()
    return tree.root


READ_TOKEN = "r" * 43


@contextmanager
def _serve(tmp_path: Path, record: bool) -> Iterator[str]:
    """The app over a real store (with the recorded run, or empty) on a free port; its URL."""
    store = SqlStore(tmp_path / "supervisor.db")
    store.open()
    if record:
        _record_run(store, tmp_path)
    service = SupervisorService(store, tmp_path / "runs", allow_root_runs=True, mqtt_url=None, launcher=LocalLauncher(max_nodes=4),
                                check_trainer=False)
    app = create_app(service, TokenAuth("t" * 43, read_token=READ_TOKEN),
                     metrics=SupervisorMetrics(store, TelemetryView(), lambda: True))
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning",
                                           lifespan="off"))
    thread = threading.Thread(target=server.run, name="status-page-api", daemon=True)
    thread.start()
    try:
        wait_for(lambda: port_open(port) or not thread.is_alive(), 20, "the API to listen")
        assert thread.is_alive(), "uvicorn exited before listening"
        yield f"http://127.0.0.1:{port}/#token={READ_TOKEN}"  # a link with the read-only token
    finally:
        server.should_exit = True
        thread.join(10)
        store.close()


@pytest.fixture(autouse=True)
def _needs_chromium() -> None:
    require("chromium (Debian's chromium package)", shutil.which("chromium") is not None)


# The page polls every 5 s and says when a fetch failed, then tries again (api/status.html):
# a budget of three polls lets a fetch that a loaded host failed be retried, as a
# user's page would, before the page is read.
_BUDGET_MS = 16_000


def _chromium(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    profile = tmp_path / f"chromium-profile-{len(list(tmp_path.glob('chromium-profile-*')))}"
    profile.mkdir()
    argv = ["chromium", "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
            "--disable-background-networking", "--disable-component-update", "--disable-sync",
            f"--user-data-dir={profile}", f"--virtual-time-budget={_BUDGET_MS}", *args]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 0, f"chromium exited {proc.returncode}:\n{proc.stderr[-3000:]}"
    return proc


def _near(rgb: tuple[int, ...] | float, target: tuple[int, int, int], tolerance: int = 30) -> bool:
    return isinstance(rgb, tuple) and all(abs(a - b) <= tolerance for a, b in zip(rgb[:3], target, strict=True))


def test_the_status_page_renders_the_run_its_faults_loss_curve_and_nodes(tmp_path: Path) -> None:
    from PIL import Image

    shot = tmp_path / "page.png"
    with _serve(tmp_path, record=True) as url:
        dom = _chromium(tmp_path, "--dump-dom", url).stdout
        _chromium(tmp_path, "--window-size=1280,1400", f"--screenshot={shot}", url)
    doc = _parse(dom)

    # The runs table, newest first: the live run-1 is selected, not the newer cancelled run-2.
    rows = doc.one("table", id="runs").one("tbody").find("tr")
    assert [r.attrs.get("data-run") for r in rows] == ["run-2", "run-1"], dom[:3000]
    cells = [td.all_text().strip() for td in rows[1].find("td")]
    assert cells[:3] == ["run-1", "tiny-llama", "RUNNING"] and cells[3] == "80 / 100" and cells[4] == "2", cells
    assert "selected" in rows[1].cls() and "selected" not in rows[0].cls()
    assert "CANCELLED" in rows[0].all_text()

    # The run's detail: headline with state and ETTR, and every goodput category.
    detail = doc.one("section", id="run-detail")
    assert "hidden" not in detail.attrs
    headline = detail.one(id="headline").all_text()
    assert "RUNNING" in headline and "attempt 2 is training" in headline
    assert re.search(r"ETTR\s*\d+(\.\d)? %", headline), headline
    goodput = detail.one(id="goodput").all_text()
    for part in ("productive", "lost", "checkpoint", "startup", "detection", "recovery", "other"):
        assert part in goodput, goodput

    # The timeline: two attempts (failed, then running) and one fault marker with its tooltip.
    timeline = doc.one("svg", id="timeline")
    attempts = timeline.find("rect", cls="attempt")
    assert len(attempts) == 2
    assert [a.attrs["fill"].lower() for a in attempts] == ["#f28e8c", "#7fb3e6"]
    faults = [e for e in timeline.find(cls="fault") if e.tag in ("path", "polygon")]
    assert len(faults) == 1 and faults[0].attrs["fill"].lower() == "#d62728"
    titles = [t.all_text() for t in timeline.find("title")]
    assert any("rank-exit" in t and "step 50" in t and "signal 9" in t for t in titles), titles
    assert any("attempt 1" in t and "node-c" in t for t in titles), titles

    # The loss curve: the final trajectory, one point a step, in the loss colour.
    curve = doc.one("svg", id="loss-curve")
    [loss] = curve.find("polyline", cls="loss")
    points = loss.attrs["points"].split()
    assert abs(len(points) - FINAL_STEPS) <= 2, len(points)
    assert loss.attrs["stroke"].lower() == "#1f77b4" and float(loss.attrs["stroke-width"]) >= 2
    ys = [float(p.split(",")[1]) for p in points]
    assert ys[0] < ys[-1], "a falling loss is drawn going down the page (SVG y grows downwards)"
    assert len(curve.find("text")) >= 6, "axes with tick labels"
    lost = curve.find("polyline", cls="loss-lost")
    assert sum(len(p.attrs["points"].split()) for p in lost) == len(STEPS_1) - RESUME_STEP  # 41..50 redone

    # The nodes table: three nodes, the drained one highlighted with its reason and probe.
    node_rows = doc.one("table", id="nodes").one("tbody").find("tr")
    assert len(node_rows) == 3
    drained = [r for r in node_rows if "DRAINED" in r.all_text()]
    assert len(drained) == 1 and "drained" in drained[0].cls()
    assert DRAIN_REASON in drained[0].all_text() and "unhealthy" in drained[0].all_text()

    assert re.search(r"updated \d\d:\d\d:\d\d", doc.one(id="updated").all_text())
    assert doc.one(id="message").all_text().strip() == "", "no error shown"

    with Image.open(shot) as image:
        rgb = image.convert("RGB")
    assert rgb.width == 1280
    colours = rgb.getcolors(maxcolors=rgb.width * rgb.height)  # [(count, (r, g, b)), ...]
    assert colours is not None and len(colours) > 200, "the page is (nearly) blank"
    loss_pixels = sum(n for n, c in colours if _near(c, LOSS_RGB))
    fault_pixels = sum(n for n, c in colours if _near(c, FAULT_RGB))
    assert loss_pixels > 800, loss_pixels
    assert fault_pixels > 40, fault_pixels


def test_with_no_runs_the_page_says_so(tmp_path: Path) -> None:
    with _serve(tmp_path, record=False) as url:
        doc = _parse(_chromium(tmp_path, "--dump-dom", url).stdout)
    assert "No runs yet" in doc.one(id="message").all_text()
    assert "hidden" in doc.one("section", id="run-detail").attrs
    assert doc.one("table", id="runs").one("tbody").find("tr") == []
    assert "no nodes known yet" in doc.one("table", id="nodes").all_text()


def test_without_the_read_only_token_the_page_asks_for_it_and_shows_nothing(tmp_path: Path) -> None:
    with _serve(tmp_path, record=True) as url:
        bare = url.split("#", 1)[0]
        for page in (bare, bare + "#token=" + "x" * 43):
            doc = _parse(_chromium(tmp_path, "--dump-dom", page).stdout)
            assert "hidden" not in doc.one("form", id="login").attrs, "the login form is shown"
            assert "read-only token" in doc.one(id="message").all_text()
            assert doc.one("table", id="runs").one("tbody").find("tr") == [], "no run is shown"
            assert "hidden" in doc.one("section", id="run-detail").attrs

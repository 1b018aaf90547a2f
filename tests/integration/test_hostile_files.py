"""Issue 37's hostile-user matrix: at every file the daemon touches in a run's tree, the
run's user plants a link to another user's file (symbolic, and hard), a FIFO, a device
node and a 1 GiB sparse file; the daemon's own call for that file (the one its tick makes) touches
nothing outside the run and returns within a second.

The daemon is root, the run's user tsup-alice (her worker does the checkpoint work,
supervisor/runfiles/user_tree.py), the other user tsup-bob, whose 0700 directory holds the files
a link points to. A device node needs root to make (mknod): alice cannot plant one
herself, but a file system she is given may hold one, so it is in the matrix too."""

from __future__ import annotations

import json
import os
import stat
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from supervisor.errors import SupervisorError
from supervisor.gathering import output_progress
from supervisor.gathering.output_progress import AttemptOutput
from supervisor.runfiles import attempt_logs, trainer_cmd, user_tree
from supervisor.users import RunAs
from tests.e2e.test_least_privilege import open_dir  # noqa: F401 - the fixture
from tests.integration.test_user_tree import (
    bobs_private,
    chown_tree,
    people,  # noqa: F401 - the fixture
    snapshot,
)
from tests.unit.test_checkpoint_scan import make_dcp, make_hf, make_megatron

STALL_S = 1.0
PLANTS = ("link", "hardlink", "fifo", "device", "sparse")


@dataclass
class Place:
    """A file the daemon touches: where it is (made by ``setup`` in alice's tree) and the
    daemon's call that touches it."""

    setup: Callable[[Path], Path]  # the run's tree -> the path to plant at
    touch: Callable[[Path, user_tree.Tree], object]  # (the run's tree, alice's) -> whatever it returns


def _tsup(run: Path) -> Path:
    d = run / "ck" / "step_00000010"
    d.mkdir(parents=True)
    (d / ".metadata").write_bytes(b"m")
    (d / "__0_0.distcp").write_bytes(b"y")
    return d / "trainer_meta.json"


def _hf(run: Path) -> Path:
    return make_hf(run / "ck", 10, state=None) / "trainer_state.json"


def _megatron(run: Path) -> Path:
    make_megatron(run / "ck", 10)
    return run / "ck" / "latest_checkpointed_iteration.txt"


def _dcp(run: Path) -> Path:
    return make_dcp(run / "ck", "llama-10steps", metadata="none") / ".metadata"


def _lightning(run: Path) -> Path:
    (run / "ck").mkdir(parents=True)
    return run / "ck" / "epoch=0-step=10.ckpt"


def _in_ck(name: str) -> Callable[[Path], Path]:
    def setup(run: Path) -> Path:
        (run / "ck").mkdir(parents=True, exist_ok=True)
        make_hf(run / "ck", 10)  # something to set aside
        return run / "ck" / name
    return setup


def _result(run: Path) -> Path:
    (run / "out").mkdir()
    return run / "out" / "result.json"


def _script(run: Path) -> Path:
    return run / "train.sh"


def _rank_log(run: Path) -> Path:
    (run / "attempts" / "1").mkdir(parents=True)
    return run / "attempts" / "1" / "rank-0000.log"


def _pick(layout: str) -> Callable[[Path, user_tree.Tree], object]:
    return lambda run, tree: tree.pick(run / "ck", layout)


def _read_log(run: Path, tree: user_tree.Tree) -> object:
    state = AttemptOutput()
    output_progress.read_output(state, run / "attempts" / "1", run_id="r", attempt=1, ranks_per_node=1,
                                formats=output_progress.formats_for(None), now=time.time(), base=run.parent,
                                reader=tree)
    return state


def _api_log(run: Path, tree: user_tree.Tree) -> object:
    return attempt_logs.read(run / "attempts" / "1", "rank-0000.log", 0, 1 << 20, base=run.parent, reader=tree)


PLACES = {
    "tsup-marker": Place(_tsup, _pick("tsup")),
    "hf-trainer-state": Place(_hf, _pick("hf")),
    "megatron-tracker": Place(_megatron, _pick("megatron")),
    "dcp-metadata": Place(_dcp, _pick("dcp")),
    "lightning-file": Place(_lightning, _pick("lightning")),
    "fence": Place(_in_ck(".tsup-attempt"),
                   lambda run, tree: tree.write_atomic(run / "ck", run / "ck" / ".tsup-attempt", '{"attempt": 2}')),
    "set-aside": Place(_in_ck(".set-aside"),
                       lambda run, tree: tree.set_aside(run / "ck", "hf", None, 0, run / "ck" / ".set-aside" / "a-2")),
    "result": Place(_result, lambda run, tree: trainer_cmd.read_result(run / "out" / "result.json", "r", 1, tree)),
    "precompile-input": Place(_script, lambda run, tree: tree.fingerprint("{}", [run / "train.sh"])),
    "rank-log": Place(_rank_log, _read_log),  # below the daemon's runs directory
    "api-log": Place(_rank_log, _api_log),  # supervisorctl logs
}


@pytest.fixture
def world(people: tuple[RunAs, RunAs], open_dir: Path) -> Iterator[tuple[RunAs, Path, Path]]:  # noqa: F811
    """(alice, her run's directory in a root-owned runs directory, bob's private directory
    with his secret file and directory)."""
    alice, bob = people
    private = bobs_private(bob)
    (private / "secret").write_text(json.dumps({"run_id": "r", "attempt": 1, "final_step": 9, "model_digest": "b"}))
    (private / "secret").chmod(0o600)  # his alone, by whatever name
    (private / "dir").mkdir()
    (private / "dir" / "kept").write_text("bob's")
    chown_tree(private, bob)
    runs = open_dir / "runs"
    runs.mkdir(mode=0o755)
    yield alice, runs / "r", private


def plant(path: Path, kind: str, private: Path, user: RunAs) -> None:
    if path.exists() or path.is_symlink():
        if path.is_dir() and not path.is_symlink():
            import shutil

            shutil.rmtree(path)
        else:
            path.unlink()
    if kind == "link":
        path.symlink_to(private / ("dir" if path.name == ".set-aside" else "secret"))
    elif kind == "hardlink":  # root makes it here; a user can where fs.protected_hardlinks is off
        os.link(private / "secret", path)
    elif kind == "fifo":
        os.mkfifo(path)
    elif kind == "device":
        os.mknod(path, 0o666 | stat.S_IFCHR, os.makedev(1, 5))  # what /dev/zero is: it never ends
    else:
        with open(path, "wb") as f:
            f.truncate(1 << 30)
    if kind != "hardlink":  # (a hard link's owner is its file's: bob's)
        os.lchown(path, user.uid, user.gid)


@pytest.mark.parametrize("kind", PLANTS)
@pytest.mark.parametrize("place", sorted(PLACES))
def test_what_the_user_plants_where_the_daemon_looks_touches_nothing_else_and_stalls_nothing(
        world: tuple[RunAs, Path, Path], place: str, kind: str) -> None:
    alice, run, private = world
    run.mkdir()
    where = PLACES[place].setup(run)
    chown_tree(run, alice)
    plant(where, kind, private, alice)
    outside = snapshot(private)
    tree = user_tree.of(alice.name)
    tree.exists(run)  # the worker started: its start is not the tick's
    began = time.monotonic()
    try:
        answer = PLACES[place].touch(run, tree)
    except (OSError, ValueError, SupervisorError) as e:  # a refusal is an answer too (the API's: Conflict)
        answer = e
    took = time.monotonic() - began
    assert took < STALL_S, f"{place} with a {kind}: {took:.2f} s"
    assert snapshot(private) == outside, "bob's files are as he left them"
    assert "bob's" not in repr(answer) and '"model_digest": "b"' not in repr(answer)
    if place == "result":
        assert answer is None, "bob's result passes for no attempt of alice's"

"""The door into a run's tree (supervisor/runfiles/user_tree.py), as the hostile user meets it.

The daemon is root here (these tests need it) and the run's user a real second uid of
this host, tsup-alice; tsup-bob is another user of the cluster whose files alice would
like root to touch for her. Each exploit of issue 37's H1 is tried as alice would try it,
through the very call the daemon's tick makes: before the door, root followed her links
into bob's directory; now her worker can reach only what she can."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from supervisor.runfiles import checkpoint_scan, precompile, trainer_cmd, user_tree
from supervisor.spec import load_spec
from supervisor.users import RunAs
from tests.conftest import require_root
from tests.e2e.test_least_privilege import open_dir, remove_user, system_user  # noqa: F401 - fixtures
from tests.unit.test_checkpoint_scan import make_ok
from tests.unit.test_precompile import nemo_checkpoint

LAYOUTS = ("tsup", "dcp", "nxd", "nemo", "hf", "lightning", "megatron")


def chown_tree(path: Path, user: RunAs) -> None:
    for root, dirs, files in os.walk(path):
        for name in [root, *(os.path.join(root, n) for n in dirs + files)]:
            os.lchown(name, user.uid, user.gid)


@pytest.fixture
def people(open_dir: Path) -> Iterator[tuple[RunAs, RunAs]]:  # noqa: F811 - the fixture imported above
    require_root("switching to a run's user")
    alice, bob = system_user("tsup-alice", open_dir), system_user("tsup-bob", open_dir)
    try:
        yield alice, bob
    finally:
        user_tree.close_all()
        remove_user(alice)
        remove_user(bob)


def home(user: RunAs) -> Path:
    path = Path(user.home)
    path.chmod(0o755)  # others may look in; bob's secrets sit in a 0700 directory of his
    return path


def bobs_private(bob: RunAs) -> Path:
    private = home(bob) / "private"
    private.mkdir(mode=0o700)
    os.chown(private, bob.uid, bob.gid)
    return private


def snapshot(root: Path) -> dict[str, tuple[int, int, int, bytes | None]]:
    """Every entry below ``root``: (mode, owner, mtime, content of a file)."""
    out = {}
    for path in sorted([root, *root.rglob("*")]):
        st = path.lstat()
        out[str(path)] = (st.st_mode, st.st_uid, st.st_mtime_ns, path.read_bytes() if path.is_file() else None)
    return out


def test_the_worker_runs_as_the_runs_user_with_its_groups_and_no_capability(
        people: tuple[RunAs, RunAs]) -> None:
    alice, _ = people
    tree = user_tree.of(alice.name)
    assert isinstance(tree, user_tree.Worker) and user_tree.of(alice.name) is tree, "one worker a user"
    assert tree.scan(home(alice)) == []
    status = dict(line.split(":", 1) for line in Path(f"/proc/{tree.pid}/status").read_text().splitlines())
    assert status["Uid"].split() == [str(alice.uid)] * 4 and status["Gid"].split() == [str(alice.gid)] * 4
    assert sorted(int(g) for g in status["Groups"].split()) == sorted(alice.groups)
    assert int(status["CapEff"], 16) == 0 and int(status["CapPrm"], 16) == 0
    assert user_tree.of(None) is user_tree.LOCAL, "the daemon's own runs need no worker"


def test_the_worker_and_the_daemon_give_the_same_verdicts_on_the_same_checkpoints(
        people: tuple[RunAs, RunAs]) -> None:
    alice, _ = people
    for layout in LAYOUTS:
        directory = home(alice) / layout
        directory.mkdir()
        make_ok(directory, layout, 10)
        make_ok(directory, layout, 20, broken=True)
        chown_tree(directory, alice)
        out_here: list[Path] = []
        out_there: list[Path] = []
        here = user_tree.LOCAL.pick(directory, layout, out_of_range=out_here)
        there = user_tree.of(alice.name).pick(directory, layout, out_of_range=out_there)
        assert here == there == checkpoint_scan.pick(directory, layout), layout
        assert here[0] is not None and here[0].step == 10 and [v.step for v in here[1]] == [20]


def test_h1_a_checkpoint_directory_linked_to_another_users_moves_none_of_that_users_checkpoints(
        people: tuple[RunAs, RunAs]) -> None:
    """H1 of issue 37: alice's checkpoint directory is a link to bob's 0700 one. The
    precompile pass moved bob's checkpoints into a root-only .set-aside/ he could not
    open, and a resume or a searching trainer's attempt moved them too."""
    alice, bob = people
    private = bobs_private(bob)
    bobs = [nemo_checkpoint(private, "7", step, "bob's") for step in (10, 20)]
    chown_tree(private, bob)
    directory = home(alice) / "checkpoints"
    directory.symlink_to(private)
    os.lchown(directory, alice.uid, alice.gid)
    before = snapshot(private)
    tree = user_tree.of(alice.name)
    for move in (lambda: tree.keep_aside(directory, "nemo", 3, lambda _: None),
                 lambda: tree.set_aside(directory, "nemo", None, 0, directory / ".set-aside" / "attempt-2"),
                 lambda: tree.bring_back(directory, "nemo", 3, [(bobs[0], directory / ".set-aside" / "x")])):
        with pytest.raises(PermissionError):
            move()
    with pytest.raises(PermissionError):
        tree.pick(directory, "nemo")  # the tick's own scan: an error (no launch), never another's checkpoint
    assert snapshot(private) == before, "bob's directory is as he left it"


def test_h1_the_fence_is_not_written_into_another_users_directory_through_a_link(
        people: tuple[RunAs, RunAs], tmp_path: Path) -> None:
    """H1 of issue 37: root wrote alice's attempt number into bob's .tsup-attempt through
    her checkpoint directory, a link to his: his rank 0 raised Superseded, his run ended."""
    alice, bob = people
    private = bobs_private(bob)
    (private / ".tsup-attempt").write_text(json.dumps({"attempt": 5}))
    chown_tree(private, bob)
    run_dir = home(alice) / "run"
    run_dir.mkdir()
    (run_dir / "checkpoints").symlink_to(private)
    chown_tree(run_dir, alice)
    before = snapshot(private)
    spec = load_spec(Path(__file__).parents[2] / "examples" / "tiny-llama.toml")
    with pytest.raises(OSError):
        trainer_cmd.write_fence(spec, run_dir, 9, user_tree.of(alice.name))
    assert snapshot(private) == before


def test_a_result_and_a_precompile_input_in_another_users_directory_are_not_read_for_her(
        people: tuple[RunAs, RunAs]) -> None:
    """Reads through a link in a middle component (no O_NOFOLLOW helps there): bob's
    result.json does not pass for alice's attempt, and the fingerprint of her pass is no
    oracle of his file's content."""
    alice, bob = people
    private = bobs_private(bob)
    (private / "result.json").write_text(json.dumps({"run_id": "run-1", "attempt": 1, "final_step": 100,
                                                      "model_digest": "bob"}))
    (private / "secret.sh").write_text("bob's\n")
    chown_tree(private, bob)
    out = home(alice) / "out"
    out.symlink_to(private)
    os.lchown(out, alice.uid, alice.gid)
    tree = user_tree.of(alice.name)
    assert trainer_cmd.read_result(private / "result.json", "run-1", 1, user_tree.LOCAL) is not None, \
        "root reads it"
    assert trainer_cmd.read_result(out / "result.json", "run-1", 1, tree) is None
    before = tree.fingerprint("{}", [out / "secret.sh"])
    (private / "secret.sh").write_text("bob's, changed\n")
    assert tree.fingerprint("{}", [out / "secret.sh"]) == before, "the same error, whatever he wrote"
    assert precompile.fingerprint_of("{}", [out / "secret.sh"]) != before


def test_a_stopped_worker_holds_a_request_no_longer_than_its_timeout_and_is_replaced(
        people: tuple[RunAs, RunAs]) -> None:
    """The worker is the user's process: she may stop it (or a hung file system may).
    The tick waits at most the timeout, the worker is killed; the user's requests fail at
    once for a pause (she cannot stall every tick by stopping each new worker), then a
    new worker answers."""
    alice, _ = people
    tree = user_tree.Worker(alice, timeout_s=0.5, pause_s=1.0)
    try:
        assert tree.scan(home(alice)) == []
        first = tree.pid
        assert first is not None
        os.kill(first, signal.SIGSTOP)
        began = time.monotonic()
        with pytest.raises(user_tree.TreeStalled):
            tree.scan(home(alice))
        assert time.monotonic() - began < 1.5
        assert tree.pid is None and not Path(f"/proc/{first}").exists(), "killed and reaped"
        began = time.monotonic()
        with pytest.raises(user_tree.TreeStalled, match="none for another"):
            tree.scan(home(alice))
        assert time.monotonic() - began < 0.1 and tree.started == 1, "no wait and no worker during the pause"
        time.sleep(1.0)
        assert tree.scan(home(alice)) == [] and tree.started == 2
    finally:
        tree.close()


class Impostor(user_tree.Worker):
    """A worker replaced by what its user made of it (she may ptrace her own process)."""

    def __init__(self, user: RunAs, program: str) -> None:
        super().__init__(user, timeout_s=5)
        self.program = program

    def _start(self):  # type: ignore[no-untyped-def]
        import subprocess

        self._proc = subprocess.Popen([sys.executable, "-c", self.program], stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, user=self.user.uid, group=self.user.gid,
                                      extra_groups=list(self.user.groups), cwd="/")
        os.set_blocking(self._proc.stdout.fileno(), False)  # type: ignore[union-attr]
        self.started += 1
        return self._proc


@pytest.mark.parametrize("program", [
    "import sys; sys.stdin.readline(); sys.stdout.write('x' * (9 << 20)); sys.stdout.flush()",
    "import sys; sys.stdin.readline(); print('not json', flush=True)",
    "import sys; sys.stdin.readline(); print('[1, 2]', flush=True)",
    "import sys; sys.stdin.readline(); print('{\"ok\": 1}' * 2, flush=True); print('{}', flush=True)",
    "import sys; sys.stdin.readline()",
], ids=["endless", "not-json", "not-an-answer", "two-answers", "dies"])
def test_an_answer_that_is_not_one_is_an_error_and_the_worker_is_killed(
        people: tuple[RunAs, RunAs], program: str) -> None:
    alice, _ = people
    tree = Impostor(alice, program)
    with pytest.raises(OSError, match="file worker of tsup-alice failed"):
        tree.exists(home(alice))
    assert tree.pid is None


def test_the_worker_refuses_to_run_as_root() -> None:
    require_root("starting the worker as root")
    import subprocess

    done = subprocess.run([sys.executable, "-I", "-m", "supervisor.runfiles.user_tree"], input=b"", capture_output=True,
                          check=False, timeout=60)
    assert done.returncode != 0 and b"never as root" in done.stderr

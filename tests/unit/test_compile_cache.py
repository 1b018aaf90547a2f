"""The Neuron compile cache that follows a run (node/compile_cache.py): each node's
own cache synced with the run's shared copy by the node wrapper, before the trainer."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from node import compile_cache
from supervisor.runfiles.trainer_cmd import NEURON_COMPILE_CACHE, attempt_env
from supervisor.slurm.requests import NODE_WRAPPER
from supervisor.spec import parse_spec
from tests.conftest import require_root

MODULE = "neuronxcc-2.15/MODULE_123+abc"


def compiled(cache: Path, module: str = MODULE) -> Path:
    """A module as Neuron leaves it in its cache: its files, then its done marker."""
    where = cache / module
    where.mkdir(parents=True)
    (where / "model.neff").write_bytes(b"neff" * 1000)
    (where / "compile_flags.json").write_text("[]")
    (where / "model.done").write_text("")
    return where


def test_a_node_adds_its_graphs_to_the_runs_copy_and_a_new_node_takes_them(tmp_path: Path) -> None:
    shared, first, joining = tmp_path / "shared", tmp_path / "node1", tmp_path / "node3"
    compiled(first)
    (first / MODULE / "model.lock").write_text("")  # a compile in progress
    (first / MODULE / ".model.neff.node9.1.tmp").write_text("half")  # someone's copy in progress
    assert compile_cache.sync(shared, first) == (3, 0)
    assert compile_cache.sync(shared, joining) == (0, 3)
    assert sorted(p.name for p in (joining / MODULE).iterdir()) == ["compile_flags.json", "model.done", "model.neff"]
    assert (joining / MODULE / "model.neff").read_bytes() == b"neff" * 1000
    assert compile_cache.sync(shared, joining) == (0, 0), "nothing twice"


def test_the_done_marker_is_published_after_the_modules_files(tmp_path: Path) -> None:
    order: list[str] = []
    real = os.replace

    def replace(src: str | Path, dst: str | Path) -> None:
        order.append(Path(dst).name)
        real(src, dst)

    compiled(tmp_path / "node1")
    compile_cache.os.replace = replace  # type: ignore[attr-defined]
    try:
        compile_cache.copy_missing(tmp_path / "node1", tmp_path / "shared", "t")
    finally:
        compile_cache.os.replace = real  # type: ignore[attr-defined]
    assert order[-1] == "model.done" and set(order) == {"model.neff", "compile_flags.json", "model.done"}


def test_links_are_neither_followed_nor_copied(tmp_path: Path) -> None:
    secret = tmp_path / "secret"
    secret.write_text("not a graph")
    local = tmp_path / "node1"
    compiled(local)
    (local / MODULE / "model.hlo").symlink_to(secret)
    (local / "elsewhere").symlink_to(tmp_path, target_is_directory=True)
    compile_cache.sync(tmp_path / "shared", local)
    assert not (tmp_path / "shared" / MODULE / "model.hlo").exists()
    assert not (tmp_path / "shared" / "elsewhere").exists()


def test_the_node_wrapper_fills_the_nodes_cache_before_the_trainer_starts(tmp_path: Path) -> None:
    shared, local = tmp_path / "shared", tmp_path / "var-tmp" / "cache"
    compiled(shared)
    probe = f"import os, sys; sys.exit(0 if os.path.exists({str(local / MODULE / 'model.done')!r}) else 3)"
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "SLURM_NODEID": "0", "SLURMD_NODENAME": "node3",
           "TSUP_COMPILE_CACHE_SHARED": str(shared), "TSUP_PYTHON": sys.executable,
           "NEURON_COMPILE_CACHE_URL": str(local), "PYTHONPATH": str(Path(__file__).parents[2])}
    done = subprocess.run(["/bin/sh", "-c", NODE_WRAPPER, "tsup-node", sys.executable, "-c", probe], env=env,
                          capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"compile cache: 3 file(s) taken from {shared}, 0 added to it" in done.stdout


@pytest.mark.parametrize("planted", ["another users", "a link", "open to all"])
def test_a_node_cache_another_user_made_first_is_not_used_and_no_trainer_starts(tmp_path: Path,
                                                                               planted: str) -> None:
    """A medium of issue 37: the node's cache is /var/tmp/neuron-compile-cache-<uid>, a name
    anyone can make first in a directory anyone may create in; the run then loaded that
    user's graphs (and pushed them into its shared copy)."""
    require_root("making a directory another user's")
    shared, local = tmp_path / "shared", tmp_path / "var-tmp" / "cache"
    compiled(shared)
    local.parent.mkdir()
    if planted == "a link":
        (tmp_path / "theirs").mkdir()
        local.symlink_to(tmp_path / "theirs")
    else:
        local.mkdir()
        if planted == "another users":
            os.chown(local, 4242, 4242)
        else:
            local.chmod(0o777)
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "SLURM_NODEID": "0", "SLURMD_NODENAME": "node3",
           "TSUP_COMPILE_CACHE_SHARED": str(shared), "TSUP_PYTHON": sys.executable,
           "NEURON_COMPILE_CACHE_URL": str(local), "PYTHONPATH": str(Path(__file__).parents[2])}
    done = subprocess.run(["/bin/sh", "-c", NODE_WRAPPER, "tsup-node", "/bin/echo", "the trainer started"],
                          env=env, capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == compile_cache.UNSAFE and "the trainer started" not in done.stdout, done.stdout
    assert "compile cache: not used:" in done.stdout
    if planted == "a link":
        assert list((tmp_path / "theirs").iterdir()) == [], "nothing pulled through the link"


def test_only_a_neuron_job_on_the_node_local_cache_gets_the_shared_copy(tmp_path: Path) -> None:
    def spec(accelerator: str, env: dict[str, str] | None = None) -> dict[str, object]:
        return {"name": "j", "resources": {"nodes": 1, "ranks_per_node": 2, "accelerator": accelerator},
                "command": {"launch": "node", "argv": ["./train.sh"], "checkpoint_dir": "{run_dir}/ck",
                            "env": env or {}}}

    env = attempt_env(parse_spec(spec("neuron")), tmp_path)
    assert env["NEURON_COMPILE_CACHE_URL"] == NEURON_COMPILE_CACHE.format(uid=os.geteuid())
    assert env["TSUP_COMPILE_CACHE_SHARED"] == str(tmp_path / "neuron-compile-cache")
    assert env["TSUP_PYTHON"] == sys.executable
    assert "TSUP_COMPILE_CACHE_SHARED" not in attempt_env(parse_spec(spec("nvidia")), tmp_path)
    own = attempt_env(parse_spec(spec("neuron", {"NEURON_COMPILE_CACHE_URL": "/fsx/cache"})), tmp_path)
    assert "TSUP_COMPILE_CACHE_SHARED" not in own, "a cache the spec names is the same on every node already"

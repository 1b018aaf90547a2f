"""The Slurm-box part of bench/mttr.py (``--parts slurm``): the same phases, measured on
a real Slurm cluster of three slurmd in network namespaces of this host, each a host of
its own with its own /dev/shm (slurmbox/, the chaos suite's box). Every trial gets a
fresh box (up and down take a quarter of a second each), so a killed node or a drain
of one trial is not the next one's; a mosquitto on the box's bridge address carries the
telemetry, which the benchmark hears as the supervisor does.

- ``cold_start``: the floor. The trainer launched by the Slurm launcher class itself,
  without the supervisor: an allocation (sbatch) of the spec's nodes, then the ranks as
  one srun step in it (and the node agents' step beside it, as the supervisor would
  have); ``fresh`` from the srun to the first step, then ``resumed`` from the srun to the
  first step after loading the checkpoint the fresh launch committed. The allocation is
  granted before the clock starts: a recovery on Slurm runs in the allocation it holds.
- ``supervisor``: ``training-supervisor run`` on the box (``launcher = "slurm"``) with
  ``--chaos kill-rank`` or ``kill-node`` at ``--fault-step``, persistent checkpoints.
  kill-node kills the node's slurmd and everything it started, as a power loss would.
- ``memory_tier``: the same with the memory tier every 5 steps (replicas on the next
  node) and persistent saves beside training, the fault at ``--memory-fault-step``.
- ``warm_standby``: the supervisor with ``[resources] standby = true``: each node's
  standbys, a step started 5 s after the attempt (supervisor/slurm/standby.py), become
  the next attempt's ranks; the fault at ``--warm-fault-step``, once they are warm.
- ``warm_standby_memory_tier``: both, the fault at ``--memory-fault-step``.

``--slurm-variants`` picks among cold, supervisor, memory, warm and warm-memory (the
cold start always runs: it is what the others are set against). Each kind's median
total_s is set against the cold resume's as ``<variant>_vs_cold_resume``.
Needs root (network namespaces) and Slurm's daemons (``make test`` installs them);
without them the part says why it did not run.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import mqtt_broker
from _harness import (
    REPO,
    Tap,
    plain_spec,
    say,
    spec_shape,
    steps_past,
    wait_until,
    write_spec,
    write_trainer_config,
)
from _mttr_trials import brief_of, summary_of, supervisor_trial, timed_launch

from supervisor.launchers.base import AllocationRequest
from supervisor.slurm.cluster import slurm_cluster

KINDS = ("kill-rank", "kill-node")
NODES = 3  # the example's 2 nodes and its spare
_DAEMONS = ("munged", "slurmctld", "slurmd")


def unavailable() -> str | None:
    """Why the box cannot run here (None: it can)."""
    if os.geteuid() != 0:
        return "needs root (the box's nodes are network namespaces)"
    missing = [b for b in _DAEMONS if not os.path.exists(f"/usr/sbin/{b}")]
    missing += [b for b in ("srun", "sbatch", "sinfo") if shutil.which(b) is None]
    if missing:
        return f"Slurm is not installed ({', '.join(missing)} missing; make test installs it)"
    return None


@contextlib.contextmanager
def _box_and_broker() -> Iterator[tuple[Any, str]]:
    """A fresh box of NODES nodes and a mosquitto on its bridge address; (box, mqtt URL)."""
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))  # slurmbox/: the source checkout's development box
    from slurmbox import box as slurm_box

    # Short: the box's unix sockets live below it (108 bytes at most).
    directory = Path(tempfile.mkdtemp(prefix="tsup-mttr-box-"))
    try:
        box = slurm_box.up(directory, NODES)
        with mqtt_broker.mosquitto(directory, host=box.controller_addr) as broker:
            yield box, broker.url
    finally:
        slurm_box.down(directory)
        shutil.rmtree(directory, ignore_errors=True)


# variant -> (its name in the report, standby, memory tier every N steps, which fault step)
VARIANTS = {"supervisor": ("supervisor", False, 0, "fault_step"),
            "memory": ("memory_tier", False, 5, "memory_fault_step"),
            "warm": ("warm_standby", True, 0, "warm_fault_step"),
            "warm-memory": ("warm_standby_memory_tier", True, 5, "memory_fault_step")}


def measure(base_spec: Path, root: Path, *, kinds: tuple[str, ...], trials: int, variants: tuple[str, ...],
            fault_steps: dict[str, int], timeout_s: float) -> dict[str, Any]:
    why = unavailable()
    if why is not None:
        return {"run": False, "why": why}
    kinds = tuple(k for k in kinds if k in KINDS)
    if not kinds:
        return {"run": False, "why": f"the box measures {', '.join(KINDS)}, and none of them was asked for"}
    unknown = set(variants) - {"cold", *VARIANTS}
    if unknown:
        raise SystemExit(f"unknown Slurm variants {sorted(unknown)}; choose from cold, {', '.join(VARIANTS)}")
    cold: dict[str, list[dict[str, Any]]] = {"fresh": [], "resumed": []}
    rows_of = {v: {k: [] for k in kinds} for v in VARIANTS if v in variants}
    for i in range(1, trials + 1):
        say(f"round {i}/{trials}: Slurm box, cold start")
        fresh, resumed = _cold_trial(base_spec, root / f"slurm-cold-{i}", timeout_s)
        cold["fresh"].append(fresh)
        cold["resumed"].append(resumed)
        say(f"  -> fresh {fresh.get('total_s')} s, resumed {resumed.get('total_s')} s")
        for k in kinds:
            for variant, rows in rows_of.items():
                name, standby, memory_every, step_key = VARIANTS[variant]
                say(f"round {i}/{trials}: Slurm box, {name}, {k}")
                rows[k].append(_supervisor_trial(k, base_spec, root / f"slurm-{variant}-{k}-{i}",
                                                 fault_steps[step_key], standby, memory_every, timeout_s))
                say(f"  -> {brief_of(rows[k][-1])}")
    out: dict[str, Any] = {"run": True, "nodes": NODES, "kinds": list(kinds), "fault_steps": fault_steps,
                           "cold_start": {name: summary_of(rows, "completed") for name, rows in cold.items()}}
    floor = out["cold_start"]["resumed"]["median"].get("total_s")
    for variant, by_kind in rows_of.items():
        name = VARIANTS[variant][0]
        out[name] = {k: summary_of(rows) for k, rows in by_kind.items()}
        out[f"{name}_vs_cold_resume"] = {
            k: round(t / floor, 3) if floor and (t := v["median"].get("total_s")) else None
            for k, v in out[name].items()}
    return out


def _supervisor_trial(kind: str, base_spec: Path, workdir: Path, fault_step: int, standby: bool,
                      memory_every: int, timeout_s: float) -> dict[str, Any]:
    workdir.mkdir(parents=True, exist_ok=True)
    with _box_and_broker() as (box, url):
        spec = write_spec(base_spec, workdir / "spec.toml", mqtt_url=url, launcher="slurm", standby=standby,
                          steps=steps_past(base_spec, fault_step) if standby else None,
                          memory_every_steps=memory_every)
        tap = Tap(url)
        try:
            return supervisor_trial(kind, spec, workdir, tap, fault_step, timeout_s,
                                    env={"SLURM_CONF": str(box.conf)})
        finally:
            tap.close()


# --- the cold start on the box ------------------------------------------------------------


def _cold_trial(base_spec: Path, workdir: Path, timeout_s: float) -> tuple[dict[str, Any], dict[str, Any]]:
    """In one allocation: a fresh launch until its first checkpoint is committed, then a
    second launch that resumes from it."""
    workdir.mkdir(parents=True, exist_ok=True)
    with _box_and_broker() as (box, url):
        spec = write_spec(base_spec, workdir / "spec.toml", mqtt_url=url, launcher="slurm")
        shape = spec_shape(spec)
        config = write_trainer_config(spec, workdir / "run")
        cluster = slurm_cluster(slurm_conf=str(box.conf), state_dir=workdir / "state")
        launcher, run_id = cluster.launcher, "cold"
        req = AllocationRequest(run_id=run_id, count=shape["nodes"], minimum=shape["nodes"], held=(),
                                drained=frozenset(), idle=(), known=frozenset(), info=None)
        grant = launcher.allocate(req)
        again = replace(req, info=grant.info)
        granted = wait_until(lambda: g if (g := launcher.allocate(again)).nodes else None, 60, every_s=0.2)
        if not granted:
            raise SystemExit(f"the box granted no allocation in 60 s: {grant.note}")
        tap = Tap(url)
        try:
            def launch(attempt: int, until_step: int) -> dict[str, Any]:
                plain = plain_spec(config, run_id, attempt, shape["nodes"], shape["ranks_per_node"], url)
                spec_ = replace(plain, nodes=granted.nodes[:shape["nodes"]], allocation_info=granted.info)
                return timed_launch(launcher, spec_, tap, until_step, timeout_s)

            fresh = launch(1, shape["every_steps"] + 1)
            resumed = launch(2, 1)
        finally:
            tap.close()
            launcher.release(run_id, granted.info)
        return fresh, resumed

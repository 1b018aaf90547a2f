"""The link test's steps: over which nodes it runs, with which tool, and how one pair's
all-reduce is laid out (pure; supervisor/slurm/nodes.py runs the pairs, health/links.py
reads their outputs and judges the nodes).

The tool follows the accelerator the spec names (``[health] link_tool``, or derived:
``neuron_devices`` set, nccom-test; ``gpus`` set, nccl-tests; else ``health.allreduce``),
and each runs in the form its users run it under Slurm:

- ``allreduce``: ``python -m health.allreduce``, one task a node (gloo on CPU nodes, NCCL
  on GPU ones), rank 0 on the pair's first node hosting the rendezvous (MASTER_ADDR);
  1 MiB messages, as many as fit in a second (up to 50): a healthy link's figure is the
  mean of many, and a 4 Mbit/s link finishes in seconds;
- ``nccl-tests``: ``all_reduce_perf -g 1``, one task a GPU on both nodes, wired by
  ``srun --mpi=pmix`` (awsome-distributed-training's form): 256 MiB, 20 timed iterations
  after 5, results checked (``-c 1``);
- ``nccom-test``: its multi-node form, started once on the pair's first node, which
  reaches the second itself (``-N 2 --hosts 127.0.0.1 <second>``, the rendezvous in
  ``NEURON_RT_ROOT_COMM_ID``: nccom-test.rst's example): 64 MiB fp32, 20 iterations after 5.

The nccl-tests and nccom-test forms use the run's ranks a node (a GPU or a NeuronCore each).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass

from health.links import ALLREDUCE, NCCL_TESTS, NCCOM_TEST

LINK_PORT = 29411  # the rendezvous port on the pair's first node
LINK_SIZES, LINK_ITERS, LINK_WARMUP, LINK_BUDGET_S = "1M", 50, 2, 1.0  # health.allreduce's
NCCL_TESTS_ARGS = ("-b", "256M", "-e", "256M", "-g", "1", "-c", "1", "-n", "20", "-w", "5")
NCCOM_TEST_ARGS = ("-b", "64MB", "-e", "64MB", "-n", "20", "-w", "5", "-d", "fp32")
# health.allreduce's rank from Slurm's task id.
_LINK_RANKS = ('RANK=$SLURM_PROCID WORLD_SIZE=$SLURM_NTASKS LOCAL_RANK=0; '
               'export RANK WORLD_SIZE LOCAL_RANK; exec "$@"')


@dataclass(frozen=True, slots=True)
class LinkTest:
    """The link test of a probe round: over ``over`` (the round's nodes and the run's
    others, which make the baseline), a node suspect under ``fraction`` of the median;
    each pair run with ``tool`` (health/links.py: TOOLS), ``tasks_per_node`` tasks a
    node where the tool takes one a device."""

    over: tuple[str, ...]
    fraction: float
    tool: str = ALLREDUCE
    tasks_per_node: int = 1


def link_test(wanted: bool, fraction: float, round_nodes: Sequence[str], held: Sequence[str], *,
              tool: str = ALLREDUCE, tasks_per_node: int = 1) -> LinkTest | None:
    """The round's link test, when the spec asks for it (``[health] links``, its
    ``link_fraction``) and the run holds two nodes or more."""
    over = tuple(dict.fromkeys([*held, *round_nodes]))
    if not wanted or len(over) < 2:
        return None
    return LinkTest(over=over, fraction=fraction, tool=tool, tasks_per_node=tasks_per_node)


@dataclass(frozen=True, slots=True)
class PairStep:
    """One pair's all-reduce as a job step: on ``nodes`` (both, or the first alone for a
    tool that reaches its peer itself), ``tasks_per_node`` tasks each, srun's ``--mpi``
    when the tool needs it, ``env`` added to the task's environment, and ``argv``."""

    nodes: tuple[str, ...]
    tasks_per_node: int
    mpi: str | None
    env: tuple[tuple[str, str], ...]
    argv: tuple[str, ...]


def pair_step(test: LinkTest, pair: tuple[str, str], addrs: tuple[str, str], timeout_s: float, *,
              interpreter: str = sys.executable) -> PairStep:
    """How ``pair`` runs ``test``'s tool: ``pair[0]`` hosts the rendezvous (Slurm puts a
    step's task 0 on the first node it lists); ``addrs`` are the pair's addresses."""
    if test.tool == NCCL_TESTS:
        return PairStep(nodes=pair, tasks_per_node=test.tasks_per_node, mpi="pmix", env=(),
                        argv=("all_reduce_perf", *NCCL_TESTS_ARGS))
    if test.tool == NCCOM_TEST:
        return PairStep(nodes=pair[:1], tasks_per_node=1, mpi=None,
                        env=(("NEURON_RT_ROOT_COMM_ID", f"{addrs[0]}:{LINK_PORT}"),),
                        argv=("nccom-test", "-r", str(2 * test.tasks_per_node), "-N", "2", *NCCOM_TEST_ARGS,
                              "allr", "--hosts", "127.0.0.1", addrs[1]))
    return PairStep(nodes=pair, tasks_per_node=1, mpi=None,
                    env=(("MASTER_ADDR", addrs[0]), ("MASTER_PORT", str(LINK_PORT))),
                    argv=link_argv(timeout_s, interpreter=interpreter))


def link_argv(timeout_s: float, *, interpreter: str = sys.executable) -> tuple[str, ...]:
    """``python -m health.allreduce`` as one task of a step across nodes (MASTER_ADDR and
    MASTER_PORT come from srun's environment): rank 0 prints its JSON report."""
    return ("/bin/sh", "-c", _LINK_RANKS, "tsup-link", interpreter, "-m", "health.allreduce", "--json",
            "--sizes", LINK_SIZES, "--iters", str(LINK_ITERS), "--warmup", str(LINK_WARMUP),
            "--budget-s", f"{LINK_BUDGET_S:g}", "--timeout-s", f"{timeout_s:g}")

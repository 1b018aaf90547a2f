"""The links between nodes: which pairs to measure, and which node a slow pair names.

A per-node probe sends no byte between two nodes, yet a slow or dead link is where large
runs lose time: it crashes nothing, it makes every rank wait at every collective. So
the link test runs an all-reduce across nodes (``python -m health.allreduce``: gloo on
CPU nodes, NCCL on GPU ones; nccl-tests' ``all_reduce_perf`` across GPU nodes;
``nccom-test`` across Trainium nodes: ``TOOLS``) and compares the nodes with each other,
never with an absolute figure: bus bandwidth differs per instance type and per cluster,
and a node is slow only against its peers.

**Pairs first** (``ring_rounds``): each node with its neighbours in a ring of the nodes,
so that every node is in two pairs (one, with two nodes). The pairs of a round share no
node and run at once; an even ring takes two rounds, an odd one three.

**The rule** (``judge``), from the pairs' bus bandwidths:

- a node's figure is its *best* pair: a healthy node paired with a slow one is slow in
  that pair only, while a slow node is slow in all of its pairs;
- a node is suspect when its best pair runs under ``fraction`` of the median of the
  nodes' figures (the cluster's own baseline). This needs at least three nodes with a
  figure: with two there is one pair and nothing to tell their ends apart;
- a node none of whose pairs completed, while each of its peers completed a pair with
  another node, is suspect too: it reaches no one (its link is down, or so slow that no
  pair finished in time);
- anything else that did not run (a tool missing, a peer unreachable that is not the
  only cause) is said, never blamed on a node: the finding of a node that cannot be
  judged is ``None``, and the node keeps the verdict of its own probe.

Pure: plain values in, findings out. supervisor/slurm/nodes.py runs the pairs.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from health.allreduce_report import read_report
from health.model import Finding, Status
from health.neuron.nccom import nccom_busbw
from health.nvidia.nccl_tests import nccl_busbw

PROBE = "links"
FRACTION = 0.5  # a node under half the cluster's median is suspect
# The tools a pair's all-reduce can run (supervisor/node_health.py: pair_step says how):
# torch's (gloo on CPU nodes, NCCL on GPU ones), nccl-tests' all_reduce_perf across two
# GPU nodes, nccom-test's multi-node form across two Trainium nodes.
ALLREDUCE, NCCL_TESTS, NCCOM_TEST = "allreduce", "nccl-tests", "nccom-test"
TOOLS = (ALLREDUCE, NCCL_TESTS, NCCOM_TEST)


@dataclass(frozen=True, slots=True)
class PairResult:
    """One pair's all-reduce: its bus bandwidth at the largest size, or why it has none."""

    nodes: tuple[str, str]
    busbw_gbps: float | None
    why: str = ""  # when busbw_gbps is None: the tool's words, a timeout, ...


def pair_result(nodes: tuple[str, str], output: str | None, failed: str = "", *,
                tool: str = ALLREDUCE) -> PairResult:
    """A pair's result from the output of ``tool`` (one of ``TOOLS``; its rank 0's);
    ``failed``: why the run itself failed (a timeout, srun's error), when it did."""
    figure = _figure(tool, output or "")
    if isinstance(figure, str):
        return PairResult(nodes, None, "; ".join(w for w in (failed, figure) if w))
    return PairResult(nodes, figure)


def _figure(tool: str, output: str) -> float | str:
    """The pair's bus bandwidth in GB/s from ``tool``'s output, or why there is none."""
    if tool == NCCL_TESTS:
        return nccl_busbw(output)
    if tool == NCCOM_TEST:
        return nccom_busbw(output)
    report = read_report(output)
    if isinstance(report, str):
        return report
    if report.wrong:
        return f"{report.wrong} wrong elements after the all-reduce: corrupt data"
    return report.busbw_gbps


def ring_rounds(nodes: Sequence[str]) -> list[list[tuple[str, str]]]:
    """The ring's pairs (each node with the next, the last with the first), in rounds
    whose pairs share no node."""
    ring = list(dict.fromkeys(nodes))
    n = len(ring)
    if n < 2:
        return []
    if n == 2:
        return [[(ring[0], ring[1])]]
    edges = [(ring[i], ring[(i + 1) % n]) for i in range(n)]
    rounds = [edges[0:n - n % 2:2], edges[1:n - n % 2:2]]  # alternate edges: disjoint when n is even
    if n % 2:
        rounds.append([edges[-1]])  # an odd ring's last edge meets the first's node
    return [r for r in rounds if r]


def figures(results: Iterable[PairResult]) -> dict[str, tuple[float, tuple[str, str]]]:
    """Each node's best pair: (busbw, the pair), for the nodes in a pair that completed."""
    best: dict[str, tuple[float, tuple[str, str]]] = {}
    for r in results:
        if r.busbw_gbps is None:
            continue
        for node in r.nodes:
            if node not in best or r.busbw_gbps > best[node][0]:
                best[node] = (r.busbw_gbps, r.nodes)
    return best


def judge(judged: Sequence[str], results: Sequence[PairResult], *,
          fraction: float = FRACTION) -> dict[str, Finding | None]:
    """The link finding of each node of ``judged`` (None: the test cannot say; see the
    module's rule). ``results`` may include pairs of peers that are not judged: they make
    the baseline."""
    best = figures(results)
    median = statistics.median(v for v, _ in best.values()) if len(best) >= 3 else None
    out: dict[str, Finding | None] = {}
    for node in judged:
        mine = [r for r in results if node in r.nodes]
        if node in best:
            out[node] = _by_figure(node, best, median, fraction)
        elif mine and all(_peer_reached_others(r, node, results) for r in mine):
            out[node] = Finding(probe=PROBE, status=Status.UNHEALTHY, evidence=(
                f"no all-reduce with {_names(_peer(r, node) for r in mine)} completed "
                f"({_why(mine)}), while each of them completed one with another node: it reaches no peer"))
        else:
            out[node] = None
    return out


def unjudged(judged: Sequence[str], results: Sequence[PairResult],
             findings: Mapping[str, Finding | None]) -> str:
    """One line on what the test could not say (for the round's log), or "" when it said
    something of every node."""
    left = [n for n in judged if findings.get(n) is None]
    if not left:
        return ""
    failed = [r for r in results if r.busbw_gbps is None]
    detail = f"; pairs that did not complete: {_why(failed)}" if failed else ""
    why = "fewer than 3 nodes with a figure" if len(figures(results)) < 3 else "no pair of theirs completed"
    return f"link test: cannot judge {_names(left)} ({why}){detail}"


def _by_figure(node: str, best: Mapping[str, tuple[float, tuple[str, str]]], median: float | None,
               fraction: float) -> Finding | None:
    busbw, pair = best[node]
    said = f"best pair {pair[0]}-{pair[1]} {busbw:.4g} GB/s"
    if median is None:
        return None  # one pair: its two ends cannot be told apart
    of = f"the median of {len(best)} nodes' best pairs, {median:.4g} GB/s"
    if median > 0 and busbw < fraction * median:
        return Finding(probe=PROBE, status=Status.UNHEALTHY, evidence=(
            f"{said}: {100 * busbw / median:.2g} % of {of} (under {fraction:.0%}): its link is slow"))
    return Finding(probe=PROBE, status=Status.HEALTHY, evidence=f"{said}; {of}")


def _peer(r: PairResult, node: str) -> str:
    return r.nodes[1] if r.nodes[0] == node else r.nodes[0]


def _peer_reached_others(r: PairResult, node: str, results: Sequence[PairResult]) -> bool:
    peer = _peer(r, node)
    return any(o.busbw_gbps is not None and peer in o.nodes and node not in o.nodes for o in results)


def _names(nodes: Iterable[str]) -> str:
    return ", ".join(sorted(set(nodes)))


def _why(results: Iterable[PairResult]) -> str:
    return "; ".join(f"{r.nodes[0]}-{r.nodes[1]}: {r.why or 'no figure'}" for r in results)

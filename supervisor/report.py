"""Human-readable text for runs, events and nodes: shared by both CLIs."""

from __future__ import annotations

import time
from collections.abc import Sequence

from supervisor.goodput import Goodput
from supervisor.views import (
    CHECKPOINTS_SHOWN,
    CheckpointView,
    EventView,
    NodeView,
    RunDetail,
    RunSummary,
)


def _t(ts: float | None) -> str:
    return time.strftime("%H:%M:%S", time.localtime(ts)) if ts else "-"


def _s(seconds: float) -> str:
    return f"{seconds:.1f} s"


def run_detail(d: RunDetail) -> str:
    step = d.final_step if d.final_step is not None else d.step
    lines = [
        f"{d.run_id} {d.name}: {d.state} at step {step if step is not None else '-'}/{d.total_steps}"
        f"  ({d.reason})",
        f"  layout:   {d.nodes} node(s) x {d.ranks_per_node} rank(s) + {d.spares} spare(s)",
        f"  attempts: {d.attempts}",
    ]
    for a in d.attempt_history:
        origin = "precompile" if a.precompile else f"step {a.resume_step}" if a.resume_step else "scratch"
        lines.append(
            f"    #{a.number} {a.outcome or a.state:<9} from {origin:<10} on {', '.join(a.nodes)}"
            f"  -> step {a.final_step if a.final_step is not None else '-'}"
            + (f"  ({a.reason})" if a.reason and a.outcome != "SUCCEEDED" else "")
        )
    recovered = sum(1 for f in d.faults if f.recovered_at)
    if d.faults_total == len(d.faults):
        lines.append(f"  faults:   {d.faults_total} ({recovered} recovered)")
    else:
        lines.append(f"  faults:   {d.faults_total}; the newest {len(d.faults)}, {recovered} of them "
                     "recovered:")
    cold = _cold_start_s(d)
    for f in d.faults:
        rec = (f"training again {f.recovered_at - f.detected_at:.1f} s after detection"
               if f.recovered_at else "not recovered")
        if f.recovered_at and cold is not None:
            rec += f" (a cold start took {cold:.1f} s: attempt 1, launch to first step)"
        lines.append(f"    {_t(f.detected_at)} {f.kind} in attempt {f.attempt} near step {f.step}: "
                     f"{f.summary}; {rec}")
    if d.drained_nodes:
        more = f" (the newest {len(d.drained_nodes)} of {d.drained_total})" if d.drained_total > len(
            d.drained_nodes) else ""
        lines.append(f"  drained:  {', '.join(d.drained_nodes)}{more}")
    for s in d.stragglers:
        lines.append(f"  straggler: rank {s.rank} on {s.node} in attempt {s.attempt}: {s.busy_s:.3f} s of "
                     f"compute per step against {s.typical_s:.3f} s typical")
    if d.transient_spikes:
        lines.append(f"  transient spikes: {d.transient_spikes} (reported, not acted on)")
    complete = [c for c in d.checkpoints if c.complete]
    if complete:
        shown = "" if len(d.checkpoints) < CHECKPOINTS_SHOWN else f" of the newest {CHECKPOINTS_SHOWN}"
        lines.append(f"  checkpoints: {len(complete)}{shown} complete, newest at step {complete[-1].step}")
    if d.goodput.ettr is not None:
        lines.append(f"  goodput:  {goodput_line(d.goodput)}")
    if d.tensorboard:
        lines.append(f"  curves:   tensorboard --logdir {d.tensorboard}")
    if d.curves_url:
        lines.append(f"  curves:   {d.curves_url}")
    if d.model_digest:
        lines.append(f"  model digest: {d.model_digest}")
    return "\n".join(lines)


def _cold_start_s(d: RunDetail) -> float | None:
    """How long the run's first training attempt took from its launch to its first step
    (fresh processes, nothing warm): what a recovery is measured against."""
    if not d.attempt_history or d.attempt_history[0].number != 1:
        return None  # the history shown starts later than the run
    first = next((a for a in d.attempt_history if not a.precompile), None)
    if first is None or first.started_at is None or first.first_step_at is None:
        return None
    return first.first_step_at - first.started_at


def goodput_line(g: Goodput) -> str:
    if g.ettr is None:
        return "no attempt has started yet"
    return (f"ETTR {g.ettr:.2f} = kept {_s(g.productive_s)} of {_s(g.wall_s)} wall; "
            f"lost work {_s(g.lost_s)} ({g.lost_steps} steps), startup/restore {_s(g.startup_s)}, "
            f"checkpoints {_s(g.checkpoint_s)}, detection {_s(g.detection_s)}, "
            f"recovery {_s(g.recovery_s)}, other {_s(g.other_s)}")


def checkpoints_table(checkpoints: Sequence[CheckpointView]) -> str:
    rows = [("STEP", "COMPLETE", "SAVE", "ATTEMPT", "PATH")]
    for c in checkpoints:
        rows.append((str(c.step), "yes" if c.complete else "no",
                     _s(c.duration_s) if c.duration_s is not None else "-",
                     str(c.attempt) if c.attempt is not None else "-", c.path))
    return table(rows)


def runs_table(runs: Sequence[RunSummary]) -> str:
    rows = [("RUN", "NAME", "STATE", "STEP", "LOSS", "ATTEMPTS", "REASON")]
    for r in runs:
        rows.append((r.run_id, r.name, r.state, f"{r.step if r.step is not None else '-'}/{r.total_steps}",
                     f"{r.loss:.4f}" if r.loss is not None else "-", str(r.attempts), r.reason))
    return table(rows)


def nodes_table(nodes: Sequence[NodeView]) -> str:
    def probe(n: NodeView) -> str:
        return f"{n.last_probe.status} ({n.last_probe.kind})" if n.last_probe else "-"

    def link(n: NodeView) -> str:
        """Its newest link-test figure against its own median (the drift over weeks)."""
        if n.link is None:
            return "-"
        return f"{n.link.newest_gbps:.3g} GB/s (median of {n.link.samples}: {n.link.median_gbps:.3g})"

    return table([("NODE", "STATE", "RUN", "LAST PROBE", "LINK", "REASON")]
                 + [(n.name, n.state, n.run_id or "-", probe(n), link(n), n.reason) for n in nodes])


def event_line(e: EventView, t0: float | None = None) -> str:
    when = f"+{e.ts - t0:6.1f}s" if t0 is not None else _t(e.ts)
    return f"[{when}] {e.run_id or '-'} {e.kind}: {e.message}"


def table(rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join(
        "  ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=True)).rstrip() for r in rows
    )

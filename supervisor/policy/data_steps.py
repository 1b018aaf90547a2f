"""Data steps: where a [command] trainer told ``{skip_to_step}`` reads its data.

A trainer that names {skip_to_step} reads the data of step d(t) at its step t: the data
stream with the run's skip windows (in data steps, [start, end)) taken out. A window is
recorded where a spike began, [d(P), d(P) + spike_skip_steps); the rolled-back attempt
resumes from a checkpoint before P and, since it reads its data in order from where it
is told, the window is widened back to where it starts reading (the batches between are
stepped over too, as PaLM's restarts did). d then holds for every later resume.
"""

from __future__ import annotations

from collections.abc import Iterable


def data_step(step: int, windows: Iterable[tuple[int, int]]) -> int:
    """The step of the data stream that trainer step ``step`` reads: the ``step``-th one
    outside every window."""
    d = step
    for start, end in _merged(windows):
        if start <= d:
            d += end - start
        else:
            break
    return d


def skip_to(resume_step: int, windows: Iterable[tuple[int, int]]) -> tuple[int, tuple[int, int] | None]:
    """Where an attempt resumed from ``resume_step`` starts reading its data, and the
    window to widen for it (start, the new start; None: none lies ahead). A window ahead
    of where it would start is one whose spike came after the checkpoint: the attempt
    jumps over it at once."""
    merged = _merged(windows)
    at = data_step(resume_step + 1, merged)
    ahead = [w for w in merged if w[0] > at]
    if not ahead:
        return at, None
    widened = (at, ahead[0][1])
    return data_step(resume_step + 1, [*merged, widened]), (ahead[0][0], at)


def _merged(windows: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for start, end in sorted(w for w in windows if w[1] > w[0]):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out

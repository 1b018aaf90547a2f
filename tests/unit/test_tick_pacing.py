"""The reconciler's pace (supervisor/reconciler.py pause_after): a tick every tick_s while
ticks are short; a long tick (tens of thousands of ranks) lengthens the period so the
ticks keep to TICK_DUTY of the time, and telemetry gets the rest; never by more than
PAUSE_MAX_S."""

from __future__ import annotations

import pytest

from supervisor.reconciler import PAUSE_MAX_S, TICK_DUTY, pause_after


@pytest.mark.parametrize(("took_s", "pause_s"), [
    (0.0, 0.25),
    (0.01, 0.24),
    (0.0625, 0.1875),  # a quarter of tick_s: the two rules agree
    (0.25, 0.75),  # a tick as long as tick_s: three times as long for ingestion
    (1.0, PAUSE_MAX_S),  # one very slow tick holds the next back at most PAUSE_MAX_S
    (60.0, PAUSE_MAX_S),
])
def test_short_ticks_keep_the_period_and_long_ones_keep_to_their_share(took_s: float, pause_s: float) -> None:
    assert pause_after(0.25, took_s) == pytest.approx(pause_s)
    if 0 < took_s <= PAUSE_MAX_S * TICK_DUTY / (1 - TICK_DUTY):
        assert took_s / (took_s + pause_after(0.25, took_s)) <= TICK_DUTY + 1e-9

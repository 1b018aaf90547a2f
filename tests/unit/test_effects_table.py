"""The one table of effects (supervisor/effects/__init__.py): every kind of Effect has
exactly one family of handlers."""

from __future__ import annotations

from typing import get_args

from supervisor.domain import Effect, Emit
from supervisor.effects import FAMILIES, TABLE, table_problems
from supervisor.effects.runs import RunEffects


def test_every_effect_has_one_family() -> None:
    assert table_problems(FAMILIES) == []
    assert set(TABLE) == set(get_args(Effect))


def test_an_effect_left_out_or_handled_twice_is_named() -> None:
    without_runs = [f for f in FAMILIES if f is not RunEffects]
    assert "Emit is handled by no family" in table_problems(without_runs)

    class Again(RunEffects):
        handles = (Emit,)

    assert table_problems([*FAMILIES, Again]) == ["Emit is handled by RunEffects and Again"]

    class Stranger(RunEffects):
        handles = (int,)

    assert table_problems([*FAMILIES, Stranger]) == ["int is no Effect"]

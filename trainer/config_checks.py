"""The value checks the config tables' ``__post_init__`` methods share (stdlib only).

Each appends "key: problem" to ``problems`` and never raises, so that one load reports
every bad value at once; ``raise_if`` then raises them together as one ``ConfigError``.
"""

from __future__ import annotations

import math
from typing import Any

from wire.errors import ConfigError


def is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def show(value: object) -> str:
    """repr for error messages; 1e-3 stays 0.001 and -1.0 (an int converted to float) shows -1."""
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e15:
        return repr(int(value))
    return repr(value)


def skip_ranges(problems: list[str], value: object) -> tuple[tuple[int, int], ...]:
    ranges: list[tuple[int, int]] = []
    items: list[Any] = list(value) if isinstance(value, (list, tuple)) else [value]
    for item in items:
        pair = list(item) if isinstance(item, (list, tuple)) else []
        ints = len(pair) == 2 and all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in pair)
        if not ints or pair[0] >= pair[1]:
            problems.append(f"skip: expected [start, end) sample ranges with 0 <= start < end, got {item!r}")
            continue
        ranges.append((int(pair[0]), int(pair[1])))
    return tuple(sorted(ranges))


def need_int(problems: list[str], key: str, value: object, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        problems.append(f"{key}: expected an integer, got {value!r}")
    elif value < minimum:
        what = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"
        problems.append(f"{key}: expected {what}, got {value}")


def need_number(
    problems: list[str], key: str, value: object, *, positive: bool = False,
    minimum: float | None = None, below: float | None = None,
) -> None:
    if not is_number(value) or not math.isfinite(float(value)):  # type: ignore[arg-type]
        problems.append(f"{key}: expected a finite number, got {show(value)}")
        return
    number = float(value)  # type: ignore[arg-type]
    if positive and number <= 0:
        problems.append(f"{key}: expected a positive number, got {show(value)}")
    elif minimum is not None and number < minimum:
        problems.append(f"{key}: expected a number >= {minimum}, got {show(value)}")
    elif below is not None and number >= below:
        problems.append(f"{key}: expected a number < {below}, got {show(value)}")


def need_choice(problems: list[str], key: str, value: object, choices: tuple[str, ...]) -> None:
    if value not in choices:
        listed = ", ".join(repr(c) for c in choices)
        problems.append(f"{key}: expected one of {listed}, got {value!r}")


def raise_if(problems: list[str]) -> None:
    if problems:
        raise ConfigError(problems)

"""Patterns matched against what trainers print, in time linear in the line.

Every line a trainer prints is tried against every pattern the daemon knows (progress
formats, fatal signatures, compile lines) and the spec's own ``progress_pattern``, on the
daemon's tick. Python's ``re`` backtracks: a crafted line made the progress bar's pattern
take 0.53 s per 64 KiB line, and a spec's pattern may be exponential. Here the patterns
are one RE2 set (google-re2): one pass over the line, linear in its length whatever the
patterns, says which of them match, and only those are run again, alone (RE2 too), for
their groups.

A pattern RE2 cannot run (a lookahead: health.neuron's table has three) is found in the
set by its literal prefix, and confirmed with ``re`` on at most ``BOUNDED_CHARS``
characters from there, at its first ``BOUNDED_TRIES`` occurrences (what follows further
on is not seen by its lookahead). A spec's pattern must be one RE2 runs (``check``).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

import re2

BOUNDED_CHARS = 1024  # of a line, from a literal prefix, that ``re`` is run on
BOUNDED_TRIES = 8  # occurrences of the prefix in one line that ``re`` is run at
_META = frozenset("\\.^$*+?{}[]|()")


def _options() -> Any:
    options = re2.Options()
    options.log_errors = False  # a refused pattern is reported to the caller, not on stderr
    return options


_OPTIONS = _options()


def check(pattern: str) -> None:
    """ValueError unless RE2 runs ``pattern`` (no backreference, no lookaround)."""
    try:
        re2.compile(pattern, _OPTIONS)
    except re2.error as e:
        detail = e.args[0].decode(errors="replace") if e.args and isinstance(e.args[0], bytes) else str(e)
        raise ValueError(f"{pattern!r} is not a pattern RE2 can match in linear time ({detail}): "
                         "no backreferences or lookarounds") from e


def literal_prefix(pattern: str) -> str:
    """The characters ``pattern`` starts with that match only themselves."""
    out = []
    for ch in pattern:
        if ch in _META:
            break
        out.append(ch)
    return "".join(out)


class PatternSet:
    """Patterns tried together on a line: ``matching`` (which match), ``search`` (the
    match of one of them, with its groups)."""

    def __init__(self, patterns: Sequence[str]) -> None:
        self._set = re2.Set.SearchSet(_OPTIONS)
        self._one: list[Any] = []  # an RE2 pattern, or (literal prefix, Python pattern)
        for i, pattern in enumerate(patterns):
            try:
                one: Any = re2.compile(pattern, _OPTIONS)
                prefilter = pattern
            except re2.error:
                prefix = literal_prefix(pattern)
                if not prefix:
                    raise ValueError(f"{pattern!r}: RE2 cannot run it, and it has no literal prefix") \
                        from None
                one, prefilter = (prefix, re.compile(pattern)), re2.escape(prefix)
            if self._set.Add(prefilter) != i:
                raise ValueError(f"{pattern!r}: RE2 refused it in a set")
            self._one.append(one)
        self._set.Compile()

    def matching(self, line: str) -> frozenset[int]:
        """The indices of the patterns that match somewhere in ``line``."""
        hits = self._set.Match(line) or ()
        return frozenset(i for i in hits if not isinstance(self._one[i], tuple) or self.search(i, line))

    def search(self, index: int, line: str) -> Any:
        """Pattern ``index``'s first match in ``line`` (None: none): ``groupdict()``,
        ``start()``, ``group(name)``."""
        one = self._one[index]
        if not isinstance(one, tuple):
            return one.search(line)
        prefix, pattern = one
        at = line.find(prefix)
        for _ in range(BOUNDED_TRIES):
            if at < 0:
                break
            m = pattern.match(line[at:at + BOUNDED_CHARS])
            if m is not None:
                return m
            at = line.find(prefix, at + 1)
        return None

"""What the health probe tests share: one finding, and the shape of a failed probe."""

from __future__ import annotations

from health.model import Action, Finding, Status

FAILED = "unknown: probe failed:"


def only(findings: list[Finding]) -> Finding:
    assert len(findings) == 1, findings
    return findings[0]


def assert_failed(findings: list[Finding], why: str) -> None:
    f = only(findings)
    assert f.status is Status.UNKNOWN and f.action is Action.NONE, f
    assert f.evidence.startswith(FAILED), f.evidence
    assert why in f.evidence, f.evidence

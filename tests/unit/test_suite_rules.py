"""The suite's own rules (tests/conftest.py): a test's own waits end inside pytest's
limit, through the test's abort."""

from __future__ import annotations

import pytest

from tests.conftest import ABORT_GRACE_S, TEST_TIMEOUT_S, own_wait


def test_a_tests_own_wait_must_end_with_its_abort_inside_pytests_limit() -> None:
    assert TEST_TIMEOUT_S == 600  # pyproject.toml's, read
    assert own_wait(TEST_TIMEOUT_S - ABORT_GRACE_S) == TEST_TIMEOUT_S - ABORT_GRACE_S
    with pytest.raises(ValueError, match="do not fit in pytest's 600 s"):
        own_wait(600)

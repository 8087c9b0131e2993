"""ThrottledLog: one line per reason per interval, with the count it stands for."""

from __future__ import annotations

import logging

import pytest

from layertap.server.throttled_log import ThrottledLog

pytestmark = pytest.mark.unit


def test_one_line_per_reason_per_interval_with_the_count(caplog):
    now = [0.0]
    throttled = ThrottledLog(logging.getLogger("test.throttled"), every=60.0, clock=lambda: now[0])
    with caplog.at_level(logging.WARNING, logger="test.throttled"):
        assert throttled.warning("UNAUTHENTICATED", "refused a") is True
        assert [throttled.warning("UNAUTHENTICATED", f"refused {i}") for i in range(1000)] == [False] * 1000
        assert throttled.warning("PERMISSION_DENIED", "denied") is True  # reasons are apart
        now[0] = 59.9
        assert throttled.warning("UNAUTHENTICATED", "refused b") is False
        now[0] = 60.0
        assert throttled.warning("UNAUTHENTICATED", "refused c") is True
    lines = [r.getMessage() for r in caplog.records]
    assert lines == ["refused a", "denied",
                     "refused c (1002 such events since the last line, 60 s apart at most)"]

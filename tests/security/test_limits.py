"""Per-client limits: the token bucket (pure) and the limiter that applies it."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meshnet.config import ApiLimits
from meshnet.errors import LimitError
from meshnet.security.limits import ClientLimiter, take


@pytest.mark.parametrize(
    ("tokens", "elapsed_s", "allowed"),
    [(5.0, 0.0, True), (0.5, 0.0, False), (0.5, 0.5, True), (0.0, 0.9, False)],
)
def test_take(tokens: float, elapsed_s: float, allowed: bool) -> None:
    from meshnet.security.limits import Bucket

    _, wait_s = take(Bucket(tokens, 10.0), 10.0 + elapsed_s, rate_per_s=1.0, burst=5)
    assert (wait_s == 0.0) is allowed


@settings(max_examples=200, deadline=None)
@given(gaps=st.lists(st.floats(0, 2, allow_nan=False), max_size=60))
def test_no_client_gets_more_than_burst_plus_rate_times_time(gaps: list[float]) -> None:
    bucket, now, allowed = None, 0.0, 0
    for gap in gaps:
        now += gap
        bucket, wait_s = take(bucket, now, rate_per_s=2.0, burst=3)
        allowed += wait_s == 0.0
    assert allowed <= 3 + 2.0 * now + 1e-9


def test_rate_and_concurrency_are_per_client() -> None:
    now = [0.0]
    limiter = ClientLimiter(
        ApiLimits(requests_per_minute=60, burst_requests=2, max_concurrent_per_client=1),
        clock=lambda: now[0],
    )
    limiter.admit("a")
    limiter.admit("a")
    with pytest.raises(LimitError) as refused:
        limiter.admit("a")
    assert refused.value.http_status == 429 and refused.value.headers()["Retry-After"] == "1"
    limiter.admit("b")  # another client has its own bucket
    now[0] = 1.0
    limiter.admit("a")  # refilled one request per second
    limiter.acquire("a")
    with pytest.raises(LimitError):
        limiter.acquire("a")
    limiter.acquire("b")
    limiter.release("a")
    limiter.acquire("a")
    assert limiter.refused == {"rate": 1, "concurrency": 1}

"""Refusal throttling: after its refusals for the minute, a caller gets 429 before any check."""

from __future__ import annotations

import pytest

from meshnet.config import AccessConfig
from meshnet.errors import LimitError
from meshnet.security.signing import Signer
from meshnet.security.throttle import RefusalThrottle
from tests.security.test_access import ME, SWARM, app, send


def test_a_caller_over_its_refusals_waits_for_the_minute_to_end() -> None:
    now = [0.0]
    throttle = RefusalThrottle(3, lambda: now[0])
    for _ in range(3):
        throttle.check("10.0.0.1")
        throttle.refused("10.0.0.1")
    with pytest.raises(LimitError) as limited:
        throttle.check("10.0.0.1")
    assert limited.value.retry_after_s == pytest.approx(60.0)
    throttle.check("10.0.0.2")  # another caller: its own count
    now[0] = 60.0
    throttle.check("10.0.0.1")  # a new minute


def test_the_tracked_callers_stay_bounded() -> None:
    now = [0.0]
    throttle = RefusalThrottle(1, lambda: now[0], max_callers=100)
    for i in range(1000):
        now[0] = i * 0.001
        throttle.refused(f"10.0.{i // 256}.{i % 256}")
    assert len(throttle.windows) <= 100
    with pytest.raises(LimitError):
        throttle.check("10.0.3.231")  # the newest are kept


def test_the_guard_answers_429_past_the_refusals_and_the_app_sees_nothing() -> None:
    access = AccessConfig(swarm_key=SWARM, api_keys=("client-key-1",), max_refusals_per_minute=3)
    application = app(access)
    wrong = {"Authorization": "Bearer wrong-key-000"}
    statuses = [send(application, "POST", "/api", headers=wrong).status_code for _ in range(4)]
    assert statuses == [401, 401, 401, 429]
    good = {"Authorization": "Bearer client-key-1"}
    limited = send(application, "POST", "/api", headers=good)
    assert limited.status_code == 429 and int(limited.headers["Retry-After"]) >= 1


def test_a_members_signed_call_is_never_throttled_by_strangers_on_its_address() -> None:
    """Review N2: 61 unsigned calls from an address members share (a host, a NAT) got that
    address's signed heartbeats 429 for a minute, and the tracker declared the nodes dead."""
    access = AccessConfig(swarm_key=SWARM, max_refusals_per_minute=60)
    application = app(access)
    statuses = [send(application, "POST", "/member").status_code for _ in range(61)]
    assert statuses[:60] == [401] * 60 and statuses[60] == 429  # the stranger is throttled
    headers = Signer(SWARM).headers("POST", "/member", b"beat", to=ME)
    member = send(application, "POST", "/member", headers=headers, content=b"beat")
    assert member.status_code == 200, member.text
    assert send(application, "POST", "/member").status_code == 429  # the stranger still is

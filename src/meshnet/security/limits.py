"""Per-client limits at the entry node: a request rate (token bucket) and generations in flight.

`take` is the pure decision (clock passed in); `ClientLimiter` keeps one bucket and one
in-flight count per client identity (an API key's fingerprint, or a loopback address).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from meshnet.config import ApiLimits
from meshnet.errors import LimitError, RequestError


@dataclass(frozen=True)
class Bucket:
    tokens: float  # requests the client may send right now
    updated_s: float


def take(
    bucket: Bucket | None, now_s: float, rate_per_s: float, burst: int
) -> tuple[Bucket, float]:
    """Spend one request from `bucket`: (the bucket after, seconds to wait; 0 = allowed).

    A new client starts with a full bucket of `burst`; it refills at `rate_per_s`.
    """
    if bucket is None:
        bucket = Bucket(float(burst), now_s)
    elapsed = max(0.0, now_s - bucket.updated_s)
    tokens = min(float(burst), bucket.tokens + elapsed * rate_per_s)
    if tokens >= 1.0:
        return Bucket(tokens - 1.0, now_s), 0.0
    return Bucket(tokens, now_s), (1.0 - tokens) / rate_per_s


class ClientLimiter:
    """Applies `ApiLimits`' rate and concurrency to each client."""

    def __init__(self, limits: ApiLimits, clock: Callable[[], float] = time.monotonic) -> None:
        self.limits = limits
        self.clock = clock
        self.buckets: dict[str, Bucket] = {}
        self.in_flight: dict[str, int] = {}
        self.refused = {"rate": 0, "concurrency": 0}  # counts, for tests and metrics

    def admit(self, client: str) -> None:
        """Count one request against `client`'s rate; `LimitError` (429) when over it."""
        rate = self.limits.requests_per_minute / 60.0
        if rate <= 0:
            return
        if len(self.buckets) > 10_000:
            self._forget_full(rate)
        bucket, wait_s = take(
            self.buckets.get(client), self.clock(), rate, self.limits.burst_requests
        )
        self.buckets[client] = bucket
        if wait_s > 0:
            self.refused["rate"] += 1
            raise LimitError(
                f"rate limit: {self.limits.requests_per_minute:g} requests per minute "
                f"(burst {self.limits.burst_requests}); retry in {wait_s:.1f} s",
                retry_after_s=wait_s,
            )

    def acquire(self, client: str, answers: int = 1) -> None:
        """Start one generation of `answers` answers (its `n`) for `client`: each answer is a
        session on every hop, so each counts (review N7: n = 16 multiplied one key's
        sessions past its limit). 400 when `answers` alone is over the client's limit;
        `LimitError` (429) over it or over the server's answers in flight."""
        per_client = self.limits.max_concurrent_per_client
        if answers > per_client:
            raise RequestError(
                f"n is {answers}; this server runs at most {per_client} answers at once for "
                f"one client",
                field="n",
            )
        total = sum(self.in_flight.values())
        if total + answers > self.limits.max_generations:
            self.refused["concurrency"] += 1
            raise LimitError(
                f"this server has {total} answers in flight (limit "
                f"{self.limits.max_generations}); retry shortly",
                retry_after_s=1.0,
            )
        count = self.in_flight.get(client, 0)
        if count + answers > per_client:
            self.refused["concurrency"] += 1
            raise LimitError(
                f"{count} answers of this client are in flight (limit {per_client}); "
                f"wait for one to finish",
                retry_after_s=1.0,
            )
        self.in_flight[client] = count + answers

    def release(self, client: str, answers: int = 1) -> None:
        count = self.in_flight.get(client, answers) - answers
        if count > 0:
            self.in_flight[client] = count
        else:
            self.in_flight.pop(client, None)

    def _forget_full(self, rate: float) -> None:
        """Drop buckets that have refilled: such a client starts full anyway."""
        now, burst = self.clock(), self.limits.burst_requests
        self.buckets = {
            c: b for c, b in self.buckets.items() if b.tokens + (now - b.updated_s) * rate < burst
        }

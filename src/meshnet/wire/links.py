"""Link rates a sender measures from its own frames, for `auto` encoding (ADR-0037).

Every answer to a frame says how long the receiver held it (`X-Meshnet-Hold-Ms`: from the
request's last byte read to its answer ready, compute and any pushed chain after it). What
is left of the sender's elapsed time is the link's: one round trip plus the bytes both ways
at the link rate. Small frames (decode steps, 2 x hidden bytes) give the round trip (the
median of the last 16); large ones (prefill chunks) then give the rate (the median of 5):

    rate = (request bytes + answer bytes) / (transfer - round trip)

A link with no small-frame sample yet, or no large one, has no rate.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field

from meshnet.wire.headers import HOLD

RATE_MIN_BYTES = 32 * 1024  # frames at least this large (both ways) measure the rate
MIN_SAMPLES = 16  # the round trip is the median transfer of the last this many small frames
RATE_SAMPLES = 5  # the rate is the median of the last this many large frames
MAX_LINKS = 64  # peers remembered; the least recently measured go first
MAX_HOLD_MS = 10_000_000.0  # a larger (or unparsable) hold is no measurement


@dataclass
class Link:
    """What one sender measured of its link to one peer (seconds, bytes)."""

    small_s: deque[float] = field(default_factory=lambda: deque(maxlen=MIN_SAMPLES))
    large: deque[tuple[int, float]] = field(default_factory=lambda: deque(maxlen=RATE_SAMPLES))

    def bytes_per_s(self) -> float | None:
        if not self.small_s or not self.large:
            return None
        # the median: jitter is on both sides of it, as on the large frames (the least
        # small frame made a fast link with jitter read as a slow one)
        round_trip_s = statistics.median(self.small_s)
        # a large frame no slower than the round trip crossed a link too fast to time: 10 GB/s
        rates = [n / max(t - round_trip_s, n / 1e10) for n, t in self.large]
        return statistics.median(rates)


class LinkRates:
    """Measured link rates (bytes/s) by peer id."""

    def __init__(self) -> None:
        self.links: dict[str, Link] = {}

    def record(self, peer: str, wire_bytes: int, elapsed_s: float, hold_s: float | None) -> None:
        """A frame of `wire_bytes` (request and answer bodies) to `peer` took `elapsed_s`
        from send to the answer's last byte, `hold_s` of it at the peer (None: not said)."""
        if hold_s is None:
            return
        link = self.links.pop(peer, None) or Link()
        self.links[peer] = link  # most recently measured last
        transfer_s = max(elapsed_s - hold_s, 0.0)
        if wire_bytes >= RATE_MIN_BYTES:
            link.large.append((wire_bytes, transfer_s))
        else:
            link.small_s.append(transfer_s)
        if len(self.links) > MAX_LINKS:
            del self.links[next(iter(self.links))]

    def bytes_per_s(self, peer: str) -> float | None:
        link = self.links.get(peer)
        return None if link is None else link.bytes_per_s()

    def report_mbit_s(self) -> dict[str, float]:
        """Measured rates in Mbit/s by peer, those with a rate (for metrics)."""
        rates = {peer: link.bytes_per_s() for peer, link in self.links.items()}
        return {peer: round(8 * r / 1e6, 1) for peer, r in rates.items() if r is not None}


def hold_s(headers: Mapping[str, str]) -> float | None:
    """The seconds an answer's `X-Meshnet-Hold-Ms` says; None when absent or not a sane
    number (it only feeds a measurement: a bad one is dropped, never an error)."""
    value = next((v for k, v in headers.items() if k.lower() == HOLD.lower()), None)
    if value is None or len(value) > 20:
        return None
    try:
        ms = float(value)
    except ValueError:
        return None
    return ms / 1000 if math.isfinite(ms) and 0 <= ms <= MAX_HOLD_MS else None


def hold_header(received_s: float, now_s: float) -> dict[str, str]:
    """The answer header for a frame whose body was read at `received_s` (perf_counter)."""
    return {HOLD: f"{max(now_s - received_s, 0.0) * 1000:.3f}"}

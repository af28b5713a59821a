"""Refusal throttling: a caller that keeps failing the credential check is answered 429
before anything is checked (review finding 12: 401s were never rate-limited, since the
per-client limiter runs after the guard)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from meshnet.errors import LimitError

WINDOW_S = 60.0


@dataclass
class RefusalThrottle:
    """Counts refused credentials per caller address in fixed one-minute windows."""

    max_per_minute: int  # refusals a caller may earn a minute; 0 = no throttle
    clock: Callable[[], float]  # monotonic seconds
    max_callers: int = 10_000  # addresses tracked at once (the oldest windows go first)
    windows: dict[str, tuple[float, int]] = field(default_factory=dict)  # host -> (start, n)

    def check(self, host: str) -> None:
        """`LimitError` (429) while `host` is over its refusals for this minute."""
        if self.max_per_minute <= 0:
            return
        start, count = self.windows.get(host, (0.0, 0))
        left_s = start + WINDOW_S - self.clock()
        if count >= self.max_per_minute and left_s > 0:
            raise LimitError(
                f"{count} refused credentials from this address in the last minute; "
                f"try again in {left_s:.0f} s",
                retry_after_s=max(1.0, left_s),
            )

    def refused(self, host: str) -> None:
        """`host` just failed a credential check."""
        if self.max_per_minute <= 0:
            return
        now = self.clock()
        start, count = self.windows.get(host, (now, 0))
        if now - start >= WINDOW_S:
            start, count = now, 0
        self.windows[host] = (start, count + 1)
        if len(self.windows) > self.max_callers:
            self._prune(now)

    def _prune(self, now: float) -> None:
        live = {h: w for h, w in self.windows.items() if now - w[0] < WINDOW_S}
        oldest = sorted(live, key=lambda h: live[h][0])[: len(live) - self.max_callers // 2]
        self.windows = {h: w for h, w in live.items() if h not in set(oldest)}

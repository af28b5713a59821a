"""Reports that a node fails, and whose routes they change (review N5: one member's report
kept any node out of every route for 30 s).

A report from the tracker itself (its forwarding to an entry failed), or from two members
that agree, keeps the node out of every route for `suspect_s`. One member's report keeps it
out of that member's own routes only: a hostile member can steer nobody but itself, and an
honest entry's next request still avoids the node it just saw fail.
"""

from __future__ import annotations

from dataclasses import dataclass, field

TRACKER_REPORTS = "tracker"  # the reporter name of the tracker's own observations
AGREEING_MEMBERS = 2  # members whose reports together count for every route
MAX_REPORTERS = 64  # reporters remembered per node (the latest win)


@dataclass
class Reports:
    """Who reported one node failing, and until when (seconds, the registry's clock)."""

    until_s: dict[str, float] = field(default_factory=dict)

    def add(self, reporter: str, until_s: float) -> None:
        self.until_s.pop(reporter, None)  # re-inserted last: the newest are kept
        self.until_s[reporter] = until_s
        while len(self.until_s) > MAX_REPORTERS:
            self.until_s.pop(next(iter(self.until_s)))

    def agreed(self, now_s: float) -> bool:
        """Out of every route: the tracker saw it fail, or members agree it fails."""
        live = {r for r, until in self.until_s.items() if until > now_s}
        return TRACKER_REPORTS in live or len(live) >= AGREEING_MEMBERS

    def excludes(self, now_s: float, origin: str | None) -> bool:
        """Out of the routes `origin` (the entry asking) is given."""
        mine = origin is not None and self.until_s.get(origin, 0.0) > now_s
        return mine or self.agreed(now_s)

"""Which of a mesh's trackers plans: a lease a majority of them grant (ADR-0057).

Every tracker votes. It grants its vote to one candidate at a time, for `lease_s` from the
moment the ask reached it, and grants it again to the same candidate (a renewal). A
candidate granted a majority of votes (its own included) plans until `SAFETY * lease_s`
after it *sent* its ask: that is before any of those votes runs out, so a planner cut off
from the others stops planning before they can elect another (clocks only need to run at
about the same rate). Terms number the leases: a candidate whose vote is not already its
own asks with a term above every term it has seen, and nodes ignore the directives of a
term below the highest they have seen while its planner still answers (`node/agent.py`).
Only the mesh's own trackers are candidates, and terms come from trackers only: a member
that reports a huge term to a tracker raises nothing (review L1, L2).

Pure: the clock is the caller's (`now` in seconds, monotonic); nothing here does I/O.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

SAFETY = 0.8  # a planner stops this share of the lease after sending its ask
NEVER = -math.inf


@dataclass(frozen=True)
class Ask:
    """A candidate's ask for the lease (or its renewal)."""

    candidate: str  # the candidate tracker's URL
    term: int


@dataclass(frozen=True)
class Grant:
    """A tracker's answer to an `Ask`."""

    granted: bool
    term: int  # the highest term the voter has granted
    holder: str | None  # whom its vote is with now (None: nobody)


class Lease:
    """One tracker's vote and, when it plans, its lease; `trackers` are every tracker's URL
    (this one's included), the same list on every tracker."""

    def __init__(self, me: str, trackers: Sequence[str], lease_s: float, start_s: float) -> None:
        self.me = me
        self.trackers = sorted({*trackers, me})
        self.lease_s = lease_s
        self.period_s = lease_s / 6  # how often a tracker asks (or renews)
        self.stagger_s = lease_s / 3  # trackers ask in the order of their URLs, this far apart
        self.rank = self.trackers.index(me)
        self.term = 0  # the highest term this tracker granted or was told of
        self.holder: str | None = None  # whom our vote is with...
        self.vote_until_s = start_s  # ...until then
        self.leads_until_s = NEVER  # when we plan: until then
        self.planner_term = 0  # the term of our lease, while we plan

    @property
    def majority(self) -> int:
        return len(self.trackers) // 2 + 1

    def leads(self, now: float) -> bool:
        return now < self.leads_until_s

    def planner(self, now: float) -> str | None:
        """The planner as far as we know: the one our vote is with (ourselves only while we
        plan), while that vote is live."""
        if now >= self.vote_until_s or (self.holder == self.me and not self.leads(now)):
            return None
        return self.holder

    def vote(self, ask: Ask, now: float) -> Grant:
        """Grant `ask` unless our vote is with another live candidate, or `ask`'s term is
        below one we granted (the denial tells the candidate the term to pass). Our own
        vote for ourselves raises our term only if we win (`tally`): a tracker that keeps
        losing must not outbid the planner's renewals."""
        free = now >= self.vote_until_s or self.holder in (None, ask.candidate)
        if not free or ask.term < self.term or ask.candidate not in self.trackers:
            return Grant(False, self.term, self.planner(now))
        self.holder, self.vote_until_s = ask.candidate, now + self.lease_s
        if ask.candidate != self.me:
            self.term = ask.term
            self.leads_until_s = NEVER  # not reachable while our lease is live: vote is ours
        return Grant(True, ask.term, ask.candidate)

    def due(self, now: float) -> bool:
        """Whether to ask now: to renew our lease, or because no vote of ours is with a live
        planner and our turn (by rank) has come."""
        if self.leads(now) or self.holder == self.me:
            return True
        return now >= self.vote_until_s + self.rank * self.stagger_s

    def ask(self, now: float) -> Ask:
        """Our ask: a renewal keeps our term; a first ask passes every term we know of."""
        renewing = self.holder == self.me and now < self.vote_until_s and self.term > 0
        return Ask(self.me, self.term if renewing else self.term + 1)

    def tally(self, ask: Ask, sent_s: float, own: Grant, grants: Sequence[Grant]) -> bool:
        """Count the answers to `ask` (sent at `sent_s`; `own`: our own vote on it); true
        when we plan now. A failed first ask gives our own vote back, so that another
        candidate can win (we ask again after our rank's turn, or, when an answer named a
        live planner, once its lease would have run out); a failed renewal keeps it until
        the lease we hold has run out."""
        self.term = max(self.term, *(g.term for g in grants)) if grants else self.term
        votes = own.granted + sum(g.granted for g in grants)
        if own.granted and votes >= self.majority:
            self.leads_until_s = sent_s + SAFETY * self.lease_s
            self.planner_term = self.term = max(self.term, ask.term)
            return True
        if own.granted and not self.leads(sent_s):
            self.holder, self.vote_until_s = None, sent_s
            named = [g.holder for g in grants if g.holder not in (None, self.me)]
            if named:  # a live planner we had not heard of: follow it, do not ask again
                self.holder, self.vote_until_s = named[0], sent_s + self.lease_s
        return False

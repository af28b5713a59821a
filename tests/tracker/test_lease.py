"""The planner's lease (ADR-0057), simulated: trackers ask, vote and tally over a network that
delays, cuts and kills; never two planners at once, and a new one soon after a death."""

from __future__ import annotations

import heapq
import itertools
import random
from dataclasses import dataclass, field

from hypothesis import given, settings
from hypothesis import strategies as st

from meshnet.tracker.lease import Ask, Grant, Lease

INTERVAL_S = 2.0  # the heartbeat interval
LEASE_S = 1.5 * INTERVAL_S  # as `tracker/peering.py` sets it


@dataclass
class Campaign:
    ask: Ask
    sent_s: float
    own: Grant
    grants: list[Grant] = field(default_factory=list)


class Mesh:
    """`n` trackers running `Peering.round`'s steps; messages take up to `delay_s` each way
    and an answer later than one period is lost (the real client's timeout)."""

    def __init__(self, n: int, rng: random.Random, delay_s: float) -> None:
        self.urls = [f"http://t{i}:8000" for i in range(n)]
        self.leases = {u: Lease(u, self.urls, LEASE_S, 0.0) for u in self.urls}
        self.rng, self.delay_s = rng, delay_s
        self.now = 0.0
        self.queue: list[tuple[float, int, str, object]] = []
        self.seq = itertools.count()
        self.cut: set[frozenset[str]] = set()
        self.dead: set[str] = set()
        self.most_planners = 0
        for url in self.urls:
            self.at(rng.uniform(0, LEASE_S / 6), "tick", url)

    def at(self, when_s: float, kind: str, payload: object) -> None:
        heapq.heappush(self.queue, (when_s, next(self.seq), kind, payload))

    def talk(self, a: str, b: str) -> bool:
        return a not in self.dead and b not in self.dead and frozenset({a, b}) not in self.cut

    def planners(self) -> list[str]:
        return [
            u for u, lease in self.leases.items() if u not in self.dead and lease.leads(self.now)
        ]

    def run_until(self, end_s: float) -> None:
        while self.queue and self.queue[0][0] <= end_s:
            self.now, _, kind, payload = heapq.heappop(self.queue)
            getattr(self, "_" + kind)(payload)
            self.most_planners = max(self.most_planners, len(self.planners()))
        self.now = end_s

    def _tick(self, url: object) -> None:
        assert isinstance(url, str)
        lease = self.leases[url]
        period = lease.period_s
        if url in self.dead:
            self.at(self.now + period, "tick", url)
            return
        if lease.due(self.now):
            ask = lease.ask(self.now)
            own = lease.vote(ask, self.now)
            if own.granted:
                campaign = Campaign(ask, self.now, own)
                for peer in self.urls:
                    if peer != url and self.talk(url, peer):
                        self.at(
                            self.now + self.rng.uniform(0, self.delay_s), "arrive", (peer, campaign)
                        )
                self.at(self.now + period, "tally", campaign)
                return
        self.at(self.now + period, "tick", url)

    def _arrive(self, payload: object) -> None:
        peer, campaign = payload  # type: ignore[misc]
        if peer in self.dead:
            return
        grant = self.leases[peer].vote(campaign.ask, self.now)
        back_s = self.now + self.rng.uniform(0, self.delay_s)
        if back_s < campaign.sent_s + self.leases[peer].period_s and self.talk(
            peer, campaign.ask.candidate
        ):
            campaign.grants.append(grant)

    def _tally(self, campaign: object) -> None:
        assert isinstance(campaign, Campaign)
        url = campaign.ask.candidate
        if url not in self.dead:
            self.leases[url].tally(campaign.ask, campaign.sent_s, campaign.own, campaign.grants)
        self.at(self.now, "tick", url)


def test_three_trackers_elect_the_first_and_a_new_planner_within_3_intervals_of_its_death() -> None:
    mesh = Mesh(3, random.Random(1), delay_s=0.05)
    mesh.run_until(2 * INTERVAL_S)
    assert mesh.planners() == [mesh.urls[0]]  # the first in URL order asks first
    first_term = mesh.leases[mesh.urls[0]].planner_term
    mesh.run_until(20.0)
    assert mesh.planners() == [mesh.urls[0]]  # renewals keep it: no flapping
    assert mesh.leases[mesh.urls[0]].planner_term == first_term
    mesh.dead.add(mesh.urls[0])
    killed_s = mesh.now
    while not mesh.planners():
        mesh.run_until(mesh.now + 0.05)
    assert mesh.now - killed_s <= 3 * INTERVAL_S
    (new,) = mesh.planners()
    assert mesh.leases[new].planner_term > first_term


def test_two_trackers_lose_the_planner_with_either_one() -> None:
    """A majority of 2 is 2: with one of two trackers dead nobody plans (the mesh keeps
    serving what it holds); 3 trackers survive any one."""
    mesh = Mesh(2, random.Random(2), delay_s=0.05)
    mesh.run_until(5.0)
    assert len(mesh.planners()) == 1
    mesh.dead.add(mesh.planners()[0])
    mesh.run_until(30.0)
    assert mesh.planners() == []


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 2**32),
    n=st.sampled_from([2, 3, 5]),
    events=st.lists(
        st.tuples(
            st.floats(0.1, 60.0), st.sampled_from(["cut", "isolate", "heal", "kill", "revive"])
        ),
        max_size=12,
    ),
)
def test_never_two_planners_at_once_through_cuts_deaths_and_delays(
    seed: int, n: int, events: list[tuple[float, str]]
) -> None:
    rng = random.Random(seed)
    mesh = Mesh(n, rng, delay_s=rng.choice([0.01, 0.1, 0.2]))
    for when_s, what in sorted(events):
        mesh.run_until(when_s)
        a, b = rng.sample(mesh.urls, 2)
        if what == "cut":
            mesh.cut.add(frozenset({a, b}))
        elif what == "isolate":  # the planner, if any, else anyone: cut from all the others
            cut = (mesh.planners() or [a])[0]
            mesh.cut |= {frozenset({cut, other}) for other in mesh.urls if other != cut}
        elif what == "heal":
            mesh.cut.clear()
        elif what == "kill":
            mesh.dead.add(a)
        else:
            mesh.dead.discard(a)
    mesh.run_until(80.0)
    assert mesh.most_planners <= 1
    if not mesh.dead and not mesh.cut:  # all healed: somebody plans again
        assert len(mesh.planners()) == 1


def test_a_renewal_keeps_the_term_and_a_vote_with_a_live_planner_is_refused() -> None:
    lease = Lease("http://b", ["http://a", "http://b", "http://c"], LEASE_S, 0.0)
    assert lease.vote(Ask("http://a", 1), 0.0).granted
    refused = lease.vote(Ask("http://c", 2), 1.0)
    assert not refused.granted and refused.holder == "http://a"
    assert lease.vote(Ask("http://a", 1), 2.0).granted  # a's renewal
    assert lease.vote(Ask("http://c", 2), 2.0 + LEASE_S).granted  # a went quiet: c may
    assert not lease.vote(Ask("http://a", 1), 2.0 + LEASE_S).granted  # a's old term: stale


def test_a_candidate_that_is_no_tracker_of_the_mesh_gets_no_vote() -> None:
    """Review L2: a member asked as a URL that is none of the trackers'."""
    lease = Lease("http://a", ["http://a", "http://b", "http://c"], LEASE_S, 0.0)
    refused = lease.vote(Ask("http://127.0.0.1:9", 1), 1.0)
    assert not refused.granted and lease.holder is None and lease.term == 0
    assert lease.vote(Ask("http://b", 1), 1.0).granted  # a tracker of the mesh still may


def test_terms_start_above_every_term_this_tracker_knows_and_renewals_keep_them() -> None:
    lease = Lease("http://a", ["http://a"], LEASE_S, 0.0)
    ask = lease.ask(0.0)
    assert ask.term == 1
    assert lease.tally(ask, 0.0, lease.vote(ask, 0.0), [])
    assert lease.planner_term == 1 and lease.ask(0.1).term == 1  # renewals keep it


def test_a_tracker_started_after_the_election_follows_the_planner_without_raising_terms() -> None:
    """The lowest URL starts late: it asks, is refused, then votes for the planner's next
    renewal and names it; the planner keeps its term (a loser's own votes raise nothing)."""
    mesh = Mesh(3, random.Random(3), delay_s=0.05)
    late = mesh.urls[0]
    mesh.dead.add(late)
    mesh.run_until(5.0)
    (planner,) = mesh.planners()
    term = mesh.leases[planner].planner_term
    mesh.dead.discard(late)
    mesh.run_until(10.0)
    assert mesh.planners() == [planner] and mesh.leases[planner].planner_term == term
    assert {mesh.leases[u].planner(mesh.now) for u in mesh.urls if u != planner} == {planner}


def test_a_planner_cut_off_stops_before_the_others_elect_one_within_3_intervals() -> None:
    """A partition: the planner loses both links. It stops planning (its lease runs out
    unrenewed) before the majority side's new planner starts, and that one starts within
    3 heartbeat intervals of the cut; after the heal there is still one planner."""
    mesh = Mesh(3, random.Random(4), delay_s=0.05)
    mesh.run_until(10.0)
    (old,) = mesh.planners()
    mesh.cut |= {frozenset({old, other}) for other in mesh.urls if other != old}
    cut_s, stopped_s, new_s = mesh.now, None, None
    while new_s is None:
        mesh.run_until(mesh.now + 0.01)
        if stopped_s is None and not mesh.leases[old].leads(mesh.now):
            stopped_s = mesh.now
        if any(u != old for u in mesh.planners()):
            new_s = mesh.now
    assert stopped_s is not None and stopped_s < new_s <= cut_s + 3 * INTERVAL_S
    mesh.cut.clear()
    mesh.run_until(mesh.now + 10.0)
    assert len(mesh.planners()) == 1 and mesh.most_planners == 1

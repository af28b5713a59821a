"""Several trackers, one planner (ADR-0057): the lease rounds over HTTP, and the check that a
mesh's trackers agree on who they are and what they offer.

Every tracker takes every node's registration and heartbeats, so each can answer coverage,
routes and `/v1/entries`; only the one holding the lease of `tracker/lease.py` plans and
sends directives. Each tracker runs `Peering.run`: every `Lease.period_s` it asks its peers
for the lease (or renews it) when its turn has come, and answers their asks with its vote.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
import time
from collections.abc import Callable

import httpx

from meshnet.errors import ConfigError, MeshError, read_error
from meshnet.security.signing import Signer
from meshnet.security.swarm import TRACKER
from meshnet.security.vouch import signed_by
from meshnet.tracker import messages as msg
from meshnet.tracker.lease import Ask, Grant, Lease
from meshnet.tracker.registry import Registry

log = logging.getLogger(__name__)
LEASE_BEATS = 1.5  # a lease lasts this many heartbeat intervals (a new planner: ~2.25)
HELLO_PATH = "/v1/trackers/hello"
LEASE_PATH = "/v1/trackers/lease"
HELLO_TIMEOUT_S = 2.0  # a peer's hello, asked ahead of its asks (beside the lease rounds)


class PeerMismatchError(MeshError):
    """Two trackers of one mesh disagree on its trackers or models."""

    http_status = 409


def ask_statement(url: str, term: int, trackers: list[str], models: list[str]) -> bytes:
    """What a lease ask's signature covers: the candidate, its term and its mesh."""
    return "\n".join(["meshnet-lease-v1", url, str(term), *trackers, "", *models]).encode()


def disagreement(mine: msg.TrackerHello, theirs: msg.TrackerHello) -> str | None:
    """What two trackers disagree on, naming both (None: they agree)."""
    if sorted(mine.trackers) != sorted(theirs.trackers):
        return (
            f"trackers {mine.url} and {theirs.url} list different trackers "
            f"({sorted(mine.trackers)} and {sorted(theirs.trackers)}): give every tracker "
            "the same --peers"
        )
    if sorted(mine.models) != sorted(theirs.models):
        return (
            f"trackers {mine.url} and {theirs.url} offer different models "
            f"({sorted(mine.models)} and {sorted(theirs.models)}): a mesh's trackers must "
            "offer the same ones"
        )
    return None


class Peering:
    """This tracker's side of the lease: its asks, its votes, and what the registry is told."""

    def __init__(
        self,
        hello: msg.TrackerHello,
        registry: Registry,
        client: httpx.AsyncClient,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.hello = hello
        self.registry = registry
        self.client = client  # signs its calls with the swarm key
        self.clock = clock
        lease_s = LEASE_BEATS * registry.base_interval_s
        self.lease = Lease(hello.url, hello.trackers, lease_s, clock())
        self.peers = [t for t in self.lease.trackers if t != hello.url]
        self.planning = False
        self.refused: dict[str, str] = {}  # peer -> why it refused us (logged once)
        # peer -> the key its own hello named, and when we last asked it (review L2's rest:
        # a member asking in the name of a listed tracker that is down)
        self.keys: dict[str, tuple[str | None, float]] = {}
        self._learning: asyncio.Future[None] | None = None
        self._hellos: dict[str, asyncio.Future[str | None]] = {}  # in flight, by peer
        registry.lease = self.lease

    async def run(self) -> None:
        """Ask or renew every `period_s` (cancel to stop), the peers' keys asked first."""
        try:
            self._learning = asyncio.ensure_future(self._learn_unknown())  # peers already up
            while True:
                try:
                    await self.round()
                except Exception:  # the lease loop is a boundary: it must never end (L1)
                    log.exception("lease round failed; trying again")
                    self.registry.metrics.lease_failures.inc()
                await asyncio.sleep(self.lease.period_s)
        finally:
            if self._learning is not None:
                self._learning.cancel()

    async def round(self) -> None:
        now = self.clock()
        if self.lease.due(now):
            ask = self.lease.ask(now)
            own = self.lease.vote(ask, now)
            if own.granted:
                answers = await asyncio.gather(*(self._ask(peer, ask) for peer in self.peers))
                self.lease.tally(ask, now, own, [a for a in answers if a is not None])
        self.sync()
        if self._learning is None or self._learning.done():  # beside the rounds, never in them
            self._learning = asyncio.ensure_future(self._learn_unknown())

    async def _learn_unknown(self) -> None:
        """The keys of the peers we do not know yet, asked ahead (a hung peer must not delay
        a renewal), so that a vote rarely waits on a hello."""
        unknown = [p for p in self.peers if self.keys.get(p, (None, 0.0))[0] is None]
        await asyncio.gather(*(self._learn(p, HELLO_TIMEOUT_S) for p in unknown))

    async def answer(self, ask: msg.LeaseAsk) -> msg.LeaseAnswer:
        """Our vote on a peer's ask; `PeerMismatchError` when it is not of our mesh, its
        candidate is none of the mesh's trackers (review L2: a member named another URL) or
        the ask is not signed by the key the tracker at that URL names itself."""
        self.check(ask)
        if ask.url not in self.lease.trackers or ask.url == self.hello.url:
            raise PeerMismatchError(
                f"{ask.url} asks for the lease but is not another of this mesh's trackers "
                f"({self.lease.trackers})",
                field="url",
            )
        await self._authentic(ask)
        grant = self.lease.vote(Ask(ask.url, ask.term), self.clock())
        self.sync()
        return msg.LeaseAnswer(granted=grant.granted, term=grant.term, holder=grant.holder)

    def check(self, hello: msg.TrackerHello) -> None:
        """Refuse (409, naming both) a tracker that lists other trackers or models."""
        why = disagreement(self.hello, hello)
        if why is not None:
            raise PeerMismatchError(why, field="trackers")

    def sync(self) -> None:
        """Tell the registry whether it plans, when that changed."""
        planning = self.registry.plans_now()
        if planning == self.planning:
            return
        self.planning = planning
        self.registry.metrics.planning.set(int(planning))
        if planning:
            self.registry.metrics.planner_terms.inc()
            log.warning("this tracker plans now (term %d)", self.lease.planner_term)
            self.registry.plan_if_due()
        else:
            log.warning("this tracker no longer plans; %s does", self.lease.planner(self.clock()))
            self.registry.follow()

    def status(self) -> dict[str, object]:
        """Who plans, as this tracker knows it (for `/health`)."""
        now = self.clock()
        planner = self.hello.url if self.lease.leads(now) else self.lease.planner(now)
        return {"planner": planner, "term": self.lease.term, "trackers": self.lease.trackers}

    async def _authentic(self, ask: msg.LeaseAsk) -> None:
        """Refuse (409) an ask unless the tracker at its URL holds the key that signed it:
        asked of that URL itself (its hello), at most once a lease period per peer."""
        statement = ask_statement(ask.url, ask.term, ask.trackers, ask.models)
        if not signed_by(ask.key, ask.signature, statement):
            raise PeerMismatchError(f"the lease ask of {ask.url} is not signed", field="signature")
        key = self.keys.get(ask.url, (None, 0.0))[0]
        if key != ask.key:  # not learned yet, or a restarted tracker's new key
            key = await self._learn(ask.url, HELLO_TIMEOUT_S)  # a late key serves the next ask
        if key != ask.key:
            raise PeerMismatchError(
                f"an ask in the name of {ask.url} is signed with a key that tracker does not "
                "name as its own (or it does not answer)",
                field="signature",
            )

    async def _learn(self, peer: str, timeout_s: float) -> str | None:
        """The key `peer` names as its own, asked of it at most once a lease period."""
        key, asked_s = self.keys.get(peer, (None, float("-inf")))
        asking = self._hellos.get(peer)
        if asking is None and self.clock() - asked_s >= self.lease.period_s:
            asking = self._hellos[peer] = asyncio.ensure_future(self._key_of(peer, timeout_s))
            asking.add_done_callback(lambda _: self._hellos.pop(peer, None))
            self.keys[peer] = (key, self.clock())
        if asking is not None:  # one hello at a time per peer: every caller waits for it
            learned = await asyncio.shield(asking)
            key = learned or self.keys.get(peer, (None, 0.0))[0]  # a failed hello forgets none
            self.keys[peer] = (key, self.keys[peer][1])
        return key

    async def _key_of(self, peer: str, timeout_s: float) -> str | None:
        """The key `peer` names in its answer to our hello (None: no answer)."""
        try:
            response = await self.client.post(
                peer + HELLO_PATH, json=self.hello.model_dump(), timeout=timeout_s
            )
            if response.status_code != 200:
                return None
            return msg.TrackerHello.model_validate(response.json()).key
        except (httpx.HTTPError, ValueError):
            return None

    async def _ask(self, peer: str, ask: Ask) -> Grant | None:
        try:
            hello = self.hello
            statement = ask_statement(hello.url, ask.term, hello.trackers, hello.models)
            signature = self.registry.identity.sign(statement)
            body = msg.LeaseAsk(**hello.model_dump(), term=ask.term, signature=signature)
            response = await self.client.post(
                peer + LEASE_PATH, json=body.model_dump(), timeout=self.lease.period_s
            )
            if response.status_code != 200:
                self._refused(peer, response)
                return None
            answer = msg.LeaseAnswer.model_validate(response.json())
        except (httpx.HTTPError, ValueError):
            return None  # down, slow or garbled: no vote
        self.refused.pop(peer, None)
        return Grant(answer.granted, answer.term, answer.holder)

    def _refused(self, peer: str, response: httpx.Response) -> None:
        error = read_error(response.content)
        why = error.message if error is not None else f"HTTP {response.status_code}"
        if self.refused.get(peer) != why:
            log.error("tracker %s refused our lease ask: %s", peer, why)
            self.refused[peer] = why


def check_peers(
    hello: msg.TrackerHello, signer: Signer, verify: ssl.SSLContext | bool = True
) -> list[str]:
    """At start: refuse (`ConfigError`, naming both) to join peers that disagree with us or
    hold another swarm key; the peers that cannot be reached are returned (and logged)."""
    unreached = []
    with httpx.Client(timeout=3.0, auth=signer.auth(TRACKER), verify=verify) as client:
        for peer in (t for t in hello.trackers if t != hello.url):
            try:
                response = client.post(peer + HELLO_PATH, json=hello.model_dump())
            except httpx.HTTPError as exc:
                log.warning("tracker %s cannot be reached (%s); starting without it", peer, exc)
                unreached.append(peer)
                continue
            if response.status_code == 401:
                raise ConfigError(
                    f"tracker {peer} refused the swarm key of tracker {hello.url}: a mesh's "
                    "trackers must share one swarm key"
                )
            if response.status_code != 200:
                error = read_error(response.content)
                raise ConfigError(error.message if error else f"tracker {peer}: {response.text}")
            try:
                msg.TrackerHello.model_validate(response.json())
            except ValueError:
                log.warning("tracker %s answers garbage to a hello; starting without it", peer)
                unreached.append(peer)
    return unreached


def own_url(host: str, port: int, scheme: str, public_url: str | None) -> str:
    """How a tracker is listed among its peers: `public_url`, else scheme://host:port."""
    return (public_url or f"{scheme}://{host}:{port}").rstrip("/")

"""Whom a hop may push to: the members the tracker lists (review N6).

A pushed frame names the hops after it and the entry that takes the last output (ADR-0034).
Any member could sign such a route, so before it computes, a hop checks that the tracker
lists where its output goes: the next hop's node id, at that address, holding (or loading)
that span of the frame's model; or, for the last hop, the entry as a member at its address.
Otherwise a member could make a hop POST activations to any host:port it can reach (an
internal service, a tarpit).

The listing is the tracker's coverage map, fetched again when a check misses it (at most
once every `refresh_s`): a node that just joined is found on the next fetch.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import httpx

from meshnet.tracker import messages as msg
from meshnet.types import Hop, LayerSpan
from meshnet.wire.route import Reply

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Listing:
    """The members the tracker lists: their addresses, and what each holds or loads."""

    addresses: dict[str, str] = field(default_factory=dict)  # node id -> address
    spans: dict[tuple[str, str], frozenset[LayerSpan]] = field(default_factory=dict)

    @classmethod
    def of(cls, coverage: msg.CoverageResponse) -> Listing:
        spans: dict[tuple[str, str], set[LayerSpan]] = {}
        for node in coverage.nodes:
            for ref in [*node.loaded, *node.loading]:
                spans.setdefault((node.node_id, ref.model), set()).add(ref.span)
        return cls(
            {n.node_id: n.address for n in coverage.nodes},
            {k: frozenset(v) for k, v in spans.items()},
        )

    def unlisted(self, model: str, target: Hop | Reply) -> str | None:
        """Why the tracker does not list `target` (the next hop, holding its span of `model`,
        or the entry the last hop answers to); None when it does."""
        if self.addresses.get(target.node_id) != target.address:
            return f"{target.node_id} at {target.address} is no member the tracker lists"
        if isinstance(target, Hop) and target.span not in self.spans.get(
            (target.node_id, model), frozenset()
        ):
            return f"the tracker lists no layers {target.span} of {model} on {target.node_id}"
        return None


class Directory:
    """The tracker's listing, fetched with `fetch` when a check misses it."""

    def __init__(
        self,
        fetch: Callable[[], Awaitable[msg.CoverageResponse | None]],
        refresh_s: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.fetch = fetch
        self.refresh_s = refresh_s
        self.clock = clock
        self.listing = Listing()
        self.fetched_s = -refresh_s

    async def unlisted(self, model: str, target: Hop | Reply) -> str | None:
        missing = self.listing.unlisted(model, target)
        if missing is not None and self.clock() - self.fetched_s >= self.refresh_s:
            self.fetched_s = self.clock()
            coverage = await self.fetch()  # None: the tracker could not be asked
            self.listing = self.listing if coverage is None else Listing.of(coverage)
            missing = self.listing.unlisted(model, target)
        return missing


def tracker_directory(client: httpx.AsyncClient) -> Directory:
    """The listing of the tracker `client` calls (signed, ADR-0017)."""

    async def fetch() -> msg.CoverageResponse | None:
        try:
            answer = await client.get("/v1/coverage")
            answer.raise_for_status()
            return msg.CoverageResponse.model_validate(answer.json())
        except (httpx.HTTPError, ValueError) as exc:
            log.warning("could not read the tracker's members: %r", exc)
            return None

    return Directory(fetch)


def static_directory(listing: Listing) -> Directory:
    """A directory that always lists `listing` (tests; nodes whose peers are fixed)."""

    async def fetch() -> msg.CoverageResponse | None:
        return None  # never called: it counts as fetched for ever

    directory = Directory(fetch)
    directory.listing, directory.fetched_s = listing, float("inf")
    return directory

"""Where an entry node's frames go after its own span: the `RouteSource` seam.

`TrackerRoutes` asks a tracker over HTTP; `StaticRoutes` is the fake. (A tracker-as-node's
entry asks the registry in its own process: `assemble.tracker.RegistryRoutes`.)

Degraded mode (issue 50): `TrackerRoutes` keeps what it last saw of the mesh (`KnownRoutes`:
the tracker's coverage, fetched every `refresh_s` in the background, and every route it was
given). While the tracker is unreachable it routes among those members, failover included
(a dead one fails its hop and the session moves to another copy), says so (`degraded`, the
answers' `meshnet.degraded`, `meshnet_degraded_routes_total`) and goes back to the tracker's
routes as soon as one answers.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from typing import Protocol

import httpx
import pydantic

from meshnet.errors import MissingLayersError, RouteError, read_error
from meshnet.observe.metrics import Metrics
from meshnet.tracker import messages as msg
from meshnet.types import Hop, LayerSpan, ModelId, NodeId

log = logging.getLogger(__name__)


class RouteSource(Protocol):
    # the last route came from what this entry last saw, not from the tracker (unreachable)
    degraded: bool

    async def route(
        self,
        model: ModelId,
        start: int,
        end: int | None = None,
        exclude: frozenset[NodeId] = frozenset(),
    ) -> list[Hop]:
        """Hops covering layers `[start, end)` of `model` (default: to the last layer) on nodes
        not in `exclude`; raises `RouteError` (`MissingLayersError` naming uncovered layers)."""
        ...

    async def report(self, node: NodeId, reason: str) -> None:
        """Tell the tracker `node` failed a call (never raises)."""
        ...


def hops_of(response: msg.RouteResponse) -> list[Hop]:
    return [Hop(NodeId(h.node_id), h.address, h.span, h.quant) for h in response.hops]


class Member(Protocol):
    """Who asks: this node's id and membership token (the node agent's `Membership`)."""

    node_id: str
    token: str


class KnownRoutes:
    """The members an entry last saw serving each model: its routes in degraded mode."""

    def __init__(self) -> None:
        self.hops: dict[ModelId, dict[tuple[NodeId, LayerSpan], Hop]] = {}
        self.layers: dict[ModelId, int] = {}  # each model's layer count, where seen

    def learn_coverage(self, coverage: msg.CoverageResponse) -> None:
        """The tracker's whole picture: every loaded span of every member not suspect."""
        self.layers |= {ModelId(m.model): m.num_layers for m in coverage.models}
        known: dict[ModelId, dict[tuple[NodeId, LayerSpan], Hop]] = {}
        for node in coverage.nodes:
            for ref in [] if node.suspect else node.loaded:
                hop = Hop(NodeId(node.node_id), node.address, ref.span, node.quant)
                known.setdefault(ModelId(ref.model), {})[(hop.node_id, hop.span)] = hop
        self.hops = known

    def learn_route(self, model: ModelId, hops: Sequence[Hop], to_the_end: bool) -> None:
        """A route the tracker gave; `to_the_end`: it ends at the model's last layer."""
        for hop in hops:
            self.hops.setdefault(model, {})[(hop.node_id, hop.span)] = hop
        if hops and to_the_end:
            self.layers[model] = hops[-1].span.end

    async def route(
        self, model: ModelId, start: int, end: int | None, exclude: frozenset[NodeId]
    ) -> list[Hop]:
        """A chain of known members for `[start, end)` (end None: to the last layer)."""
        end = end or self.layers.get(model)
        if end is None:
            raise RouteError(f"no layer count of {model} was seen")
        hops = list(self.hops.get(model, {}).values())
        return await StaticRoutes(hops).route(model, start, end, exclude)


class TrackerRoutes:
    """Routes from a tracker's `GET /v1/route`; from the members it last saw while the
    tracker is unreachable (degraded mode)."""

    def __init__(
        self,
        client: httpx.AsyncClient,
        member: Member | None = None,
        *,
        metrics: Metrics | None = None,
        refresh_s: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.client = client  # base_url = the tracker
        self.member = member  # who reports failing hops (its token proves it)
        self.known = KnownRoutes()
        self.degraded = False
        self.metrics = metrics or Metrics()
        self.refresh_s = refresh_s  # how often the coverage behind degraded mode is fetched
        self.clock = clock
        self._refreshed_s = float("-inf")
        self._refreshing: asyncio.Future[None] | None = None

    async def route(
        self,
        model: ModelId,
        start: int,
        end: int | None = None,
        exclude: frozenset[NodeId] = frozenset(),
    ) -> list[Hop]:
        params: dict[str, str | int] = {"model": model, "start": start}
        if end is not None:
            params["end"] = end
        if exclude:
            params["exclude"] = ",".join(sorted(exclude))
        if self.member is not None:  # routes count each hop's round trip from us
            params["origin"] = self.member.node_id
        self._refresh_soon()
        try:
            response = await self.client.get("/v1/route", params=params)
        except httpx.HTTPError as exc:
            why = f"the tracker is unreachable: {exc!r}"
            return await self._from_known(model, start, end, exclude, why)
        if response.status_code != 200:
            raise _route_error(response)
        hops = hops_of(msg.RouteResponse.model_validate(response.json()))
        if self.degraded:
            log.info("the tracker answers again: its routes from now on")
        self.degraded = False
        self.known.learn_route(model, hops, to_the_end=end is None)
        return hops

    async def _from_known(
        self,
        model: ModelId,
        start: int,
        end: int | None,
        exclude: frozenset[NodeId],
        why: str,
    ) -> list[Hop]:
        """A route among the members last seen (degraded mode); RouteError naming `why`
        when they hold none."""
        try:
            hops = await self.known.route(model, start, end, exclude)
        except RouteError as exc:
            raise RouteError(f"{why}; the members last seen hold no route: {exc.message}") from exc
        if not self.degraded:
            log.warning("%s: routing among the members last seen (degraded)", why)
        self.degraded = True
        self.metrics.degraded_routes.inc()
        return hops

    def _refresh_soon(self) -> None:
        """Fetch the tracker's coverage in the background when it is older than
        `refresh_s` (one fetch at a time; a failure keeps what is known)."""
        now = self.clock()
        busy = self._refreshing is not None and not self._refreshing.done()
        if busy or now - self._refreshed_s < self.refresh_s:
            return
        self._refreshed_s = now
        self._refreshing = asyncio.ensure_future(self._refresh())

    async def _refresh(self) -> None:
        try:
            response = await self.client.get("/v1/coverage")
            if response.status_code == 200:
                self.known.learn_coverage(msg.CoverageResponse.model_validate(response.json()))
        except (httpx.HTTPError, ValueError, pydantic.ValidationError) as exc:
            log.debug("could not refresh the coverage: %r", exc)

    async def report(self, node: NodeId, reason: str) -> None:
        body = {"node_id": node, "reason": reason[:500]}
        if self.member is not None:
            body |= {"reporter": self.member.node_id, "token": self.member.token}
        try:
            await self.client.post("/v1/nodes/report", json=body)
        except httpx.HTTPError as exc:
            log.warning("could not report %s to the tracker: %r", node, exc)


def _route_error(response: httpx.Response) -> RouteError:
    error = read_error(response.content)
    if error is None:
        return RouteError(f"the tracker answered {response.status_code}: {response.text[:200]}")
    if error.type == "MissingLayersError":
        return MissingLayersError(error.message, missing=[])
    return RouteError(error.message)


class StaticRoutes:
    """The fake: a fixed set of hops (replicas allowed); the first fitting chain wins."""

    def __init__(self, hops: Sequence[Hop]) -> None:
        self.hops = list(hops)
        self.reported: list[NodeId] = []
        self.degraded = False

    async def route(
        self,
        model: ModelId,
        start: int,
        end: int | None = None,
        exclude: frozenset[NodeId] = frozenset(),
    ) -> list[Hop]:
        chain, position = [], start
        while end is None or position < end:
            fits = [h for h in self.hops if h.span.start == position and h.node_id not in exclude]
            if not fits:
                break
            chain.append(fits[0])
            position = fits[0].span.end
        if end is not None and position < end or not chain:
            raise MissingLayersError(f"no node serves layers {position}:{end}", missing=[])
        return chain

    async def report(self, node: NodeId, reason: str) -> None:
        self.reported.append(node)

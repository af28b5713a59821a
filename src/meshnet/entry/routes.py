"""Where an entry node's frames go after its own span: the `RouteSource` seam.

`TrackerRoutes` asks a tracker over HTTP; `StaticRoutes` is the fake. (A tracker-as-node's
entry asks the registry in its own process: `assemble.tracker.RegistryRoutes`.)
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Protocol

import httpx

from meshnet.errors import MissingLayersError, RouteError, read_error
from meshnet.tracker import messages as msg
from meshnet.types import Hop, ModelId, NodeId

log = logging.getLogger(__name__)


class RouteSource(Protocol):
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


class TrackerRoutes:
    """Routes from a tracker's `GET /v1/route`."""

    def __init__(self, client: httpx.AsyncClient, member: Member | None = None) -> None:
        self.client = client  # base_url = the tracker
        self.member = member  # who reports failing hops (its token proves it)

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
        try:
            response = await self.client.get("/v1/route", params=params)
        except httpx.HTTPError as exc:
            raise RouteError(f"the tracker is unreachable: {exc!r}") from exc
        if response.status_code != 200:
            raise _route_error(response)
        return hops_of(msg.RouteResponse.model_validate(response.json()))

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

"""Where an entry node's frames go after its own span: the `RouteSource` seam.

`TrackerRoutes` asks a tracker over HTTP; `RegistryRoutes` asks the registry in this process
(tracker-as-node); `StaticRoutes` is the fake.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Protocol

import httpx

from meshnet.client.transport import Hop
from meshnet.errors import MissingLayersError, RouteError
from meshnet.tracker import messages as msg
from meshnet.tracker import views
from meshnet.tracker.registry import Registry
from meshnet.types import ModelId, NodeId


class RouteSource(Protocol):
    async def route(self, model: ModelId, start: int) -> list[Hop]:
        """Hops covering layers `[start, num_layers)` of `model`; raises `RouteError`."""
        ...


def hops_of(response: msg.RouteResponse) -> list[Hop]:
    return [Hop(NodeId(h.node_id), h.address, h.span) for h in response.hops]


class TrackerRoutes:
    """Routes from a tracker's `GET /v1/route`."""

    def __init__(self, client: httpx.AsyncClient) -> None:
        self.client = client  # base_url = the tracker

    async def route(self, model: ModelId, start: int) -> list[Hop]:
        try:
            response = await self.client.get("/v1/route", params={"model": model, "start": start})
        except httpx.HTTPError as exc:
            raise RouteError(f"the tracker is unreachable: {exc!r}") from exc
        if response.status_code != 200:
            raise _route_error(response)
        return hops_of(msg.RouteResponse.model_validate(response.json()))


def _route_error(response: httpx.Response) -> RouteError:
    try:
        error = response.json()["error"]
        message = str(error["message"])
    except (ValueError, KeyError, TypeError):
        return RouteError(f"the tracker answered {response.status_code}: {response.text[:200]}")
    if error.get("type") == "MissingLayersError":
        return MissingLayersError(message, missing=[])
    return RouteError(message)


class RegistryRoutes:
    """Routes from the registry of the tracker this entry node runs inside."""

    def __init__(self, registry: Registry, rng: random.Random) -> None:
        self.registry = registry
        self.rng = rng

    async def route(self, model: ModelId, start: int) -> list[Hop]:
        self.registry.expire()
        return hops_of(views.route(self.registry, model, start, self.rng))


class StaticRoutes:
    """The fake: always the same hops."""

    def __init__(self, hops: Sequence[Hop]) -> None:
        self.hops = list(hops)

    async def route(self, model: ModelId, start: int) -> list[Hop]:
        return [h for h in self.hops if h.span.start >= start]

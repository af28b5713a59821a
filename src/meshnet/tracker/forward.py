"""The tracker's door for clients: OpenAI requests forwarded to a live entry of their model.

A tracker that runs no model itself still answers `POST /v1/chat/completions` and
`/v1/completions`: it reads the body's `model`, picks a live entry (`views.entries`), and
relays the entry's answer as it comes (SSE streams included). An entry that cannot be
reached, or answers 5xx, before the first byte is reported and the next entry is tried. A
stream that breaks mid-way ends with an error event, not a hang.

The tracker's own guard checked the client's API key; the entry gets a member-signed call
that names the client (`X-Meshnet-Client`, for its per-client limits and prefix scope) and
never the key itself (review N4: a member that registered as an entry collected clients'
Bearer keys), with the tracker's vouch for that client, entry and body (`security/vouch.py`:
a member naming the client is not believed: review P1).
Entries are taken in the order of the calls this tracker has in flight to each, ties at
random: what the tracker measured, not what an entry says of its own load (N4: a member
reporting 0 sessions got every call).
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import random
from collections.abc import AsyncIterator, Callable

import httpx
from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from meshnet.errors import RequestError, RouteError
from meshnet.security.access import client_of
from meshnet.security.signing import Signer
from meshnet.security.vouch import VOUCH_HEADER
from meshnet.tracker import messages as msg
from meshnet.tracker import views
from meshnet.tracker.registry import Registry
from meshnet.types import ModelId, NodeId

log = logging.getLogger(__name__)
PASSED_HEADERS = ("content-type", "accept")  # what a client's call keeps: never its key
CLIENT_HEADER = "X-Meshnet-Client"  # who the tracker let in, for the entry's limits
MAX_TRIES = 3  # entries tried before the client gets the last error


class NoEntryError(RouteError):
    """An offered model that no live entry serves now (503)."""


class EntryForwarder:
    """Forwards client calls to entries; `client` makes the outbound calls (a seam)."""

    def __init__(
        self,
        registry: Registry,
        client: httpx.AsyncClient,
        exclude: frozenset[str] = frozenset(),
        signer: Signer | None = None,
        rng: random.Random | None = None,
    ) -> None:
        self.registry = registry
        self.client = client
        self.exclude = exclude  # a tracker-as-node's own id: never forward to itself
        self.signer = signer or Signer(None)  # its calls to entries are member calls
        self.rng = rng or random.Random()
        self.in_flight: dict[str, int] = {}  # calls forwarded and not yet answered, by entry

    async def forward(self, request: Request) -> Response:
        body = await request.body()
        model = model_of(body)
        self.registry.expire()
        listed = [  # 404 for a model not offered
            e for e in views.entries(self.registry, model).entries if e.node_id not in self.exclude
        ]
        if not listed:
            raise NoEntryError(self._why_none(model), field="model")
        listed = self._planned_first(listed, model)
        passed = {k: v for k, v in request.headers.items() if k.lower() in PASSED_HEADERS}
        client, digest = client_of(request.scope), hashlib.sha256(body).hexdigest()
        passed[CLIENT_HEADER] = client
        error: Exception | None = None
        for entry in self._order(listed)[:MAX_TRIES]:
            path = request.url.path
            vouch = self.registry.identity.vouch(client, entry.node_id, digest)
            headers = passed | {VOUCH_HEADER: vouch}  # only a tracker can (review P1)
            signed = headers | self.signer.headers(
                "POST", path, body, to=entry.node_id, headers=headers
            )
            call = self.client.build_request(
                "POST", entry.address + path, content=body, headers=signed
            )
            self._count(entry.node_id, 1)
            try:
                answer = await self.client.send(call, stream=True)
            except httpx.TransportError as exc:
                self._count(entry.node_id, -1)
                error = exc
                self.registry.report(NodeId(entry.node_id), f"forwarding failed: {exc}")
                continue
            if answer.status_code >= 500:
                self._count(entry.node_id, -1)
                error = RouteError(f"entry {entry.node_id} answered {answer.status_code}")
                await answer.aclose()
                continue
            return _relay(answer, functools.partial(self._count, entry.node_id, -1))
        raise RouteError(f"no entry of {model} took the request (last: {error})", field="model")

    def _planned_first(self, listed: list[msg.EntryInfo], model: str) -> list[msg.EntryInfo]:
        """The entries whose span the planner gave them and saw loaded, when there are any:
        a member that registered claiming an entry span gets no client's prompt while one
        is up (review N4); the others only when none is (after a tracker restart every span
        is a claim until re-planned)."""
        with self.registry.lock:
            planned = [
                e
                for e in listed
                if (record := self.registry.nodes.get(NodeId(e.node_id))) is not None
                and (ModelId(model), e.span) in record.earned
            ]
        return planned or listed

    def _order(self, listed: list[msg.EntryInfo]) -> list[msg.EntryInfo]:
        """The entries with the fewest calls this tracker has in flight to them first."""
        keyed = [(self.in_flight.get(e.node_id, 0), self.rng.random(), e) for e in listed]
        return [e for *_, e in sorted(keyed, key=lambda k: (k[0], k[1]))]

    def _count(self, entry: str, change: int) -> None:
        left = self.in_flight.get(entry, 0) + change
        if left > 0:
            self.in_flight[entry] = left
        else:
            self.in_flight.pop(entry, None)

    def _why_none(self, model: str) -> str:
        """503 text: a gap in the model's layers, or no entry running its head."""
        coverage = views.coverage(self.registry)
        found = next(m for m in coverage.models if m.model == model)
        if found.gaps:
            missing = ", ".join(str(g) for g in found.gaps)
            return f"model {model} has no live entry: no node serves layers {missing}"
        return f"model {model} has no live entry: no node that runs its head is up"


def model_of(body: bytes) -> str:
    """The `model` a client request names; 400 when the body is not a JSON object with one."""
    try:
        parsed = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise RequestError(f"the body is not JSON: {exc}", field="body") from exc
    model = parsed.get("model") if isinstance(parsed, dict) else None
    if not isinstance(model, str) or not model:
        raise RequestError("the request names no model", field="model")
    return model


def _relay(answer: httpx.Response, done: Callable[[], None]) -> StreamingResponse:
    """The entry's answer as it comes; `done` once it is over."""
    kind = answer.headers.get("content-type", "application/json")

    async def close() -> None:
        done()
        await answer.aclose()

    return StreamingResponse(
        _chunks(answer, kind.startswith("text/event-stream")),
        status_code=answer.status_code,
        media_type=kind,
        background=BackgroundTask(close),
    )


async def _chunks(answer: httpx.Response, events: bool) -> AsyncIterator[bytes]:
    """The entry's bytes as they come; an SSE stream that breaks ends with an error event."""
    try:
        async for chunk in answer.aiter_bytes():  # decoded: Content-Encoding is not passed on
            yield chunk
    except httpx.HTTPError as exc:
        log.warning("the entry's answer broke off: %s", exc)
        if events:
            error = {"error": {"message": f"the entry broke off: {exc}", "type": "HopError"}}
            yield f"data: {json.dumps(error)}\n\n".encode()


def ready_models(registry: Registry) -> list[str]:
    """The offered models with a chain and a live entry: what clients can be answered for."""
    coverage = views.coverage(registry)
    return [
        m.model for m in coverage.models if m.routable and views.entries(registry, m.model).entries
    ]


def listed_models(registry: Registry) -> dict[str, object]:
    """`GET /v1/models` of a tracker that runs no model (`ready_models`)."""
    ready = ready_models(registry)
    data = [{"id": m, "object": "model", "created": 0, "owned_by": "meshnet"} for m in ready]
    return {"object": "list", "data": data}

"""The tracker's door for clients: OpenAI requests forwarded to a live entry of their model.

A tracker that runs no model itself still answers `POST /v1/chat/completions` and
`/v1/completions`: it reads the body's `model`, picks the least loaded live entry
(`views.entries`), and relays the entry's answer as it comes (SSE streams included). An
entry that cannot be reached, or answers 5xx, before the first byte is reported and the next
entry is tried. A stream that breaks mid-way ends with an error event, not a hang.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator

import httpx
from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from meshnet.errors import RequestError, RouteError
from meshnet.tracker import views
from meshnet.tracker.registry import Registry
from meshnet.types import NodeId

log = logging.getLogger(__name__)
PASSED_HEADERS = ("authorization", "content-type", "accept")  # what a client's call keeps
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
    ) -> None:
        self.registry = registry
        self.client = client
        self.exclude = exclude  # a tracker-as-node's own id: never forward to itself

    async def forward(self, request: Request) -> Response:
        body = await request.body()
        model = model_of(body)
        self.registry.expire()
        listed = [  # 404 for a model not offered
            e for e in views.entries(self.registry, model).entries if e.node_id not in self.exclude
        ]
        if not listed:
            raise NoEntryError(self._why_none(model), field="model")
        headers = {k: v for k, v in request.headers.items() if k.lower() in PASSED_HEADERS}
        error: Exception | None = None
        for entry in listed[:MAX_TRIES]:
            call = self.client.build_request(
                "POST", entry.address + request.url.path, content=body, headers=headers
            )
            try:
                answer = await self.client.send(call, stream=True)
            except httpx.TransportError as exc:
                error = exc
                self.registry.report(NodeId(entry.node_id), f"forwarding failed: {exc}")
                continue
            if answer.status_code >= 500:
                error = RouteError(f"entry {entry.node_id} answered {answer.status_code}")
                await answer.aclose()
                continue
            return _relay(answer)
        raise RouteError(f"no entry of {model} took the request (last: {error})", field="model")

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


def _relay(answer: httpx.Response) -> StreamingResponse:
    kind = answer.headers.get("content-type", "application/json")
    return StreamingResponse(
        _chunks(answer, kind.startswith("text/event-stream")),
        status_code=answer.status_code,
        media_type=kind,
        background=BackgroundTask(answer.aclose),
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

"""One place where errors become HTTP responses, shared by every meshnet app.

Imports Starlette only (no torch), so the tracker can use it too.
"""

from __future__ import annotations

import logging

from fastapi.exceptions import RequestValidationError
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from meshnet.errors import MeshError
from meshnet.wire.headers import VERSION, WIRE_VERSION

log = logging.getLogger(__name__)


def error_response(exc: MeshError) -> JSONResponse:
    """The JSON error body with the status the error class declares."""
    return JSONResponse(exc.to_json(), status_code=exc.http_status)


async def _mesh_error(_: Request, exc: Exception) -> Response:
    assert isinstance(exc, MeshError)  # registered for MeshError only
    log.info("refused request: %s (%s)", exc.message, type(exc).__name__)
    return error_response(exc)


async def _validation_error(_: Request, exc: Exception) -> Response:
    assert isinstance(exc, RequestValidationError)
    details = [
        {
            "loc": [str(p) for p in e.get("loc", ())],
            "msg": str(e.get("msg", "")),
            "type": str(e.get("type", "")),
        }
        for e in exc.errors()
    ]
    first = details[0] if details else {"loc": [], "msg": "invalid request"}
    field = ".".join(p for p in first["loc"] if p != "body") or None
    body = {
        "error": {
            "type": "ValidationError",
            "message": f"{field}: {first['msg']}",
            "field": field,
            "details": details,
        }
    }
    return JSONResponse(body, status_code=400)


def install_error_handlers(app: Starlette) -> None:
    """Map `MeshError` and request validation failures to JSON 4xx/5xx answers."""
    app.add_exception_handler(MeshError, _mesh_error)
    app.add_exception_handler(RequestValidationError, _validation_error)


class WireVersionHeader:
    """ASGI middleware: every response carries `X-Meshnet-Wire-Version`."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self.header = (VERSION.lower().encode(), WIRE_VERSION.encode())

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_with_version(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = list(message.get("headers", []))
                if all(name.lower() != self.header[0] for name, _ in headers):
                    headers.append(self.header)
                message["headers"] = headers
            await send(message)

        await self.app(scope, receive, send_with_version)

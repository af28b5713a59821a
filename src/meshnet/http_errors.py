"""One place where errors become HTTP responses, shared by every meshnet app.

Imports Starlette only (no torch), so the tracker can use it too.
"""

from __future__ import annotations

import logging
import re

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from meshnet.errors import MeshError
from meshnet.wire.headers import VERSION, WIRE_VERSION

log = logging.getLogger(__name__)
# pydantic names the member of a union in an error's location: `stop.list[str]`, `prompt.str`
_TYPE_TAG = re.compile(r"^(str|int|float|bool|none|[a-z-]+\[.*\])$")


def error_response(exc: MeshError) -> JSONResponse:
    """The JSON error body with the status the error class declares."""
    return JSONResponse(exc.to_json(), status_code=exc.http_status, headers=exc.headers())


async def _mesh_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, MeshError)  # registered for MeshError only
    log.info("refused request: %s (%s)", exc.message, type(exc).__name__)
    metrics = getattr(request.app.state, "metrics", None)  # observe.metrics.Metrics
    if metrics is not None:
        metrics.errors.labels(type(exc).__name__).inc()
    return error_response(exc)


async def _validation_error(_: Request, exc: Exception) -> Response:
    from fastapi.exceptions import RequestValidationError

    assert isinstance(exc, RequestValidationError)  # registered for it only
    details = [
        {
            "loc": [str(p) for p in e.get("loc", ())],
            "msg": str(e.get("msg", "")),
            "type": str(e.get("type", "")),
        }
        for e in exc.errors()
    ]
    # a union field fails once per member: prefer a real constraint over "wrong type"
    ranked = sorted(details, key=lambda d: str(d["type"]).endswith("_type"))
    first = ranked[0] if ranked else {"loc": [], "msg": "invalid request"}
    field = ".".join(p for p in first["loc"] if p != "body" and not _TYPE_TAG.match(p)) or None
    body = {
        "error": {
            "message": f"{field}: {first['msg']}",
            "type": "ValidationError",
            "param": field,
            "code": None,
            "field": field,
            "details": details,
        }
    }
    return JSONResponse(body, status_code=400)


async def _http_error(_: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)  # unknown paths (404), wrong methods (405)
    body = {
        "error": {
            "message": str(exc.detail),
            "type": "HTTPError",
            "param": None,
            "code": None,
            "field": None,
        }
    }
    return JSONResponse(body, status_code=exc.status_code, headers=exc.headers)


async def _unexpected(_: Request, exc: Exception) -> Response:
    """Anything no handler knows: a JSON 500 that names the kind, never a text traceback
    (the server logs the traceback itself)."""
    body = {
        "error": {
            "message": f"internal error ({type(exc).__name__}); see the server's log",
            "type": "InternalError",
            "param": None,
            "code": None,
            "field": None,
        }
    }
    return JSONResponse(body, status_code=500)


def install_error_handlers(app: Starlette) -> None:
    """Map `MeshError`, validation failures and HTTP errors to JSON 4xx/5xx answers.

    Only FastAPI apps validate requests, and only they import FastAPI: a plain node's app
    is Starlette's, and a process that imports no FastAPI holds ~10 MiB less (ADR-0041)."""
    app.add_exception_handler(MeshError, _mesh_error)
    if type(app).__module__.startswith("fastapi"):
        from fastapi.exceptions import RequestValidationError

        app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(HTTPException, _http_error)
    app.add_exception_handler(Exception, _unexpected)  # Starlette's server-error middleware


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

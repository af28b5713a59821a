"""Every app answers in JSON, also for an error nobody foresaw (review finding 3: a wrong
hidden width from the last hop ended in a text/plain 500)."""

from __future__ import annotations

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.testclient import TestClient

from meshnet.http_errors import install_error_handlers


async def broken(request: Request) -> Response:
    raise RuntimeError("shape mismatch deep in a kernel")


def test_an_unforeseen_error_is_a_json_500_that_leaks_no_detail() -> None:
    app = Starlette()
    install_error_handlers(app)
    app.add_route("/x", broken)
    response = TestClient(app, raise_server_exceptions=False).get("/x")
    assert response.status_code == 500
    assert response.headers["content-type"] == "application/json"
    error = response.json()["error"]
    assert error["type"] == "InternalError" and "RuntimeError" in error["message"]
    assert "kernel" not in error["message"]  # the detail stays in the server's log


def test_an_error_body_reads_back_as_it_was_written_and_anything_else_is_none() -> None:
    from meshnet.errors import MissingLayersError, read_error

    body = JSONResponse(MissingLayersError("no node serves 3:4", missing=[]).to_json()).body
    error = read_error(bytes(body))
    assert error is not None and (error.message, error.type) == (
        "no node serves 3:4",
        "MissingLayersError",
    )
    for junk in (b"", b"<html>", b'{"error": "x"}', b'{"error": {"type": "X"}}', b"[1]"):
        assert read_error(junk) is None, junk

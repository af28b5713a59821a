"""A test client that carries each node's membership token, as its node would."""

from __future__ import annotations

from typing import Any

import httpx
from starlette.testclient import TestClient


class Members:
    """Wraps a `TestClient` of a tracker: heartbeats and leaves carry the node's token,
    reports the token of a registered node (the reporter), as real nodes send them."""

    def __init__(self, client: TestClient) -> None:
        self.client = client
        self.tokens: dict[str, str] = {}

    def post(self, path: str, json: dict[str, Any] | None = None, **kw: Any) -> httpx.Response:
        body = dict(json or {})
        if path.endswith(("/heartbeat", "/leave")):
            body.setdefault("token", self.tokens.get(str(body.get("node_id")), ""))
        if path.endswith("/report") and self.tokens:
            reporter = next(iter(self.tokens))
            body.setdefault("reporter", reporter)
            body.setdefault("token", self.tokens[reporter])
        response = self.client.post(path, json=body, **kw)
        if path.endswith("/register") and response.status_code == 200:
            self.tokens[str(body["node_id"])] = response.json()["token"]
        return response

    def __getattr__(self, name: str) -> Any:
        return getattr(self.client, name)

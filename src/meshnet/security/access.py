"""The access guard: one ASGI middleware in front of every meshnet app.

For each request it finds the path's rule, refuses a body over the rule's limit (413) before
buffering it, then checks the credentials the rule asks for (401), and only then passes the
request on, with the caller's identity in `scope["meshnet.client"]`. Refusals are JSON errors
in the usual shape and change nothing.

Credentials: `swarm` (a swarm-key proof, ADR-0017) or `client` (an API key as a bearer token,
or, when no key is configured, a loopback caller). Paths no rule names need `swarm`.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from meshnet.config import AccessConfig
from meshnet.errors import AuthError, MeshError, PayloadTooLargeError
from meshnet.http_errors import error_response
from meshnet.security.swarm import HEADER, SwarmKey, Verifier

CLIENT_KEY = "meshnet.client"  # scope key: "swarm", "key:<fingerprint>" or "ip:<address>"
KiB = 1 << 10


@dataclass(frozen=True)
class Rule:
    """Paths equal to `prefix` or under `prefix/`: who may call them and the body limit."""

    prefix: str
    needs: frozenset[str]  # any one suffices; empty = open to all
    max_body_bytes: int


def rule(prefix: str, *needs: str, max_body_bytes: int = 64 * KiB) -> Rule:
    return Rule(prefix, frozenset(needs), max_body_bytes)


OPEN_RULES = (
    rule("/health"),
    rule("/openapi.json"),
    rule("/docs"),
    rule("/redoc"),
)
DEFAULT_RULE = rule("", "swarm")


def match(rules: Sequence[Rule], path: str) -> Rule:
    """The longest rule prefix that `path` equals or lies under."""
    found = [r for r in rules if path == r.prefix or path.startswith(r.prefix + "/")]
    return max(found, key=lambda r: len(r.prefix), default=DEFAULT_RULE)


def is_loopback(host: str | None) -> bool:
    try:
        return host is not None and ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def key_tag(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()[:12]


class Credentials:
    """Checks one request's credentials against the process's `AccessConfig`."""

    def __init__(self, access: AccessConfig, clock: Callable[[], float] = time.time) -> None:
        self.access = access
        key = SwarmKey.from_text(access.swarm_key) if access.swarm_key else None
        self.verifier = Verifier(key, clock, access.max_clock_skew_s) if key else None
        self.api_keys = {hashlib.sha256(k.encode()).digest(): key_tag(k) for k in access.api_keys}

    def admit(
        self, needs: frozenset[str], scope: Scope, headers: dict[str, str], body: bytes
    ) -> str:
        """The caller's identity, or `AuthError`."""
        if not needs:
            return f"ip:{_client_host(scope)}"
        unchecked = self.verifier is None  # no swarm key configured: member calls go unchecked
        if "swarm" in needs and ("client" not in needs or unchecked or HEADER.lower() in headers):
            return self._swarm(scope, headers, body)
        return self._client(scope, headers)

    def _swarm(self, scope: Scope, headers: dict[str, str], body: bytes) -> str:
        if self.verifier is not None:
            target = scope.get("raw_path") or scope["path"].encode()
            if scope.get("query_string"):
                target += b"?" + scope["query_string"]
            self.verifier.verify(scope["method"], target, body, headers.get(HEADER.lower()))
        return "swarm"

    def _client(self, scope: Scope, headers: dict[str, str]) -> str:
        scheme, _, token = headers.get("authorization", "").partition(" ")
        if self.api_keys:
            digest = hashlib.sha256(token.strip().encode()).digest()
            for known, name in self.api_keys.items():
                if scheme.lower() == "bearer" and hmac.compare_digest(known, digest):
                    return f"key:{name}"
            raise AuthError(
                "a valid API key is required: send 'Authorization: Bearer <key>'",
                field="Authorization",
            )
        host = _client_host(scope)
        if self.access.allow_unauthenticated or is_loopback(host):
            return f"ip:{host}"
        raise AuthError(
            "this API has no keys configured and answers loopback clients only; start it with "
            "--api-key (or --allow-unauthenticated)",
            field="Authorization",
        )


def _client_host(scope: Scope) -> str | None:
    client = scope.get("client")
    return str(client[0]) if client else None


class Guard:
    """ASGI middleware: body limit, then credentials, for every HTTP request."""

    def __init__(self, app: ASGIApp, rules: Sequence[Rule], credentials: Credentials) -> None:
        self.app = app
        self.rules = list(OPEN_RULES) + list(rules)
        self.credentials = credentials

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        found = match(self.rules, scope["path"])
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        try:
            body = await read_limited(headers, receive, found.max_body_bytes)
            client = self.credentials.admit(found.needs, scope, headers, body)
        except MeshError as exc:
            await error_response(exc)(scope, receive, send)
            return
        await self.app({**scope, CLIENT_KEY: client}, replay_body(body, receive), send)


async def read_limited(headers: dict[str, str], receive: Receive, max_bytes: int) -> bytes:
    """The whole request body; `PayloadTooLargeError` (413) before buffering past the limit."""
    declared = headers.get("content-length", "")
    if declared.isdigit() and len(declared) < 20 and int(declared) > max_bytes:
        raise PayloadTooLargeError(
            f"body of {declared} bytes exceeds this endpoint's limit of {max_bytes}", field="body"
        )
    parts, size, more = [], 0, True
    while more:
        message = await receive()
        if message["type"] != "http.request":
            break  # the client went away
        parts.append(message.get("body", b""))
        size += len(parts[-1])
        if size > max_bytes:
            raise PayloadTooLargeError(
                f"body exceeds this endpoint's limit of {max_bytes} bytes", field="body"
            )
        more = message.get("more_body", False)
    return b"".join(parts)


def replay_body(body: bytes, receive: Receive) -> Receive:
    """A `receive` that yields the buffered body once, then defers to the real one."""
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


def client_of(scope: Scope) -> str:
    """The identity the guard admitted the request as (`ip:?` outside a guard)."""
    return str(scope.get(CLIENT_KEY, "ip:?"))

"""The access guard: one ASGI middleware in front of every meshnet app.

For each request it finds the path's rule and checks what the headers alone can show before
a byte of the body is read: an API key, loopback, or a swarm proof's form, receiver and
timestamp (401). It then reads the body under its limit (413), a deadline (408) and the
process's in-flight budget (503), hashing it as it streams, checks the proof's MAC over that
digest and the `X-Meshnet-*` headers (401), and only then passes the request on, with the
caller's identity in `scope["meshnet.client"]`. The answer to a member's call is signed
(`X-Meshnet-Answer`). Refusals are JSON errors in the usual shape and change nothing.

Credentials: `swarm` (a swarm-key proof, ADR-0017) or `client` (an API key as a bearer token,
or, when no key is configured, a loopback caller). Paths no rule names need `swarm`.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from meshnet.config import AccessConfig
from meshnet.errors import AuthError, MeshError
from meshnet.http_errors import error_response
from meshnet.security.body import BodyLimits, InFlight, read_body
from meshnet.security.swarm import ANSWER_HEADER, HEADER, Proof, SwarmKey, Verifier, answer_mac
from meshnet.security.throttle import RefusalThrottle
from meshnet.security.vouch import VOUCH_HEADER, TrackerKeys, client_statement

CLIENT_KEY = "meshnet.client"  # scope key: "swarm", "key:<fingerprint>" or "ip:<address>"
KiB = 1 << 10
DEFAULT_BODY_LIMITS = BodyLimits()


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
    """The longest rule prefix that `path` equals or lies under (`/` only itself: `//x` and
    paths with `..` segments fall to the default rule, review finding 11)."""
    if "/../" in path + "/" or "//" in path:
        return DEFAULT_RULE
    found = [r for r in rules if path == r.prefix or _under(path, r.prefix)]
    return max(found, key=lambda r: len(r.prefix), default=DEFAULT_RULE)


def _under(path: str, prefix: str) -> bool:
    return prefix not in ("", "/") and path.startswith(prefix + "/")


def is_loopback(host: str | None) -> bool:
    try:
        return host is not None and ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


LOCAL_NAMES = ("localhost", "127.0.0.1", "::1")


def check_local_host(header: str) -> None:
    """A keyless API trusts loopback callers only when they name this machine: a page a
    browser loaded from elsewhere, rebinding its DNS name to 127.0.0.1, still sends its own
    name as Host (review finding 5)."""
    name = header.lower()
    if name.startswith("["):  # [v6]:port
        name = name[1:].split("]")[0]
    elif name.count(":") == 1:  # host:port
        name = name.split(":")[0]
    if name not in LOCAL_NAMES and not name.startswith("127."):
        raise AuthError(
            f"a loopback client without an API key must address this machine as localhost, "
            f"not {header[:100]!r} (or start the server with --api-key)",
            field="Host",
        )


def key_tag(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()[:12]


class Settled:
    """An identity the headers settled (an API key, loopback, an open path)."""

    def __init__(self, identity: str) -> None:
        self.identity = identity

    def confirm(self, sha256: str) -> str:
        return self.identity

    def answers(self, send: Send) -> Send:
        return send


@dataclass(frozen=True)
class SwarmProof:
    """A swarm proof whose header checked out; its MAC waits for the body's digest."""

    verifier: Verifier
    method: str
    target: bytes
    headers: list[tuple[str, str]]
    proof: Proof

    def confirm(self, sha256: str) -> str:
        self.verifier.verify_digest(self.method, self.target, sha256, self.proof, self.headers)
        return "swarm"

    def answers(self, send: Send) -> Send:
        """`send`, signing the answer for the member that asked (streams go unsigned)."""
        return signed_answers(self.verifier.key, self.proof.nonce, send)


SEND_CHUNK_BYTES = 256 * KiB  # a signed answer's body goes out in pieces of this size


def signed_answers(key: SwarmKey, nonce: str, send: Send) -> Send:
    """A `send` that holds an answer's start and body until the body is complete, then sends
    both with `X-Meshnet-Answer` (an SSE stream passes through unsigned, as it comes)."""
    start: Message | None = None
    parts: list[bytes] = []

    async def signing(message: Message) -> None:
        nonlocal start
        if message["type"] == "http.response.start":
            if b"text/event-stream" in dict(message.get("headers", [])).get(b"content-type", b""):
                await send(message)
                return
            start = message
            return
        if start is None or message["type"] != "http.response.body":
            await send(message)
            return
        parts.append(message.get("body", b""))
        if not message.get("more_body", False):
            await _send_signed(key, nonce, start, b"".join(parts), send)

    return signing


async def _send_signed(key: SwarmKey, nonce: str, start: Message, body: bytes, send: Send) -> None:
    raw = list(start.get("headers", []))
    items = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in raw]
    sha256 = hashlib.sha256(body).hexdigest()
    mac = answer_mac(key, nonce, start["status"], items, sha256)
    headers = [*raw, (ANSWER_HEADER.lower().encode(), f"v2 s={mac}".encode())]
    await send({**start, "headers": headers})
    # in pieces: each waits until the asker has taken the last (a 16 MiB weights range is
    # not left whole in the socket's buffer of an asker that reads nothing: review W3)
    view = memoryview(body)
    for at in range(0, max(len(body), 1), SEND_CHUNK_BYTES):
        last = at + SEND_CHUNK_BYTES >= len(body)
        piece = bytes(view[at : at + SEND_CHUNK_BYTES])
        await send({"type": "http.response.body", "body": piece, "more_body": not last})


Admission = Settled | SwarmProof


class Credentials:
    """Checks one request's credentials against the process's `AccessConfig`."""

    def __init__(
        self,
        access: AccessConfig,
        names: frozenset[str] = frozenset(),
        clock: Callable[[], float] = time.time,
        trackers: TrackerKeys | None = None,
    ) -> None:
        """`names`: who this process is to members (its node id, `tracker`): a proof must be
        addressed to one of them. `trackers`: the keys of the trackers whose vouch makes a
        member's call a forwarded client's (none: no call is)."""
        self.access = access
        self.names = names
        self.trackers = trackers
        key = SwarmKey.from_text(access.swarm_key) if access.swarm_key else None
        self.verifier = Verifier(key, clock, names, access.max_clock_skew_s) if key else None
        self.api_keys = {hashlib.sha256(k.encode()).digest(): key_tag(k) for k in access.api_keys}

    def admit(self, needs: frozenset[str], scope: Scope, headers: dict[str, str]) -> Admission:
        """What the headers settle before the body is read: the caller's identity, to be
        confirmed against the body's digest (a swarm proof's MAC), or `AuthError` at once."""
        if not needs:
            return Settled(f"ip:{_client_host(scope)}")
        unchecked = self.verifier is None  # no swarm key configured: member calls go unchecked
        # where either will do, a bearer key makes it a client's call, a proof a member's
        proof = HEADER.lower() in headers and "authorization" not in headers
        if "swarm" in needs and ("client" not in needs or unchecked or proof):
            return self._swarm(scope, headers)
        return Settled(self._client(scope, headers))

    def forwarded(self, headers: dict[str, str], body_sha256: str) -> str:
        """Whom a member's call on a client route is for: the client in `X-Meshnet-Client`
        when a known tracker vouches for it, this entry and this body (review P1); else the
        member itself (`swarm`), whatever client it names."""
        named = forwarded_client(headers)
        if named is None or self.trackers is None:
            return "swarm"
        value = headers["x-meshnet-client"].strip()
        vouch = headers.get(VOUCH_HEADER.lower())
        for to in self.names:
            if self.trackers.vouched(vouch, client_statement(value, to, body_sha256)):
                return named
        return "swarm"

    def _swarm(self, scope: Scope, headers: dict[str, str]) -> Admission:
        if self.verifier is None:
            return Settled("swarm")
        proof = self.verifier.check(headers.get(HEADER.lower()))  # refused before any body
        target = scope.get("raw_path") or scope["path"].encode()
        if scope.get("query_string"):
            target += b"?" + scope["query_string"]
        raw = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in scope["headers"]]
        return SwarmProof(self.verifier, scope["method"], target, raw, proof)

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
        if self.access.allow_unauthenticated:
            return f"ip:{host}"
        if is_loopback(host):
            check_local_host(headers.get("host", ""))
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
    """ASGI middleware: what the headers can refuse, then the body (limits, deadline,
    in-flight budget), then the proof over it, for every HTTP request."""

    def __init__(
        self,
        app: ASGIApp,
        rules: Sequence[Rule],
        credentials: Credentials,
        limits: BodyLimits = DEFAULT_BODY_LIMITS,
    ) -> None:
        self.app = app
        self.rules = list(OPEN_RULES) + list(rules)
        self.credentials = credentials
        self.limits = limits
        self.in_flight = InFlight(limits.max_in_flight_bytes)
        self.throttle = RefusalThrottle(credentials.access.max_refusals_per_minute, time.monotonic)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "websocket":  # no meshnet route is one (review finding 11)
            await send({"type": "websocket.close", "code": 1008})
            return
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        found = match(self.rules, scope["path"])
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        host = _client_host(scope) or "?"
        try:
            admission = self._admit(found, scope, headers, host)
            if not isinstance(admission, SwarmProof):  # a member's proof is never throttled
                self.throttle.check(host)  # (N2: strangers on its address would block it)
            body = await read_body(
                headers.get("content-length"),
                receive,
                found.max_body_bytes,
                self.in_flight,
                self.limits,
            )
        except MeshError as exc:
            await error_response(exc)(scope, receive, send)
            return
        try:
            client = admission.confirm(body.sha256)
        except MeshError as exc:
            if isinstance(exc, AuthError):
                self.throttle.refused(host)
            self.in_flight.give(len(body.data))
            await error_response(exc)(scope, receive, send)
            return
        if client == "swarm" and "client" in found.needs:  # a client a tracker let in?
            client = self.credentials.forwarded(headers, body.sha256)
        try:
            scope = {**scope, CLIENT_KEY: client}
            await self.app(scope, replay_body(body.data, receive), admission.answers(send))
        finally:
            self.in_flight.give(len(body.data))

    def _admit(self, found: Rule, scope: Scope, headers: dict[str, str], host: str) -> Admission:
        """The credentials' verdict from the headers; a refusal counts against `host`, and
        past its limit is answered 429."""
        try:
            return self.credentials.admit(found.needs, scope, headers)
        except AuthError:
            self.throttle.check(host)
            self.throttle.refused(host)
            raise


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


_FORWARDED_RE = re.compile(r"^(key|ip):[A-Za-z0-9.:\[\]_-]{1,64}$")


def forwarded_client(headers: dict[str, str]) -> str | None:
    """The client a member-signed call names (`X-Meshnet-Client`), as this entry counts it
    (limits, prefix scope) once a tracker vouches for it (`Credentials.forwarded`). None when
    absent or not a client identity."""
    value = headers.get("x-meshnet-client", "").strip()
    return f"via-{value}" if _FORWARDED_RE.match(value) else None


def client_of(scope: Scope) -> str:
    """The identity the guard admitted the request as (`ip:?` outside a guard)."""
    return str(scope.get(CLIENT_KEY, "ip:?"))

"""Swarm-key proofs: an HMAC over each member-to-member request and its answer (ADR-0017,
ADR-0031).

A request carries `X-Meshnet-Auth: v2 t=<unix s> n=<nonce> to=<receiver> s=<hex HMAC>`
where the HMAC-SHA256 covers a fixed label, the method, the path with its query, the
receiver's name (its node id, or `tracker`), the timestamp, the nonce, every other
`X-Meshnet-*` header (canonically ordered) and the SHA-256 of the body. The receiver
refuses (401) a bad or missing proof, one addressed to someone else, a timestamp outside
its clock-skew window, and any nonce it already accepted inside that window, so a captured
request can be replayed neither to its receiver nor to any other member, nor with its frame
headers changed. The answer carries `X-Meshnet-Answer: v2 s=<hex HMAC>` over the request's
nonce, the status, the answer's `X-Meshnet-*` headers and its body's SHA-256. The key never
travels.
"""

from __future__ import annotations

import hashlib
import hmac
import math
import secrets
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from meshnet.errors import AuthError, LimitError

HEADER = "X-Meshnet-Auth"
ANSWER_HEADER = "X-Meshnet-Answer"
SCHEME = "v2"
_LABEL = b"meshnet-swarm-v2"
_ANSWER_LABEL = b"meshnet-answer-v2"
MIN_KEY_CHARS = 32  # 128 bits as hex: a captured proof must not allow offline guessing
TRACKER = "tracker"  # the name a tracker is addressed by (node ids are never this)
_PREFIX = "x-meshnet-"
_UNSIGNED = frozenset({HEADER.lower(), ANSWER_HEADER.lower()})


@dataclass(frozen=True)
class SwarmKey:
    """The shared secret of one mesh; `repr` never shows it."""

    secret: bytes = field(repr=False)

    @classmethod
    def from_text(cls, text: str) -> SwarmKey:
        text = text.strip()
        if len(text) < MIN_KEY_CHARS:
            raise ValueError(f"a swarm key needs at least {MIN_KEY_CHARS} characters")
        return cls(text.encode())

    def mac(self, *parts: bytes) -> str:
        """Hex HMAC-SHA256 over `parts`, newline-joined."""
        return hmac.new(self.secret, b"\n".join(parts), hashlib.sha256).hexdigest()


def header_digest(headers: Iterable[tuple[str, str]]) -> bytes:
    """SHA-256 (hex) of the `X-Meshnet-*` headers but the proofs, as sorted `name:value` lines
    with lower-case names: what a proof binds besides the body."""
    lines = sorted(
        f"{name.lower()}:{value.strip()}"
        for name, value in headers
        if name.lower().startswith(_PREFIX) and name.lower() not in _UNSIGNED
    )
    return hashlib.sha256("\n".join(lines).encode("latin-1")).hexdigest().encode()


@dataclass(frozen=True)
class Proof:
    stamp: str
    nonce: str
    to: str
    mac: str


def _parts(method: str, target: bytes, proof: Proof, headers: bytes, sha256: str) -> list[bytes]:
    return [
        _LABEL,
        method.upper().encode(),
        target,
        proof.to.encode(),
        proof.stamp.encode(),
        proof.nonce.encode(),
        headers,
        sha256.encode(),
    ]


def sign(
    key: SwarmKey,
    method: str,
    target: bytes,
    body: bytes,
    now_s: float,
    to: str,
    headers: Iterable[tuple[str, str]] = (),
) -> str:
    """The `X-Meshnet-Auth` value for a request to the member named `to`; `target` is the
    path with its query, `headers` the request's others (its `X-Meshnet-*` ones are bound)."""
    unsigned = Proof(f"{now_s:.3f}", secrets.token_hex(16), to, "")
    sha256 = hashlib.sha256(body).hexdigest()
    mac = key.mac(*_parts(method, target, unsigned, header_digest(headers), sha256))
    return f"{SCHEME} t={unsigned.stamp} n={unsigned.nonce} to={to} s={mac}"


def parse(value: str | None) -> Proof:
    """The parts of an `X-Meshnet-Auth` value; `AuthError` naming the header when malformed."""
    if not value:
        raise AuthError(f"this call needs a swarm-key proof in {HEADER}", field=HEADER)
    scheme, _, rest = value.partition(" ")
    fields = dict(p.partition("=")[::2] for p in rest.split(" ") if p)
    if scheme != SCHEME or set(fields) != {"t", "n", "to", "s"}:
        raise AuthError(
            f"{HEADER} must be '{SCHEME} t=<time> n=<nonce> to=<receiver> s=<mac>'", field=HEADER
        )
    if not (8 <= len(fields["n"]) <= 64 and fields["n"].isalnum() and len(fields["s"]) == 64):
        raise AuthError(f"{HEADER} has a malformed nonce or MAC", field=HEADER)
    return Proof(fields["t"], fields["n"], fields["to"][:128], fields["s"])


def answer_mac(
    key: SwarmKey, nonce: str, status: int, headers: Iterable[tuple[str, str]], sha256: str
) -> str:
    """The `X-Meshnet-Answer` MAC of an answer to the request whose proof had `nonce`."""
    parts = (str(status).encode(), header_digest(headers), sha256.encode())
    return key.mac(_ANSWER_LABEL, nonce.encode(), *parts)


def stamp_seconds(stamp: str) -> float:
    try:
        value = float(stamp) if len(stamp) <= 20 else math.nan
    except ValueError:
        value = math.nan
    if not math.isfinite(value):
        raise AuthError(f"{HEADER} has a malformed timestamp", field=HEADER)
    return value


class Verifier:
    """Checks proofs against one key, remembering accepted nonces for the skew window."""

    def __init__(
        self,
        key: SwarmKey,
        clock: Callable[[], float],
        names: frozenset[str],
        max_skew_s: float = 30.0,
        max_nonces: int = 200_000,
    ) -> None:
        self.key = key
        self.names = names  # who this process is: proofs addressed elsewhere are refused
        self.clock = clock  # wall-clock seconds (time.time): peers' clocks must roughly agree
        self.max_skew_s = max_skew_s
        self.max_nonces = max_nonces
        self._seen: dict[str, float] = {}  # nonce -> its timestamp
        self._spent = 0

    def verify(
        self,
        method: str,
        target: bytes,
        body: bytes,
        value: str | None,
        headers: Iterable[tuple[str, str]] = (),
    ) -> None:
        """Accept the request or raise `AuthError` (401); an accepted nonce is spent."""
        proof = self.check(value)
        self.verify_digest(method, target, hashlib.sha256(body).hexdigest(), proof, headers)

    def check(self, value: str | None) -> Proof:
        """What the header alone shows: a well-formed proof addressed to this process inside
        the clock-skew window (checked before the body is read), or `AuthError`."""
        proof = parse(value)
        if proof.to not in self.names:
            raise AuthError(
                f"this swarm-key proof is addressed to {proof.to!r}, not to this member "
                f"({', '.join(sorted(self.names)) or 'no name'})",
                field=HEADER,
            )
        now, sent = self.clock(), stamp_seconds(proof.stamp)
        if abs(now - sent) > self.max_skew_s:
            raise AuthError(
                f"{HEADER} timestamp is {now - sent:+.0f} s off this clock (window "
                f"±{self.max_skew_s:.0f} s): a replay, or clocks out of sync",
                field=HEADER,
            )
        return proof

    def verify_digest(
        self,
        method: str,
        target: bytes,
        sha256: str,
        proof: Proof,
        headers: Iterable[tuple[str, str]] = (),
    ) -> None:
        """Accept `proof` for a request with these headers and a body whose SHA-256 (hex) is
        `sha256`, or `AuthError`."""
        parts = _parts(method, target, proof, header_digest(headers), sha256)
        expected = self.key.mac(*parts)
        if not hmac.compare_digest(expected, proof.mac):
            raise AuthError("the swarm-key proof does not match: wrong key?", field=HEADER)
        self._spend(proof.nonce, stamp_seconds(proof.stamp), self.clock())

    def _spend(self, nonce: str, sent_s: float, now_s: float) -> None:
        if nonce in self._seen:
            raise AuthError("this request was already received once (replay)", field=HEADER)
        self._spent += 1
        if self._spent % 1024 == 0 or len(self._seen) >= self.max_nonces:
            self._prune(now_s)
            if len(self._seen) >= self.max_nonces:
                raise LimitError("too many signed calls in the replay window", retry_after_s=1)
        self._seen[nonce] = sent_s

    def _prune(self, now_s: float) -> None:
        horizon = now_s - 2 * self.max_skew_s  # older nonces fail the timestamp check anyway
        self._seen = {n: t for n, t in self._seen.items() if t >= horizon}


def challenge_proof(key: SwarmKey, challenge: str, node_id: str) -> str:
    """A node's answer to the tracker's reachability probe: only a member can compute it."""
    return key.mac(b"meshnet-probe-v1", challenge.encode(), node_id.encode())


def route_proof(key: SwarmKey | None, session: str, model: str, route: str, reply: str) -> str:
    """The entry's MAC over a pushed session's route (ADR-0034): every hop checks it, so a
    hop cannot send the frame to a node off the route, or on under another session ("" in
    a mesh without a swarm key)."""
    if key is None:
        return ""
    parts = (session, model, route, reply)
    return key.mac(b"meshnet-route-v1", *(p.encode() for p in parts))

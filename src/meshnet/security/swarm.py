"""Swarm-key proofs: an HMAC over each member-to-member request (ADR-0017).

A request carries `X-Meshnet-Auth: v1 t=<unix s> n=<nonce> s=<hex HMAC-SHA256>` where the
HMAC covers a fixed label, the method, the path with its query, the timestamp, the nonce and
the SHA-256 of the body. The receiver refuses (401) a bad or missing proof, a timestamp
outside its clock-skew window, and any nonce it already accepted inside that window, so a
captured request cannot be replayed. The key never travels.
"""

from __future__ import annotations

import hashlib
import hmac
import math
import secrets
from collections.abc import Callable
from dataclasses import dataclass, field

from meshnet.errors import AuthError, LimitError

HEADER = "X-Meshnet-Auth"
SCHEME = "v1"
_LABEL = b"meshnet-swarm-v1"
MIN_KEY_CHARS = 16


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


def _message(method: str, target: bytes, stamp: str, nonce: str, body: bytes) -> list[bytes]:
    return _signed(method, target, stamp, nonce, hashlib.sha256(body).hexdigest())


def _signed(method: str, target: bytes, stamp: str, nonce: str, sha256: str) -> list[bytes]:
    return [
        _LABEL,
        method.upper().encode(),
        target,
        stamp.encode(),
        nonce.encode(),
        sha256.encode(),
    ]


def sign(key: SwarmKey, method: str, target: bytes, body: bytes, now_s: float) -> str:
    """The `X-Meshnet-Auth` value for a request; `target` is the path with its query."""
    stamp, nonce = f"{now_s:.3f}", secrets.token_hex(16)
    mac = key.mac(*_message(method, target, stamp, nonce, body))
    return f"{SCHEME} t={stamp} n={nonce} s={mac}"


@dataclass(frozen=True)
class Proof:
    stamp: str
    nonce: str
    mac: str


def parse(value: str | None) -> Proof:
    """The parts of an `X-Meshnet-Auth` value; `AuthError` naming the header when malformed."""
    if not value:
        raise AuthError(f"this call needs a swarm-key proof in {HEADER}", field=HEADER)
    scheme, _, rest = value.partition(" ")
    fields = dict(p.partition("=")[::2] for p in rest.split(" ") if p)
    if scheme != SCHEME or set(fields) != {"t", "n", "s"}:
        raise AuthError(f"{HEADER} must be '{SCHEME} t=<time> n=<nonce> s=<mac>'", field=HEADER)
    if not (8 <= len(fields["n"]) <= 64 and fields["n"].isalnum() and len(fields["s"]) == 64):
        raise AuthError(f"{HEADER} has a malformed nonce or MAC", field=HEADER)
    return Proof(fields["t"], fields["n"], fields["s"])


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
        max_skew_s: float = 30.0,
        max_nonces: int = 200_000,
    ) -> None:
        self.key = key
        self.clock = clock  # wall-clock seconds (time.time): peers' clocks must roughly agree
        self.max_skew_s = max_skew_s
        self.max_nonces = max_nonces
        self._seen: dict[str, float] = {}  # nonce -> its timestamp
        self._spent = 0

    def verify(self, method: str, target: bytes, body: bytes, value: str | None) -> None:
        """Accept the request or raise `AuthError` (401); an accepted nonce is spent."""
        self.verify_digest(method, target, hashlib.sha256(body).hexdigest(), self.check(value))

    def check(self, value: str | None) -> Proof:
        """What the header alone shows: a well-formed proof inside the clock-skew window
        (checked before the body is read), or `AuthError`."""
        proof = parse(value)
        now, sent = self.clock(), stamp_seconds(proof.stamp)
        if abs(now - sent) > self.max_skew_s:
            raise AuthError(
                f"{HEADER} timestamp is {now - sent:+.0f} s off this clock (window "
                f"±{self.max_skew_s:.0f} s): a replay, or clocks out of sync",
                field=HEADER,
            )
        return proof

    def verify_digest(self, method: str, target: bytes, sha256: str, proof: Proof) -> None:
        """Accept `proof` for a body whose SHA-256 (hex) is `sha256`, or `AuthError`."""
        expected = self.key.mac(*_signed(method, target, proof.stamp, proof.nonce, sha256))
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

"""Sessions belong to the entry that opened them (ADR-0049).

A session id names a public key: `<kind>-<owner><family>[.<child>]`, where `owner` is 32 hex
digits of SHA-256 over an Ed25519 public key and `family` 16 hex digits that only the opening
entry can turn back into the private key (an HMAC under its process secret). Every frame and
every close a hop takes for a session carries `X-Meshnet-Session-Proof`:

    k=<public key, base64url>; spans=10:20,20:30; shape=1,5,576; body=<sha256>; sig=<Ed25519>

The key must hash to the id's owner and sign what the call does (`frame_statement`,
`close_statement`): a frame's statement names its tensor's shape, and the SHA-256 of the
bf16 bits the entry sent to the first of `spans` (review S1: a hop of a pushed route, which
sees the proof, cannot replay it at the others with a body of its own: the first hop checks
the digest, every hop the shape; later hops' bodies are their predecessors' work). A fork is
a frame whose parent has the same owner: sessions fork only within the family their entry
opened. Checking needs no state on the hop: the id says whose key to expect, so a member
that learns an id (every hop on the route sees it) can neither continue, fork, rewind nor
close the session anywhere the entry did not send it a proof for.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import re
import secrets
from collections.abc import Iterable
from dataclasses import dataclass
from functools import lru_cache
from typing import Protocol

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from meshnet.errors import SessionOwnerError
from meshnet.types import LayerSpan, SessionId

PROOF = "X-Meshnet-Session-Proof"
Bits = bytes | bytearray | memoryview  # a frame's bf16 payload
_ID_RE = re.compile(r"^[a-z]{1,16}-([0-9a-f]{32})([0-9a-f]{16})(?:\.[0-9a-f]{1,16})?$")
_B64_RE = re.compile(r"^[A-Za-z0-9_-]{1,100}$")
_DIGEST_RE = re.compile(r"^[0-9a-f]{64}$")
MAX_PROOF_CHARS = 2048  # a key, a signature and up to 64 spans


def owner_of(session: str) -> str:
    """The owner part of a session id (32 hex digits), or a 403 naming the problem."""
    found = _ID_RE.match(session)
    if found is None:
        raise SessionOwnerError(
            f"session id {session[:128]!r} does not name its owner's key "
            "(<kind>-<32 hex owner><16 hex family>[.<hex>], ADR-0049)",
            field=PROOF,
        )
    return found.group(1)


class Frame(Protocol):
    """What a frame says of itself (`wire.FrameMeta` is one)."""

    @property
    def session(self) -> str: ...
    @property
    def fork(self) -> str | None: ...
    @property
    def model(self) -> str: ...
    @property
    def span(self) -> LayerSpan: ...
    @property
    def position(self) -> int: ...
    @property
    def chunk_index(self) -> int: ...
    @property
    def chunk_total(self) -> int: ...
    @property
    def rewind(self) -> bool: ...


@dataclass(frozen=True)
class Body:
    """What a proof says of the frame's tensor: its shape and the SHA-256 (hex) of the bf16
    bits sent to the first hop it covers."""

    shape: tuple[int, int, int]
    digest: str

    @classmethod
    def of(cls, bits: Bits, shape: tuple[int, ...]) -> Body:
        """`bits`: the frame's bf16 payload as sent (`wire.frame.tensor_bytes`) or read."""
        b, t, width = shape
        return cls((b, t, width), hashlib.sha256(bits).hexdigest())

    def text(self) -> str:
        return "shape={},{},{}; body={}".format(*self.shape, self.digest)


def frame_statement(frame: Frame, spans: tuple[LayerSpan, ...], body: Body) -> bytes:
    """What a frame's signature covers: everything the entry decides about the call, for
    the hops holding `spans`, and the tensor it sent the first of them (later hops' inputs
    are their predecessors' work: only their shape is the entry's)."""
    fields = [
        "frame",
        frame.session,
        frame.fork or "",
        frame.model,
        str(frame.position),
        f"{frame.chunk_index}/{frame.chunk_total}",
        "1" if frame.rewind else "0",
        spans_text(spans),
        body.text(),
    ]
    return "\n".join(fields).encode()


def close_statement(session: str, node_id: str, keep: bool = False) -> bytes:
    """What a close's signature covers: this session on this node only, kept as a prefix
    or not (ADR-0058)."""
    return f"{'keep' if keep else 'close'}\n{session}\n{node_id}".encode()


def spans_text(spans: Iterable[LayerSpan]) -> str:
    return ",".join(str(s) for s in spans)


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")


def _unb64(text: str) -> bytes:
    if not _B64_RE.match(text):
        raise SessionOwnerError(f"{PROOF}: {text[:40]!r} is not base64url", field=PROOF)
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def _owner_hash(public: bytes) -> str:
    return hashlib.sha256(public).hexdigest()[:32]


@lru_cache(maxsize=4096)
def _private(secret: bytes, family: str) -> tuple[Ed25519PrivateKey, bytes]:
    """The key of one family of sessions, with its raw public key."""
    key = Ed25519PrivateKey.from_private_bytes(
        hmac.new(secret, family.encode(), hashlib.sha256).digest()
    )
    return key, key.public_key().public_bytes_raw()


class SessionKeys:
    """The entry's side: new session ids, each naming a key only this process can derive,
    and the proofs its frames and closes carry."""

    def __init__(self, secret: bytes | None = None) -> None:
        self.secret = secret or secrets.token_bytes(32)  # never leaves the process

    def new_id(self, kind: str = "s") -> SessionId:
        """A new session family's first id."""
        family = secrets.token_hex(8)
        _, public = _private(self.secret, family)
        return SessionId(f"{kind}-{_owner_hash(public)}{family}")

    def child_id(self, parent: SessionId) -> SessionId:
        """A new id in `parent`'s family: a session that may fork from it."""
        return SessionId(f"{parent.split('.')[0]}.{secrets.token_hex(4)}")

    def _sign(self, session: str, statement: bytes) -> tuple[str, str]:
        found = _ID_RE.match(session)
        if found is None:
            raise SessionOwnerError(f"session id {session!r} was not made here", field=PROOF)
        key, public = _private(self.secret, found.group(2))
        if _owner_hash(public) != found.group(1):
            raise SessionOwnerError(f"session {session} was opened by another entry", field=PROOF)
        return _b64(public), _b64(key.sign(statement))

    def frame_proof(self, frame: Frame, spans: tuple[LayerSpan, ...], body: Body) -> str:
        """`X-Meshnet-Session-Proof` for `frame`, which the hops holding `spans` may take,
        `body` being what the first of them is sent."""
        public, signature = self._sign(frame.session, frame_statement(frame, spans, body))
        return f"k={public}; spans={spans_text(spans)}; {body.text()}; sig={signature}"

    def close_proof(self, session: str, node_id: str, keep: bool = False) -> str:
        """`X-Meshnet-Session-Proof` for closing `session` on `node_id` (with `keep`: its
        cache kept as a prefix)."""
        public, signature = self._sign(session, close_statement(session, node_id, keep))
        return f"k={public}; sig={signature}"


PROCESS_KEYS = SessionKeys()  # this process's entry sessions (one secret per process)


@dataclass(frozen=True)
class Proof:
    """A parsed `X-Meshnet-Session-Proof`."""

    public: bytes
    spans: tuple[LayerSpan, ...]
    signature: bytes
    body: Body | None = None  # a frame's; a close has none


def parse_proof(value: str | None) -> Proof:
    """The header's parts, or a 403 saying what is wrong with it."""
    if value is None:
        raise SessionOwnerError(
            f"missing {PROOF}: only the entry that opened a session may use it", field=PROOF
        )
    if len(value) > MAX_PROOF_CHARS:
        raise SessionOwnerError(f"{PROOF} is over {MAX_PROOF_CHARS} characters", field=PROOF)
    parts = dict(part.strip().partition("=")[::2] for part in value.split(";"))
    if not {"k", "sig"} <= parts.keys() <= {"k", "sig", "spans", "shape", "body"}:
        raise SessionOwnerError(
            f"{PROOF} must be 'k=...; [spans=...; shape=...; body=...;] sig=...'", field=PROOF
        )
    try:
        spans = tuple(LayerSpan.parse(s) for s in parts["spans"].split(",") if s)
    except (KeyError, ValueError):
        spans = ()
    return Proof(_unb64(parts["k"]), spans, _unb64(parts["sig"]), _body(parts))


def _body(parts: dict[str, str]) -> Body | None:
    if "shape" not in parts and "body" not in parts:
        return None
    shape = parts.get("shape", "").split(",")
    digest = parts.get("body", "")
    if len(shape) != 3 or not all(d.isdigit() and len(d) <= 9 for d in shape):
        raise SessionOwnerError(f"{PROOF}: shape must be three counts", field=PROOF)
    if not _DIGEST_RE.match(digest):
        raise SessionOwnerError(f"{PROOF}: body must be a SHA-256 in hex", field=PROOF)
    b, t, width = (int(d) for d in shape)
    return Body((b, t, width), digest)


def check_frame(value: str | None, frame: Frame, bits: Bits, shape: tuple[int, ...]) -> None:
    """Refuse (403) `frame` (at the layers it names), whose tensor has `shape` and bf16
    payload `bits`, unless its session's entry signed it: that shape, and those bits when
    this hop is the first the proof covers."""
    owner = owner_of(frame.session)
    if frame.fork is not None and owner_of(frame.fork) != owner:
        raise SessionOwnerError(
            f"session {frame.session} may fork only from a session its own entry opened",
            field=PROOF,
        )
    proof = parse_proof(value)
    if frame.span not in proof.spans:
        raise SessionOwnerError(f"{PROOF} does not cover layers {frame.span}", field=PROOF)
    body = proof.body
    if body is None:
        raise SessionOwnerError(f"{PROOF} names no shape and body for a frame", field=PROOF)
    if body.shape != tuple(shape):
        raise SessionOwnerError(
            f"{PROOF} was signed for a tensor of shape {body.shape}, not {tuple(shape)}",
            field=PROOF,
        )
    if frame.span == proof.spans[0] and Body.of(bits, shape).digest != body.digest:
        raise SessionOwnerError(f"{PROOF}: the body is not the one its entry sent", field=PROOF)
    _verify(proof, owner, frame_statement(frame, proof.spans, body))


def check_close(value: str | None, session: str, node_id: str, keep: bool = False) -> None:
    """Refuse (403) closing `session` on `node_id` (keeping it, with `keep`) without its
    entry's signature."""
    owner = owner_of(session)
    _verify(parse_proof(value), owner, close_statement(session, node_id, keep))


def _verify(proof: Proof, owner: str, statement: bytes) -> None:
    if len(proof.public) != 32 or _owner_hash(proof.public) != owner:
        raise SessionOwnerError(f"{PROOF}: the key is not the session's owner", field=PROOF)
    try:
        Ed25519PublicKey.from_public_bytes(proof.public).verify(proof.signature, statement)
    except InvalidSignature:
        raise SessionOwnerError(
            f"{PROOF}: the signature does not match this call", field=PROOF
        ) from None

"""What only a tracker can say: which client a forwarded call is for (review P1, ADR-0059).

The swarm key proves a call comes from a member, and every member holds it, so a member
could name any client in `X-Meshnet-Client` and read that client's kept prompt prefixes back
from `cached_tokens`. A tracker therefore has a key pair of its own (made at start, never
shared): it signs, with each call it forwards, the client it let in, the entry it sends the
call to and the body's digest (`X-Meshnet-Vouch`). Entries learn each tracker's public key
from its answer to their registration (the tracker's own address, not a member's word) and
take a forwarded client only when a known tracker vouches for it; a call with a client
named and no vouch, or a vouch for another entry or another body, is the member's own.
"""

from __future__ import annotations

import base64
import binascii
import re

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

VOUCH_HEADER = "X-Meshnet-Vouch"
MAX_TRACKER_KEYS = 16  # a mesh has at most 15 trackers (`--peers`)
_B64 = re.compile(r"^[A-Za-z0-9_-]{1,128}$")


def client_statement(client: str, to: str, body_sha256: str) -> bytes:
    """What a tracker signs: `client` (as its guard let it in) for the entry `to`, and
    this body only (a member cannot reuse a vouch for a prompt of its own)."""
    return f"meshnet-vouch-v1\n{client}\n{to}\n{body_sha256}".encode()


class TrackerIdentity:
    """A tracker's key pair (new at every start: nothing needs it to survive a restart)."""

    def __init__(self) -> None:
        self._key = Ed25519PrivateKey.generate()
        self.public = _b64(self._key.public_key().public_bytes_raw())

    def vouch(self, client: str, to: str, body_sha256: str) -> str:
        return self.sign(client_statement(client, to, body_sha256))

    def sign(self, statement: bytes) -> str:
        """Its signature of `statement` (a lease ask's too: ADR-0059), base64url."""
        return _b64(self._key.sign(statement))


def signed_by(public: str | None, signature: str, statement: bytes) -> bool:
    """Whether `signature` is the key `public`'s (both base64url) over `statement`."""
    raw, sig = _unb64(public or ""), _unb64(signature)
    if raw is None or sig is None or len(raw) != 32:
        return False
    try:
        Ed25519PublicKey.from_public_bytes(raw).verify(sig, statement)
    except InvalidSignature:
        return False
    return True


class TrackerKeys:
    """The public keys of the trackers an entry registered with (filled as they answer)."""

    def __init__(self) -> None:
        self.known: dict[str, Ed25519PublicKey] = {}

    def add(self, public: str | None) -> None:
        if not public or public in self.known or len(self.known) >= MAX_TRACKER_KEYS:
            return
        raw = _unb64(public)
        if raw is not None and len(raw) == 32:
            self.known[public] = Ed25519PublicKey.from_public_bytes(raw)

    def vouched(self, vouch: str | None, statement: bytes) -> bool:
        """Whether a known tracker signed `statement` (`vouch`: the header's value)."""
        signature = _unb64(vouch or "")
        if signature is None:
            return False
        for key in self.known.values():
            try:
                key.verify(signature, statement)
                return True
            except InvalidSignature:
                continue
        return False


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")


def _unb64(text: str) -> bytes | None:
    if not _B64.match(text):
        return None
    try:
        return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))
    except (binascii.Error, ValueError):
        return None

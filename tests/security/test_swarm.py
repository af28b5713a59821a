"""Swarm-key proofs: what verifies, and every way a proof is refused."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meshnet.errors import AuthError, LimitError
from meshnet.security.swarm import HEADER, SwarmKey, Verifier, challenge_proof, sign

KEY = SwarmKey.from_text("a-test-swarm-key-0123")
BODY = b"\x00\x01activations"


def verifier(now: list[float]) -> Verifier:
    return Verifier(KEY, lambda: now[0], max_skew_s=30.0)


def test_a_signed_request_verifies_once() -> None:
    now = [1000.0]
    check = verifier(now)
    proof = sign(KEY, "POST", b"/forward", BODY, 1000.0)
    check.verify("POST", b"/forward", BODY, proof)
    with pytest.raises(AuthError, match="replay"):
        check.verify("POST", b"/forward", BODY, proof)


@pytest.mark.parametrize(
    ("method", "target", "body", "key", "now", "words"),
    [
        ("GET", b"/forward", BODY, KEY, 1000.0, "does not match"),  # another method
        ("POST", b"/sessions/x", BODY, KEY, 1000.0, "does not match"),  # another path
        ("POST", b"/forward", BODY + b"!", KEY, 1000.0, "does not match"),  # altered body
        ("POST", b"/forward", BODY, SwarmKey.from_text("another-key-456789"), 1000.0, "match"),
        ("POST", b"/forward", BODY, KEY, 1031.0, "off this clock"),  # too old
        ("POST", b"/forward", BODY, KEY, 969.0, "off this clock"),  # from the future
    ],
)
def test_proofs_that_do_not_fit_are_refused(
    method: str, target: bytes, body: bytes, key: SwarmKey, now: float, words: str
) -> None:
    proof = sign(key, "POST", b"/forward", BODY, 1000.0)
    with pytest.raises(AuthError, match=words) as refused:
        verifier([now]).verify(method, target, body, proof)
    assert refused.value.field == HEADER and refused.value.http_status == 401


@pytest.mark.parametrize(
    "value",
    [
        None,
        "",
        "v1",
        "v2 t=1 n=abcdefgh s=" + "0" * 64,
        "v1 t=1 n=abc s=" + "0" * 64,
        "v1 t=nan n=abcdefgh s=" + "0" * 64,
        "v1 t=1 n=abcdefgh s=short",
        "Bearer xyz",
    ],
)
def test_malformed_proofs_name_the_header(value: str | None) -> None:
    with pytest.raises(AuthError) as refused:
        verifier([1.0]).verify("POST", b"/forward", b"", value)
    assert refused.value.field == HEADER


@settings(max_examples=300, deadline=None)
@given(value=st.text(max_size=200))
def test_any_header_value_is_an_auth_error_never_a_crash(value: str) -> None:
    with pytest.raises(AuthError):
        verifier([1.0]).verify("POST", b"/forward", b"", value)


def test_a_full_nonce_store_refuses_rather_than_grows() -> None:
    now = [1000.0]
    check = Verifier(KEY, lambda: now[0], max_skew_s=30.0, max_nonces=3)
    for _ in range(3):
        check.verify("GET", b"/x", b"", sign(KEY, "GET", b"/x", b"", 1000.0))
    with pytest.raises(LimitError):
        check.verify("GET", b"/x", b"", sign(KEY, "GET", b"/x", b"", 1000.0))
    now[0] = 1100.0  # the old nonces are past the window: pruned, room again
    check.verify("GET", b"/x", b"", sign(KEY, "GET", b"/x", b"", 1100.0))


def test_short_keys_are_refused_and_repr_hides_the_secret() -> None:
    with pytest.raises(ValueError):
        SwarmKey.from_text("short")
    assert "0123" not in repr(KEY)


def test_challenge_proofs_bind_the_node_id() -> None:
    assert challenge_proof(KEY, "c" * 32, "node-a") != challenge_proof(KEY, "c" * 32, "node-b")

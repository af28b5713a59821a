"""Swarm-key proofs: what verifies, and every way a proof is refused."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meshnet.errors import AuthError, LimitError
from meshnet.security.swarm import (
    HEADER,
    SwarmKey,
    Verifier,
    answer_mac,
    challenge_proof,
    header_digest,
    sign,
)

KEY = SwarmKey.from_text("a-test-swarm-key-0123-padded-to-128-bits-0123456789")
BODY = b"\x00\x01activations"


ME = frozenset({"node-a"})
FRAME = [("X-Meshnet-Session", "s1"), ("X-Meshnet-Shape", "1,1,8"), ("Content-Type", "x")]


def verifier(now: list[float], names: frozenset[str] = ME) -> Verifier:
    return Verifier(KEY, lambda: now[0], names, max_skew_s=30.0)


def signed(key: SwarmKey = KEY, method: str = "POST", target: bytes = b"/forward") -> str:
    return sign(key, method, target, BODY, 1000.0, "node-a", FRAME)


def test_a_signed_request_verifies_once() -> None:
    now = [1000.0]
    check = verifier(now)
    proof = signed()
    check.verify("POST", b"/forward", BODY, proof, FRAME)
    with pytest.raises(AuthError, match="replay"):
        check.verify("POST", b"/forward", BODY, proof, FRAME)


def test_a_proof_for_one_member_is_refused_by_another() -> None:
    """Review finding 4: a proof node A accepted was accepted by node B. Now it names A."""
    with pytest.raises(AuthError, match="addressed to 'node-a'") as refused:
        verifier([1000.0], frozenset({"node-b"})).verify("POST", b"/forward", BODY, signed(), FRAME)
    assert refused.value.field == HEADER


@pytest.mark.parametrize(
    "headers",
    [
        [("X-Meshnet-Session", "s2"), FRAME[1]],  # session changed
        [FRAME[0], ("X-Meshnet-Shape", "4,3000,576")],  # shape changed
        [FRAME[0]],  # a header removed
        [*FRAME, ("X-Meshnet-Position", "7")],  # a header added
        [("X-Meshnet-Session", "evil"), *FRAME],  # a duplicate put first
    ],
)
def test_frame_headers_changed_after_signing_are_refused(headers: list[tuple[str, str]]) -> None:
    with pytest.raises(AuthError, match="does not match"):
        verifier([1000.0]).verify("POST", b"/forward", BODY, signed(), headers)


def test_other_headers_and_name_case_do_not_matter() -> None:
    same = [(k.lower(), v) for k, v in FRAME[:2]] + [("Accept", "*/*")]
    verifier([1000.0]).verify("POST", b"/forward", BODY, signed(), same)
    assert header_digest(FRAME) == header_digest(reversed(FRAME))


def test_answer_macs_bind_nonce_status_headers_and_body() -> None:
    base = answer_mac(KEY, "n1", 200, FRAME, "ab")
    assert base == answer_mac(KEY, "n1", 200, list(reversed(FRAME)), "ab")
    others = [
        answer_mac(KEY, "n2", 200, FRAME, "ab"),
        answer_mac(KEY, "n1", 201, FRAME, "ab"),
        answer_mac(KEY, "n1", 200, FRAME[:1], "ab"),
        answer_mac(KEY, "n1", 200, FRAME, "cd"),
    ]
    assert base not in others


@pytest.mark.parametrize(
    ("method", "target", "body", "key", "now", "words"),
    [
        ("GET", b"/forward", BODY, KEY, 1000.0, "does not match"),  # another method
        ("POST", b"/sessions/x", BODY, KEY, 1000.0, "does not match"),  # another path
        ("POST", b"/forward", BODY + b"!", KEY, 1000.0, "does not match"),  # altered body
        (
            "POST",
            b"/forward",
            BODY,
            SwarmKey.from_text("another-key-456789-padded-to-128-bits-0123456789"),
            1000.0,
            "match",
        ),
        ("POST", b"/forward", BODY, KEY, 1031.0, "off this clock"),  # too old
        ("POST", b"/forward", BODY, KEY, 969.0, "off this clock"),  # from the future
    ],
)
def test_proofs_that_do_not_fit_are_refused(
    method: str, target: bytes, body: bytes, key: SwarmKey, now: float, words: str
) -> None:
    proof = signed(key)
    with pytest.raises(AuthError, match=words) as refused:
        verifier([now]).verify(method, target, body, proof, FRAME)
    assert refused.value.field == HEADER and refused.value.http_status == 401


@pytest.mark.parametrize(
    "value",
    [
        None,
        "",
        "v2",
        "v1 t=1 n=abcdefgh s=" + "0" * 64,  # the old form, bound to no receiver
        "v2 t=1 n=abcdefgh s=" + "0" * 64,
        "v2 t=1 n=abc to=node-a s=" + "0" * 64,
        "v2 t=nan n=abcdefgh to=node-a s=" + "0" * 64,
        "v2 t=1 n=abcdefgh to=node-a s=short",
        "v2 t=1 n=abcdefgh to=node-b s=" + "0" * 64,
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
    check = Verifier(KEY, lambda: now[0], ME, max_skew_s=30.0, max_nonces=3)
    for _ in range(3):
        check.verify("GET", b"/x", b"", sign(KEY, "GET", b"/x", b"", 1000.0, "node-a"))
    with pytest.raises(LimitError):
        check.verify("GET", b"/x", b"", sign(KEY, "GET", b"/x", b"", 1000.0, "node-a"))
    now[0] = 1100.0  # the old nonces are past the window: pruned, room again
    check.verify("GET", b"/x", b"", sign(KEY, "GET", b"/x", b"", 1100.0, "node-a"))


def test_short_keys_are_refused_and_repr_hides_the_secret() -> None:
    with pytest.raises(ValueError):
        SwarmKey.from_text("short")
    assert "0123" not in repr(KEY)


def test_challenge_proofs_bind_the_node_id() -> None:
    assert challenge_proof(KEY, "c" * 32, "node-a") != challenge_proof(KEY, "c" * 32, "node-b")

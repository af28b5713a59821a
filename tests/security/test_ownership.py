"""Sessions belong to the entry that opened them (ADR-0049): review N3's requests, replayed
against a node, get 403 and change nothing; the entry's own calls go on."""

from __future__ import annotations

from dataclasses import replace

import httpx
import pytest
import torch

from meshnet.errors import SessionOwnerError
from meshnet.node.app import create_app
from meshnet.node.runner import EchoRunner
from meshnet.security.ownership import (
    PROOF,
    Body,
    SessionKeys,
    check_close,
    check_frame,
    owner_of,
)
from meshnet.types import LayerSpan, ModelId, SessionId
from meshnet.wire import FrameMeta, encode
from meshnet.wire.frame import tensor_bytes
from tests.conftest import run

SPAN, MODEL = LayerSpan(10, 20), ModelId("default")
VICTIM, ATTACKER = SessionKeys(), SessionKeys()  # two entries, each with its own secret


ONE = torch.randn(1, 1, 16)  # a step's activations


def body(hidden: torch.Tensor) -> Body:
    return Body.of(tensor_bytes(hidden), tuple(hidden.shape))


def signed(
    keys: SessionKeys,
    meta: FrameMeta,
    spans: tuple[LayerSpan, ...] = (SPAN,),
    hidden: torch.Tensor = ONE,
) -> str:
    return keys.frame_proof(meta, spans, body(hidden))


def check(value: str | None, meta: FrameMeta, hidden: torch.Tensor = ONE) -> None:
    check_frame(value, meta, tensor_bytes(hidden), tuple(hidden.shape))


def test_the_entry_signs_its_frames_forks_and_closes_and_hops_accept_them() -> None:
    session = VICTIM.new_id()
    meta = FrameMeta(session, MODEL, SPAN, 0)
    check(signed(VICTIM, meta), meta)
    child = VICTIM.child_id(session)
    fork = FrameMeta(child, MODEL, SPAN, 60, fork=session)
    check(signed(VICTIM, fork), fork)
    pushed = (SPAN, LayerSpan(20, 30))  # one proof for every hop of a pushed route
    later = torch.randn(1, 1, 16)  # the first hop's output: the entry never saw it
    check(signed(VICTIM, meta, pushed), replace(meta, span=LayerSpan(20, 30)), later)
    check_close(VICTIM.close_proof(session, "node-b"), session, "node-b")
    assert owner_of(child) == owner_of(session) and len(session) == 50


def refusal(value: str | None, meta: FrameMeta, hidden: torch.Tensor = ONE) -> str:
    with pytest.raises(SessionOwnerError) as refused:
        check(value, meta, hidden)
    assert refused.value.http_status == 403 and refused.value.field == PROOF
    return refused.value.message


VICTIM_SESSION = VICTIM.new_id()
STEP = FrameMeta(VICTIM_SESSION, MODEL, SPAN, 60)
GOOD = signed(VICTIM, STEP)


@pytest.mark.parametrize(
    ("proof", "meta", "says"),
    [
        (None, STEP, "missing"),
        ("k=abc", STEP, "must be"),
        ("k=!!; sig=x", STEP, "base64url"),
        (GOOD, replace(STEP, position=59), "signature"),  # one position's proof, another's call
        (GOOD, replace(STEP, rewind=True), "signature"),  # a step's proof cannot rewind
        (GOOD, replace(STEP, span=LayerSpan(0, 10)), "does not cover"),  # the entry's own span
        (signed(ATTACKER, FrameMeta(ATTACKER.new_id(), MODEL, SPAN, 60)), STEP, "owner"),
        (GOOD, replace(STEP, session=SessionId("s-1")), "does not name"),
    ],
    ids=["none", "malformed", "not-base64", "position", "rewind", "span", "key", "id"],
)
def test_calls_the_entry_did_not_sign_are_refused(
    proof: str | None, meta: FrameMeta, says: str
) -> None:
    assert says in refusal(proof, meta)


def test_a_hop_of_a_pushed_route_cannot_replay_its_proof_with_a_body_of_its_own() -> None:
    """S1: the proof names the tensor the entry sent the first hop, and its shape for all:
    another body at the first hop, or another shape anywhere, is refused."""
    pushed = (SPAN, LayerSpan(20, 30))
    meta = FrameMeta(VICTIM.new_id(), MODEL, SPAN, 0)
    proof = signed(VICTIM, meta, pushed)
    assert "not the one its entry sent" in refusal(proof, meta, torch.randn(1, 1, 16))
    later = replace(meta, span=LayerSpan(20, 30))
    assert "shape" in refusal(proof, later, torch.randn(1, 40, 16))  # 40 tokens of its own
    zeros = torch.zeros(1, 1, 16)
    forged = proof.replace(body(ONE).digest, body(zeros).digest)  # its own body's digest
    assert "signature" in refusal(forged, meta, zeros)
    assert "SHA-256" in refusal(proof.replace(body(ONE).digest, "xyz"), meta)
    assert "shape must be" in refusal(proof.replace("shape=1,1,16", "shape=1,1"), meta)
    bare = proof.replace(f"; {body(ONE).text()}", "")  # an older entry's proof, say
    assert "names no shape" in refusal(bare, meta)


def test_a_member_cannot_fork_another_entrys_session_into_its_own() -> None:
    """N3: the attacker's own session, forked from the victim's, signed with its own key."""
    mine = ATTACKER.new_id()
    fork = FrameMeta(mine, MODEL, SPAN, 60, fork=VICTIM_SESSION)
    assert "fork only from a session its own entry opened" in refusal(signed(ATTACKER, fork), fork)
    forged = FrameMeta(VICTIM.child_id(VICTIM_SESSION), MODEL, SPAN, 60, fork=VICTIM_SESSION)
    assert "owner" in refusal(signed(ATTACKER, replace(forged, session=mine, fork=None)), forged)


def test_closing_needs_the_proof_for_that_node() -> None:
    for_b = VICTIM.close_proof(VICTIM_SESSION, "node-b")
    with pytest.raises(SessionOwnerError):
        check_close(for_b, VICTIM_SESSION, "node-c")  # a banned hop replaying it elsewhere
    with pytest.raises(SessionOwnerError):
        check_close(None, VICTIM_SESSION, "node-b")


async def post(app: object, meta: FrameMeta, hidden: torch.Tensor, proof: str | None) -> int:
    frame = encode(hidden, meta)
    headers = frame.headers | ({PROOF: proof} if proof else {})
    transport = httpx.ASGITransport(app=app)  # type: ignore[arg-type]
    async with httpx.AsyncClient(transport=transport, base_url="http://node") as client:
        answer = await client.post("/forward", headers=headers, content=bytes(frame.body))
        return answer.status_code


async def delete(app: object, session: str, proof: str | None) -> int:
    transport = httpx.ASGITransport(app=app)  # type: ignore[arg-type]
    async with httpx.AsyncClient(transport=transport, base_url="http://node") as client:
        headers = {PROOF: proof} if proof else {}
        return (await client.delete(f"/sessions/{session}", headers=headers)).status_code


def test_the_review_attacks_on_a_node_get_403_and_the_victim_goes_on() -> None:
    """a_fork.py's fork frames, a continuation, a rewind and a close, each sent by a member
    that is not the victim's entry, to a node holding the victim's 60-token session."""
    runner = EchoRunner(MODEL, SPAN)
    app = create_app(runner)
    prompt = FrameMeta(VICTIM_SESSION, MODEL, SPAN, 0)
    sixty = torch.randn(1, 60, 16)
    assert run(post(app, prompt, sixty, signed(VICTIM, prompt, hidden=sixty))) == 200
    mine = ATTACKER.new_id()
    attacks = [
        (FrameMeta(mine, MODEL, SPAN, 60, fork=VICTIM_SESSION), ATTACKER),  # a_fork.py
        (FrameMeta(VICTIM.child_id(VICTIM_SESSION), MODEL, SPAN, 60, fork=VICTIM_SESSION), None),
        (STEP, ATTACKER),  # continuing the victim's session
        (replace(STEP, position=50, rewind=True), ATTACKER),  # rewinding it
    ]
    for meta, keys in attacks:
        proof = None
        if keys is ATTACKER:
            proof = signed(ATTACKER, replace(meta, session=mine))
        assert run(post(app, meta, ONE, proof)) == 403, meta
    assert run(delete(app, VICTIM_SESSION, None)) == 403
    assert run(delete(app, VICTIM_SESSION, ATTACKER.close_proof(mine, "unregistered"))) == 403
    assert runner.session_count() == 1  # nothing forked, nothing closed
    assert run(post(app, STEP, ONE, GOOD)) == 200  # the victim goes on
    assert (
        run(delete(app, VICTIM_SESSION, VICTIM.close_proof(VICTIM_SESSION, "unregistered"))) == 200
    )
    assert runner.session_count() == 0

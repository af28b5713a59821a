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
from meshnet.security.ownership import PROOF, SessionKeys, check_close, check_frame, owner_of
from meshnet.types import LayerSpan, ModelId, SessionId
from meshnet.wire import FrameMeta, encode
from tests.conftest import run

SPAN, MODEL = LayerSpan(10, 20), ModelId("default")
VICTIM, ATTACKER = SessionKeys(), SessionKeys()  # two entries, each with its own secret


def signed(keys: SessionKeys, meta: FrameMeta, spans: tuple[LayerSpan, ...] = (SPAN,)) -> str:
    return keys.frame_proof(meta, spans)


def test_the_entry_signs_its_frames_forks_and_closes_and_hops_accept_them() -> None:
    session = VICTIM.new_id()
    meta = FrameMeta(session, MODEL, SPAN, 0)
    check_frame(signed(VICTIM, meta), meta)
    child = VICTIM.child_id(session)
    fork = FrameMeta(child, MODEL, SPAN, 60, fork=session)
    check_frame(signed(VICTIM, fork), fork)
    pushed = (SPAN, LayerSpan(20, 30))  # one proof for every hop of a pushed route
    check_frame(signed(VICTIM, meta, pushed), replace(meta, span=LayerSpan(20, 30)))
    check_close(VICTIM.close_proof(session, "node-b"), session, "node-b")
    assert owner_of(child) == owner_of(session) and len(session) == 50


def refusal(value: str | None, meta: FrameMeta) -> str:
    with pytest.raises(SessionOwnerError) as refused:
        check_frame(value, meta)
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
    assert run(post(app, prompt, torch.randn(1, 60, 16), signed(VICTIM, prompt))) == 200
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
        assert run(post(app, meta, torch.randn(1, 1, 16), proof)) == 403, meta
    assert run(delete(app, VICTIM_SESSION, None)) == 403
    assert run(delete(app, VICTIM_SESSION, ATTACKER.close_proof(mine, "unregistered"))) == 403
    assert runner.session_count() == 1  # nothing forked, nothing closed
    assert run(post(app, STEP, torch.randn(1, 1, 16), GOOD)) == 200  # the victim goes on
    assert (
        run(delete(app, VICTIM_SESSION, VICTIM.close_proof(VICTIM_SESSION, "unregistered"))) == 200
    )
    assert runner.session_count() == 0

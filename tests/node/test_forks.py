"""Forked sessions on a node (ADR-0045): a new session whose first frame names another
starts as a copy of that one's first tokens, in every kind of cache, and answers as a
session that ran those tokens itself; a fork that cannot be made is refused and changes
nothing."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import httpx
import pytest
import torch

from meshnet.config import WireLimits
from meshnet.errors import (
    LimitError,
    MeshError,
    SessionError,
    SessionNotFoundError,
    WireError,
)
from meshnet.models.cache import cache_length
from meshnet.models.loader import load_shard
from meshnet.models.source import resolve
from meshnet.node.app import create_app
from meshnet.node.runner import EchoRunner
from meshnet.node.sessions import SessionStore
from meshnet.node.torch_runner import TorchShardRunner
from meshnet.security.ownership import PROCESS_KEYS, PROOF
from meshnet.types import LayerSpan, ModelId, SessionId
from meshnet.wire import FrameMeta
from meshnet.wire import headers as h
from tests.conftest import run
from tests.owned import encode, new_session, proof

SPAN = LayerSpan(0, 2)


def meta(session: str, position: int, fork: str | None = None) -> FrameMeta:
    forked = SessionId(fork) if fork else None
    return FrameMeta(SessionId(session), ModelId("tiny"), SPAN, position, fork=forked)


CASES = [
    ("llama", "fp32", 20),  # static cache (the fast path)
    ("llama", "bf16", 20),
    ("llama", "int8", 20),
    ("gpt2", "fp32", 20),  # eager cache
    ("gemma3_text", "fp32", 300),  # eager, sliding layers already trimmed to their window
]


@pytest.mark.parametrize(("model_type", "quant", "prompt"), CASES)
def test_a_fork_answers_as_a_session_that_ran_the_prefix_itself(
    model_type: str, quant: str, prompt: int, tiny_folder: Callable[[str], Path]
) -> None:
    source = resolve(str(tiny_folder(model_type)))
    runner = TorchShardRunner(ModelId("tiny"), load_shard(source, SPAN, quant))  # type: ignore[arg-type]
    width = int(runner.shard.config.hidden_size)
    torch.manual_seed(0)
    x, steps, other = (
        torch.randn(1, prompt, width),
        torch.randn(1, 3, width),
        torch.randn(1, 1, width),
    )
    runner.forward(meta("parent", 0), x)
    runner.forward(meta("parent", prompt), other)  # the parent goes on first: copied up to prompt
    forked = [runner.forward(meta("child", prompt, "parent"), steps[:, :1])]
    forked.append(runner.forward(meta("child", prompt + 1), steps[:, 1:]))
    runner.forward(meta("fresh", 0), x)
    fresh = [runner.forward(meta("fresh", prompt), steps[:, :1])]
    fresh.append(runner.forward(meta("fresh", prompt + 1), steps[:, 1:]))
    for a, b in zip(forked, fresh, strict=True):
        assert torch.equal(a, b)
    held = runner.sessions._sessions
    assert held[SessionId("parent")].length == prompt + 1  # the parent is untouched
    assert held[SessionId("child")].length == prompt + 3
    assert cache_length(held[SessionId("child")].cache) == prompt + 3
    assert held[SessionId("child")].cache_bytes == held[SessionId("fresh")].cache_bytes


class Box:
    """A stand-in cache: the tokens it holds."""

    def __init__(self, tokens: list[int]) -> None:
        self.tokens = tokens


def store(max_bytes: int = 1000, clock: Callable[[], float] = lambda: 0.0) -> SessionStore:
    return SessionStore(
        lambda: Box([]),
        lambda box: 10 * len(box.tokens),
        max_bytes=max_bytes,
        evict_idle_s=0.0,
        clock=clock,
        bytes_per_token=10,
        copy=lambda box, length: Box(box.tokens[:length]),
    )


def start(sessions: SessionStore, sid: str, tokens: int) -> None:
    session, chunks = sessions.checkout(meta(sid, 0), tokens)
    session.cache.tokens.extend(range(tokens))
    sessions.commit(SessionId(sid), session, tokens, chunks)


def test_a_fork_that_cannot_be_made_is_refused_and_changes_nothing() -> None:
    sessions = store(max_bytes=240)
    start(sessions, "p", 12)
    with pytest.raises(SessionNotFoundError) as unknown:
        sessions.checkout(meta("c", 4, "nobody"))
    assert unknown.value.field == h.FORK
    with pytest.raises(SessionError, match="holds 12 tokens") as beyond:
        sessions.checkout(meta("c", 13, "p"))
    assert beyond.value.field == h.FORK
    with pytest.raises(LimitError):  # 12 held + 12 copied + 1, 10 bytes each: over 240
        sessions.checkout(meta("c", 12, "p"))
    assert len(sessions) == 1 and sessions.total_bytes() == 120  # the idle parent stayed
    session, _ = sessions.checkout(meta("c", 8, "p"))
    assert (session.length, session.cache.tokens) == (8, list(range(8)))


def test_a_fork_header_is_ignored_by_a_node_that_has_the_session() -> None:
    """A replayed session (failover) gets its fork frame again: it continues as it is."""
    sessions = store()
    start(sessions, "p", 5)
    start(sessions, "c", 7)
    session, _ = sessions.checkout(meta("c", 7, "p"))
    assert session.length == 7
    with pytest.raises(SessionError, match="overlap"):
        sessions.checkout(meta("c", 5, "p"))


def test_a_store_without_copies_refuses_forks() -> None:
    sessions = SessionStore(lambda: Box([]), lambda box: 0)
    start(sessions, "p", 3)
    with pytest.raises(SessionNotFoundError):
        sessions.checkout(meta("c", 3, "p"))


def test_fork_headers_round_trip_and_bad_ones_are_refused() -> None:
    sent = meta("c", 4, "p")
    assert sent.to_headers()[h.FORK] == "p"
    assert h.parse_meta(h.lower_keys(sent.to_headers())) == sent
    assert h.FORK not in meta("c", 4).to_headers()
    for bad in ("c", "bad id!"):
        with pytest.raises(WireError) as error:
            replace(sent, fork=SessionId(bad))
        assert error.value.field == h.FORK


PARENT = new_session()
FAMILY = {"s1": PROCESS_KEYS.child_id(PARENT), "nobody": PROCESS_KEYS.child_id(PARENT)}
FAMILY |= {"p": PARENT, "stranger": new_session()}  # another family: another entry's session


@pytest.mark.parametrize(
    ("fork", "position", "status", "field"),
    [
        ("not ok!", 4, 400, h.FORK),
        ("s1", 4, 400, h.FORK),  # the session itself
        ("nobody", 4, 409, h.FORK),  # unknown here, as an unknown session is
        ("p", 9, 409, h.FORK),  # past what the parent holds
        ("stranger", 4, 403, PROOF),  # not its own entry's session (ADR-0049)
    ],
)
def test_bad_forks_over_http_get_json_errors(
    fork: str, position: int, status: int, field: str
) -> None:
    runner = EchoRunner(ModelId("tiny"), SPAN)
    runner.forward(FrameMeta(PARENT, ModelId("tiny"), SPAN, 0), torch.zeros(1, 6, 16))
    app = create_app(runner, WireLimits())
    sent = FrameMeta(FAMILY["s1"], ModelId("tiny"), SPAN, position)
    hidden = torch.randn(1, 1, 16)
    frame = encode(hidden, sent)
    headers = {**frame.headers, h.FORK: FAMILY.get(fork, fork)}
    with contextlib.suppress(MeshError):  # signed as its entry would sign it
        headers |= proof(h.parse_meta(h.lower_keys(headers)), hidden)

    async def go() -> httpx.Response:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://node") as client:
            return await client.post("/forward", headers=headers, content=bytes(frame.body))

    answer = run(go())
    assert answer.status_code == status, answer.text
    assert answer.json()["error"]["field"] == field
    assert runner.session_count() == 1

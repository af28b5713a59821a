"""Kept prefixes on a node (ADR-0058): a session its entry ends with `keep` stays only to be
forked from. It counts against no session limit, goes first when room is needed, and forks
from it are counted; keeping takes the entry's signature like closing does."""

from __future__ import annotations

from collections.abc import Callable

import httpx
import pytest
import torch

from meshnet.config import WireLimits
from meshnet.errors import ModelError, SessionNotFoundError
from meshnet.node.app import create_app
from meshnet.node.runner import EchoRunner
from meshnet.node.sessions import SessionStore
from meshnet.security.ownership import PROCESS_KEYS, PROOF
from meshnet.types import LayerSpan, ModelId, SessionId
from meshnet.wire import FrameMeta
from meshnet.wire import headers as h
from tests.conftest import run
from tests.node.test_forks import Box, meta, start

SPAN = LayerSpan(0, 2)


def store(  # type: ignore[no-untyped-def]
    max_bytes: int = 1000,
    max_kept: int = 256,
    clock: Callable[[], float] = lambda: 0.0,
    max_kept_bytes: int | None = None,
):
    return SessionStore(
        lambda: Box([]),
        lambda box: 10 * len(box.tokens),
        max_bytes=max_bytes,
        evict_idle_s=60.0,  # live sessions are never idle enough to go here
        clock=clock,
        bytes_per_token=10,
        copy=lambda box, length: Box(box.tokens[:length]),
        max_kept=max_kept,
        max_kept_bytes=max_kept_bytes,
    )


def fork(sessions: SessionStore, sid: str, parent: str, position: int, tokens: int) -> None:
    session, chunks = sessions.checkout(meta(sid, position, parent), tokens)
    session.cache.tokens.extend(range(position, position + tokens))
    sessions.commit(SessionId(sid), session, tokens, chunks)


def test_a_kept_prefix_is_no_live_session_and_its_forks_are_counted() -> None:
    sessions = store()
    start(sessions, "a", 30)
    assert sessions.keep(SessionId("a")) and not sessions.keep(SessionId("nobody"))
    assert len(sessions) == 0  # no session limit counts it
    fork(sessions, "b", "a", 20, 5)
    fork(sessions, "c", "a", 30, 1)
    stats = sessions.prefix_stats()
    assert (stats.hits, stats.tokens_reused, stats.kept, stats.kept_bytes) == (2, 50, 1, 300)
    assert len(sessions) == 2
    start(sessions, "d", 3)
    fork(sessions, "e", "d", 3, 1)  # a live parent (a pending prompt, n > 1) counts too
    assert sessions.prefix_stats().hits == 3


def test_kept_prefixes_go_first_when_room_is_needed_whatever_their_age() -> None:
    now = [0.0]
    sessions = store(max_bytes=500, clock=lambda: now[0])
    start(sessions, "old-live", 20)  # the least recently used, but live
    now[0] = 1.0
    start(sessions, "kept", 20)
    sessions.keep(SessionId("kept"))
    now[0] = 2.0
    start(sessions, "new", 20)  # 600 bytes past 500: the kept prefix goes, not the live session
    held = set(sessions._sessions)
    assert held == {SessionId("old-live"), SessionId("new")}


def test_past_max_kept_the_least_recently_used_prefix_goes() -> None:
    sessions = store(max_kept=2)
    for sid in ("a", "b", "c"):
        start(sessions, sid, 2)
    sessions.keep(SessionId("a"))
    sessions.keep(SessionId("b"))
    fork(sessions, "x", "a", 2, 1)  # a fork makes "a" the most recently used
    sessions.keep(SessionId("c"))
    assert sessions.prefix_stats().kept == 2
    assert SessionId("b") not in sessions._sessions
    assert {SessionId("a"), SessionId("c")} <= set(sessions._sessions)


def test_a_prefix_forked_from_lives_its_time_to_live_from_its_last_fork() -> None:
    """A kept prefix in use stays: its time to live counts from the last fork (test review
    12-07, N1: a fork that no longer refreshed it passed every fast test)."""
    now = [0.0]
    sessions = store(clock=lambda: now[0])
    sessions.ttl_s = 10.0
    start(sessions, "a", 4)
    sessions.keep(SessionId("a"))
    now[0] = 8.0
    fork(sessions, "b", "a", 4, 1)
    now[0] = 15.0  # 15 s after it was kept, 7 s after its fork
    sessions.expire()
    assert SessionId("a") in sessions._sessions
    now[0] = 18.5
    sessions.expire()
    assert SessionId("a") not in sessions._sessions


def test_kept_prefixes_hold_at_most_the_kv_reserve_least_recently_used_going_first() -> None:
    """Review K1: 32 kept prefixes held 1,009 MiB of a node lending 300 MB with no live
    session. Kept prefixes together keep within `max_kept_bytes` (the node's KV reserve)."""
    sessions = store(max_bytes=10_000, max_kept_bytes=450)
    for sid in ("a", "b", "c"):
        start(sessions, sid, 20)  # 200 bytes each
    for sid in ("a", "b", "c"):
        assert sessions.keep(SessionId(sid))
    assert sessions.prefix_stats().kept_bytes <= 450
    assert set(sessions._sessions) == {SessionId("b"), SessionId("c")}


def test_a_prefix_a_sliding_layer_no_longer_holds_is_a_fork_miss() -> None:
    def copy(box: Box, length: int) -> Box:
        raise ModelError("a sliding-window layer keeps tokens from 40 on")

    sessions = SessionStore(lambda: Box([]), lambda box: 0, copy=copy)
    start(sessions, "a", 50)
    sessions.keep(SessionId("a"))
    with pytest.raises(SessionNotFoundError, match="no longer holds") as miss:
        sessions.checkout(meta("b", 10, "a"))
    assert miss.value.field == h.FORK  # 409: the entry prefills from 0 instead
    assert len(sessions) == 0 and sessions.prefix_stats().hits == 0


def test_keeping_over_http_takes_the_entry_signature_for_keeping() -> None:
    parent = PROCESS_KEYS.new_id()
    child = PROCESS_KEYS.child_id(parent)
    runner = EchoRunner(ModelId("tiny"), SPAN)
    runner.forward(FrameMeta(parent, ModelId("tiny"), SPAN, 0), torch.zeros(1, 6, 16))
    app = create_app(runner, WireLimits())

    async def delete(path: str, keep: bool) -> httpx.Response:
        signed = {PROOF: PROCESS_KEYS.close_proof(parent, "unregistered", keep)}
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://node") as client:
            return await client.delete(path, headers=signed)

    assert run(delete(f"/sessions/{parent}?keep=1", keep=False)).status_code == 403
    assert run(delete(f"/sessions/{parent}", keep=True)).status_code == 403
    bad = run(delete(f"/sessions/{parent}?keep=yes", keep=True))
    assert bad.status_code == 400 and bad.json()["error"]["field"] == "keep"
    assert runner.session_count() == 1  # none of them changed anything
    kept = run(delete(f"/sessions/{parent}?keep=1", keep=True))
    assert kept.status_code == 200 and kept.json() == {"kept": parent}
    assert runner.session_count() == 0
    runner.forward(FrameMeta(child, ModelId("tiny"), SPAN, 4, fork=parent), torch.zeros(1, 1, 16))

    async def metrics() -> str:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://node") as client:
            return (await client.get("/metrics")).text

    text = run(metrics())
    assert "meshnet_prefix_hits 1.0" in text
    assert "meshnet_prefix_tokens_reused 4.0" in text
    assert "meshnet_prefix_cache_sessions 1.0" in text


def test_a_prefix_of_one_model_or_quant_never_serves_another() -> None:
    """Each (model, span) runner keeps its own prefixes: a fork naming another's is a miss
    (the entry keeps an index per model, and a span reloaded at another quant is a new
    runner with none)."""
    parent = PROCESS_KEYS.new_id()
    ones = EchoRunner(ModelId("one"), SPAN)
    other = EchoRunner(ModelId("other"), SPAN)
    ones.forward(FrameMeta(parent, ModelId("one"), SPAN, 0), torch.zeros(1, 6, 16))
    ones.drop(parent, keep=True)
    child = FrameMeta(PROCESS_KEYS.child_id(parent), ModelId("other"), SPAN, 4, fork=parent)
    with pytest.raises(SessionNotFoundError) as miss:
        other.forward(child, torch.zeros(1, 1, 16))
    assert miss.value.field == h.FORK and other.prefix_stats().hits == 0


@pytest.mark.parametrize(
    ("budget_mb", "layers", "max_cache_mb", "bound"),
    [
        (300, 30, 1024, "left"),  # K1's node: what the budget leaves beside the weights
        (90, 30, 1024, "left"),
        (60, 30, 1024, "reserve"),  # nothing left beside the weights: the KV reserve
        (8000, 10, 1024, "cap"),  # plenty: --max-kv-cache
    ],
)
def test_a_spans_caches_are_held_within_what_the_budget_leaves(
    budget_mb: int, layers: int, max_cache_mb: int, bound: str
) -> None:
    """Review K1: live sessions within the node's --budget (the default model under ggml,
    whose file holds a layer in about 2.1 MiB), kept prefixes within its KV reserve."""
    from meshnet.config import NodeConfig
    from meshnet.node.startup import kept_bytes, live_bytes, node_layer_bytes

    MB = 1 << 20
    config = NodeConfig(budget_bytes=budget_mb * MB, max_cache_bytes=max_cache_mb * MB)
    per_layer = node_layer_bytes(config)
    assert abs(per_layer - 2.1 * MB) < 0.1 * MB
    expected = {
        "left": budget_mb * MB - layers * per_layer,
        "reserve": budget_mb * MB // 10,
        "cap": max_cache_mb * MB,
    }[bound]
    assert live_bytes(config, config.model, LayerSpan(0, layers)) == expected
    assert kept_bytes(config) == min(max_cache_mb * MB, budget_mb * MB // 10)

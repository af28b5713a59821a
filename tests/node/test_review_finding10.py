"""Review finding 10 (wrong status or field): each case now refused where it starts, naming
what is at fault."""

from __future__ import annotations

import json

import httpx
import pytest
import torch

from meshnet.api.app import create_app
from meshnet.config import ApiLimits, WireLimits
from meshnet.entry.transport import hop_error
from meshnet.errors import LimitError, PayloadTooLargeError
from meshnet.node.sessions import SessionStore
from meshnet.types import Hop, LayerSpan, ModelId, NodeId, SessionId
from meshnet.wire import FrameMeta, decode, encode
from tests.conftest import run
from tests.entry.fakes import fake_mesh


def test_a_prompt_that_fills_the_context_is_refused_naming_the_messages() -> None:
    generator, _, _ = fake_mesh()  # a 4,096-token context, one token a character
    app = create_app({"fake": generator}, 256, limits=ApiLimits(max_prompt_tokens=8192))
    body = {"model": "fake", "messages": [{"role": "user", "content": "x" * 5000}]}

    async def go() -> httpx.Response:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://localhost") as c:
            return await c.post("/v1/chat/completions", json=body)

    refused = run(go())
    assert refused.status_code == 400, refused.text
    error = refused.json()["error"]
    assert error["field"] == "messages" and "no room" in error["message"]


def test_a_frame_is_bounded_in_tokens_not_only_bytes() -> None:
    meta = FrameMeta(SessionId("s"), ModelId("m"), LayerSpan(0, 2), 0)
    frame = encode(torch.zeros(7, 400, 8), meta)  # 2,800 tokens in 45 KB
    with pytest.raises(PayloadTooLargeError, match="2800 tokens") as refused:
        decode(frame.headers, bytes(frame.body), WireLimits())
    assert refused.value.field == "X-Meshnet-Shape"


def test_the_first_session_on_a_shard_is_held_to_the_cache_cap() -> None:
    store = SessionStore(lambda: None, lambda cache: 0, max_bytes=1000, bytes_per_token=100)
    meta = FrameMeta(SessionId("s"), ModelId("m"), LayerSpan(0, 2), 0)
    with pytest.raises(LimitError, match="KV cache is full"):
        store.checkout(meta, tokens=20)  # 2,000 bytes expected: refused before any is held


def test_a_hops_error_text_reaches_the_client_bounded() -> None:
    hop = Hop(NodeId("n"), "http://n:1", LayerSpan(0, 2))
    body = json.dumps({"error": {"message": "x" * 100_000, "field": None}}).encode()
    assert len(hop_error(hop, 400, body).message) < 500

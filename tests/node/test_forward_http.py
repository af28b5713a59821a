"""`POST /forward` over HTTP: good frames pass, bad ones get a JSON 4xx and change nothing."""

from __future__ import annotations

import httpx
import pytest
import torch
import zstandard

from meshnet.config import WireConfig, WireLimits
from meshnet.errors import MeshError
from meshnet.node.app import NodeService, create_app
from meshnet.node.runner import EchoRunner, Frame
from meshnet.node.scheduler import Failed
from meshnet.types import LayerSpan, ModelId
from meshnet.wire import FrameMeta, decode
from meshnet.wire import headers as h
from tests.conftest import run
from tests.owned import Sessions, encode, proof

SPAN = LayerSpan(0, 10)
SID = Sessions()
META = FrameMeta(SID["s1"], ModelId("default"), SPAN, position=0)
TENSOR = torch.randn(1, 4, 16)
GOOD = encode(TENSOR, META)


async def post(app: object, headers: dict[str, str], body: bytes) -> httpx.Response:
    transport = httpx.ASGITransport(app=app)  # type: ignore[arg-type]
    async with httpx.AsyncClient(transport=transport, base_url="http://node") as client:
        return await client.post("/forward", headers=headers, content=body)


def with_header(name: str, value: str) -> dict[str, str]:
    """GOOD's headers with one changed, signed again where they still make a frame (so
    that the node refuses what the header says, not a stale proof)."""
    headers = {**GOOD.headers, name: value}
    try:
        return headers | proof(h.parse_meta(h.lower_keys(headers)), TENSOR)
    except MeshError:
        return headers


BAD = [
    (with_header(h.SHAPE, "1,4"), bytes(GOOD.body), 400, h.SHAPE),
    (with_header(h.DTYPE, "float32"), bytes(GOOD.body), 400, h.DTYPE),
    (dict(GOOD.headers), bytes(GOOD.body)[:-2], 400, "body"),
    (with_header(h.ENCODING, "brotli"), bytes(GOOD.body), 415, h.ENCODING),
    (with_header(h.CHUNK_INDEX, "1"), bytes(GOOD.body), 400, h.CHUNK_INDEX),
    (with_header(h.VERSION, "99"), bytes(GOOD.body), 400, h.VERSION),
    (with_header(h.REWIND, "2"), bytes(GOOD.body), 400, h.REWIND),
    (with_header(h.REWIND, "yes"), bytes(GOOD.body), 400, h.REWIND),
    (with_header(h.LAYERS, "0:11"), bytes(GOOD.body), 400, h.LAYERS),
    (with_header(h.MODEL, "other"), bytes(GOOD.body), 400, h.LAYERS),
    (with_header(h.POSITION, "3"), bytes(GOOD.body), 409, "position"),
    (
        {**with_header(h.ENCODING, "zstd"), h.SHAPE: "1,1,16"},
        zstandard.ZstdCompressor(level=19).compress(bytes(1 << 26)),
        413,
        "body",
    ),
    (with_header(h.SHAPE, "1,4,1000000"), bytes(GOOD.body), 413, h.SHAPE),
]


@pytest.mark.parametrize(("headers", "body", "status", "field"), BAD)
def test_bad_frames_get_json_errors_and_change_nothing(
    headers: dict[str, str], body: bytes, status: int, field: str
) -> None:
    runner = EchoRunner(ModelId("default"), SPAN)
    app = create_app(runner, WireLimits(max_body_bytes=1 << 20, max_tensor_bytes=1 << 20))
    response = run(post(app, headers, body))
    assert response.status_code == status
    error = response.json()["error"]
    assert error["field"] == field and error["message"]
    assert response.headers[h.VERSION] == h.WIRE_VERSION  # the receiver's own version
    assert runner.session_count() == 0  # nothing kept from the refused request
    assert run(post(app, GOOD.headers, bytes(GOOD.body))).status_code == 200


def test_body_over_the_limit_is_refused_before_reading_it() -> None:
    app = create_app(EchoRunner(ModelId("default"), SPAN), WireLimits(max_body_bytes=64))
    response = run(post(app, GOOD.headers, bytes(GOOD.body)))
    assert response.status_code == 413
    assert response.json()["error"]["field"] == "body"


def test_good_frame_round_trips_through_http() -> None:
    app = create_app(EchoRunner(ModelId("default"), SPAN))
    x = torch.randn(1, 200, 576)
    frame = encode(x, META)
    response = run(post(app, frame.headers, bytes(frame.body)))
    assert response.status_code == 200
    assert response.headers[h.ENCODING] == "zstd-shuffle"
    meta, y = decode(response.headers, response.content)
    assert meta == META
    assert torch.equal(y, x.to(torch.bfloat16))


@pytest.mark.parametrize("sent", ["none", "zstd", "zstd-shuffle"])
def test_an_auto_node_answers_in_the_encoding_it_was_sent_and_says_its_hold(sent: str) -> None:
    """ADR-0037: the sender measured the link, so under `auto` the answer mirrors it; the
    hold time lets the sender take the hop's own time out of what it measured."""
    app = create_app(EchoRunner(ModelId("default"), SPAN))
    x = torch.randn(1, 200, 576)
    frame = encode(x, META, WireConfig(encoding=sent))
    response = run(post(app, frame.headers, bytes(frame.body)))
    assert response.status_code == 200
    assert response.headers.get(h.ENCODING, "none") == sent
    assert 0 <= float(response.headers[h.HOLD]) < 10_000  # ms
    assert torch.equal(decode(response.headers, response.content)[1], x.to(torch.bfloat16))


def test_chunk_totals_must_stay_consistent_within_a_session() -> None:
    app = create_app(EchoRunner(ModelId("default"), SPAN))
    x = torch.randn(1, 2, 16)
    first = encode(x, FrameMeta(META.session, META.model, SPAN, 0, 0, 3))
    assert run(post(app, first.headers, bytes(first.body))).status_code == 200
    wrong = encode(x, FrameMeta(META.session, META.model, SPAN, 2, 1, 4))
    response = run(post(app, wrong.headers, bytes(wrong.body)))
    assert response.status_code == 400
    assert response.json()["error"]["field"] == h.CHUNK_TOTAL
    right = encode(x, FrameMeta(META.session, META.model, SPAN, 2, 1, 3))
    assert run(post(app, right.headers, bytes(right.body))).status_code == 200


class SlowEcho(EchoRunner):
    """An echo runner whose forward pass takes `seconds` (a long prefill chunk)."""

    def __init__(self, seconds: float) -> None:
        super().__init__(ModelId("default"), SPAN)
        self.seconds = seconds

    def forward(self, meta: FrameMeta, hidden: torch.Tensor) -> torch.Tensor:
        import time

        time.sleep(self.seconds)
        return super().forward(meta, hidden)


def test_prefill_runs_off_the_event_loop_so_health_still_answers() -> None:
    import asyncio
    import time

    app = create_app(SlowEcho(0.5))
    frame = encode(torch.randn(1, 128, 16), META)

    async def scenario() -> tuple[float, float]:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://node") as client:
            start = time.perf_counter()
            forward = asyncio.create_task(
                client.post("/forward", headers=frame.headers, content=bytes(frame.body))
            )
            await asyncio.sleep(0.05)
            assert (await client.get("/health")).status_code == 200
            health_s = time.perf_counter() - start
            assert (await forward).status_code == 200
            return health_s, time.perf_counter() - start

    health_s, forward_s = run(scenario())
    assert health_s < 0.4 < forward_s  # health answered while the 0.5 s chunk was running


def test_non_finite_activations_are_refused_before_any_cache() -> None:
    runner = EchoRunner(ModelId("default"), SPAN)
    for value in (float("nan"), float("inf"), float("-inf")):
        x = torch.randn(1, 4, 16)
        x[0, 2, 5] = value
        frame = encode(x, META)
        response = run(post(create_app(runner), frame.headers, bytes(frame.body)))
        assert response.status_code == 400 and response.json()["error"]["field"] == "body"
    assert runner.session_count() == 0


def test_new_sessions_over_the_node_limit_get_429_and_old_ones_go_on() -> None:
    runner = EchoRunner(ModelId("default"), SPAN)
    service = NodeService([runner], WireLimits(), WireConfig(), max_sessions=2)
    app = create_app(service=service)
    for sid in ("s1", "s2"):
        frame = encode(torch.randn(1, 4, 16), FrameMeta(SID[sid], META.model, SPAN, 0))
        assert run(post(app, frame.headers, bytes(frame.body))).status_code == 200
    third = encode(torch.randn(1, 4, 16), FrameMeta(SID["s3"], META.model, SPAN, 0))
    refused = run(post(app, third.headers, bytes(third.body)))
    assert refused.status_code == 429 and refused.headers["Retry-After"] == "1"
    assert refused.json()["error"]["code"] == "rate_limit_exceeded"
    step = encode(torch.randn(1, 1, 16), FrameMeta(SID["s1"], META.model, SPAN, 4))
    assert run(post(app, step.headers, bytes(step.body))).status_code == 200
    assert runner.session_count() == 2 and service.refused_sessions == 1


class BatchingEcho(SlowEcho):
    """A slow echo runner that records how many frames each `forward_many` call took."""

    def __init__(self) -> None:
        super().__init__(0.02)
        self.batches: list[int] = []

    def forward_many(self, frames: list[Frame]) -> list[torch.Tensor | Failed]:
        self.batches.append(len(frames))
        return super().forward_many(frames)


def test_decode_frames_of_concurrent_sessions_share_a_batch_and_answer_their_own() -> None:
    """Six sessions send a decode step at once; one of them at the wrong position. The
    others run as one call and each response carries its own session's activations; the
    wrong one gets its 409 alone."""
    import asyncio

    runner = BatchingEcho()
    service = NodeService([runner], WireLimits(), WireConfig(), batch_wait_s=0.05)
    app = create_app(service=service)
    sessions = [SID[f"s{i}"] for i in range(6)]

    async def scenario() -> list[httpx.Response]:
        for sid in sessions:  # prefill: 4 tokens each, alone
            frame = encode(torch.randn(1, 4, 16), FrameMeta(sid, META.model, SPAN, 0))
            assert (await post(app, frame.headers, bytes(frame.body))).status_code == 200
        steps = [
            encode(
                torch.full((1, 1, 16), float(i)),
                FrameMeta(sid, META.model, SPAN, 3 if i == 5 else 4),
            )
            for i, sid in enumerate(sessions)
        ]
        first = asyncio.create_task(post(app, steps[0].headers, bytes(steps[0].body)))
        await asyncio.sleep(0.005)  # its round is running: the rest queue behind it
        rest = [post(app, s.headers, bytes(s.body)) for s in steps[1:]]
        return [await first, *await asyncio.gather(*rest)]

    answers = run(scenario())
    assert [a.status_code for a in answers] == [200] * 5 + [409]
    assert answers[5].json()["error"]["field"] == "position"
    for i, answer in enumerate(answers[:5]):
        _, hidden = decode(answer.headers, answer.content, WireLimits())
        assert torch.equal(hidden, torch.full((1, 1, 16), float(i)).bfloat16())
    assert runner.batches[-2:] == [1, 5]  # the first alone, then the other five together
    assert runner.session_count() == 6


def test_session_limit_holds_while_steps_are_batched() -> None:
    import asyncio

    runner = BatchingEcho()
    service = NodeService([runner], WireLimits(), WireConfig(), max_sessions=3)
    app = create_app(service=service)

    async def scenario() -> list[int]:
        frames = [
            encode(torch.randn(1, 1, 16), FrameMeta(SID[f"n{i}"], META.model, SPAN, 0))
            for i in range(5)
        ]
        answers = await asyncio.gather(*(post(app, f.headers, bytes(f.body)) for f in frames))
        return [a.status_code for a in answers]

    codes = run(scenario())  # five new sessions at once: their places are held before any cache
    assert sorted(codes) == [200, 200, 200, 429, 429]
    assert runner.session_count() == 3 and service.refused_sessions == 2

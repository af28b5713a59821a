"""Answers a faulty or hostile hop may send, and what the entry does with them (review
finding 3): another shape, session or position fails over like a dead hop and the user sees
the reference output; a huge or gzip-bombed body is refused without being read whole."""

from __future__ import annotations

import asyncio
import gzip
from collections.abc import Callable
from dataclasses import replace

import pytest
import torch
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response

from meshnet.config import AccessConfig, WireLimits
from meshnet.entry.routes import StaticRoutes
from meshnet.entry.transport import HttpTransport, checked_output
from meshnet.errors import HopError
from meshnet.node.app import create_app as create_node_app
from meshnet.node.runner import EchoRunner, Frame, one_by_one
from meshnet.node.scheduler import Failed
from meshnet.node.sessions import PrefixStats
from meshnet.security.signing import Signer
from meshnet.types import Hop, LayerSpan, ModelId, NodeId, SessionId
from meshnet.wire import FrameMeta, encode
from tests.conftest import run
from tests.entry.fakes import fake_mesh
from tests.entry.test_failover import PARAMS, PROMPT, Poisoned, failure_free
from tests.entry.test_generation import collect
from tests.owned import new_session

Twist = Callable[[FrameMeta, torch.Tensor], tuple[FrameMeta, torch.Tensor]]

SESSION = new_session()  # this process's entry signs for it (ADR-0049)


class Lying:
    """Runs like its echo runner, but from `position` on its answer is twisted."""

    def __init__(self, runner: EchoRunner, position: int, twist: Twist) -> None:
        self.runner, self.position, self.twist = runner, position, twist
        self.model, self.span = runner.model, runner.span

    def forward(self, meta: FrameMeta, hidden: torch.Tensor) -> torch.Tensor:
        out = self.runner.forward(meta, hidden)
        return out if meta.position < self.position else self.twist(meta, out)[1]

    def forward_many(self, frames: list[Frame]) -> list[torch.Tensor | Failed]:
        return one_by_one(self.forward, frames)

    def drop(self, session: str, keep: bool = False) -> bool:
        return self.runner.drop(SessionId(session), keep)

    def session_count(self) -> int:
        return self.runner.session_count()

    def prefix_stats(self) -> PrefixStats:
        return self.runner.prefix_stats()


@pytest.mark.parametrize(
    "twist",
    [
        lambda m, h: (m, h[..., :7]),  # (1, 1, 7) for a (1, 1, 8) step
        lambda m, h: (m, h.repeat(4, 30, 1)),  # (4, 30, 8)
    ],
    ids=["narrow", "wide"],
)
def test_an_answer_of_another_shape_is_that_hops_failure(twist: Twist) -> None:
    generator, transport, runners = fake_mesh(chunk_tokens=16, replicas=True)
    transport.runners = {**runners, "a": Lying(runners["a"], 55, twist)}  # type: ignore[dict-item]
    text, end = run(collect(generator, PROMPT, PARAMS))
    assert text == failure_free()  # neither the next hop nor the head saw the bad answer
    assert [h.node_id for h in end.route][1:] == ["node-a2", "node-b"]
    routes = generator.pipeline.hops.routes
    assert isinstance(routes, StaticRoutes) and routes.reported == ["node-a"]


def ask(
    app: Starlette, limits: WireLimits, signer: Signer | None = None, node_id: str = "liar"
) -> HopError | torch.Tensor:
    """One frame to the fake hop over the real transport; the `HopError` it ended in (or
    the answer, when it did not)."""

    async def scenario() -> HopError | torch.Tensor:
        server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
        task = asyncio.create_task(server.serve())
        while not server.started:
            await asyncio.sleep(0.01)
        port = server.servers[0].sockets[0].getsockname()[1]
        transport = HttpTransport(limits=limits, signer=signer)
        hop = Hop(NodeId(node_id), f"http://127.0.0.1:{port}", LayerSpan(2, 4))
        meta = FrameMeta(SESSION, ModelId("m"), LayerSpan(2, 4), 0)
        try:
            return await transport.forward(hop, meta, torch.ones(1, 3, 8))
        except HopError as failed:
            return failed
        finally:
            await transport.aclose()
            server.should_exit = True
            await task

    return run(scenario())


def refused(app: Starlette, limits: WireLimits, **kwargs: object) -> HopError:
    error = ask(app, limits, **kwargs)  # type: ignore[arg-type]
    assert isinstance(error, HopError)
    return error


def answer_frame(hidden: torch.Tensor, meta: FrameMeta) -> tuple[dict[str, str], bytes]:
    frame = encode(hidden, meta)
    return dict(frame.headers), bytes(frame.body)


def test_an_answer_over_the_body_cap_is_refused_as_the_hops_failure() -> None:
    meta = FrameMeta(SESSION, ModelId("m"), LayerSpan(2, 4), 0)
    headers, body = answer_frame(torch.ones(1, 3000, 8), meta)  # 48 KB for a 48-byte step
    app = Starlette()

    async def forward(request: Request) -> Response:
        await request.body()
        return Response(body, headers=headers, media_type="application/octet-stream")

    app.add_route("/forward", forward, methods=["POST"])
    error = refused(app, WireLimits(max_body_bytes=4096, max_tensor_bytes=4096))
    assert error.hop is not None and error.hop.node_id == "liar" and "cap 4096" in error.message


def test_a_gzip_bomb_is_never_inflated() -> None:
    """149 KB of gzip became 150 MiB before: now the frame is read as sent, and refused."""
    bomb = gzip.compress(b"\0" * (150 << 20), compresslevel=9)
    app = Starlette()

    async def forward(request: Request) -> Response:
        await request.body()
        headers = {"Content-Encoding": "gzip", "X-Meshnet-Shape": "1,3,8"}
        return Response(bomb, headers=headers, media_type="application/octet-stream")

    app.add_route("/forward", forward, methods=["POST"])
    error = refused(app, WireLimits())
    assert len(bomb) < 200_000
    assert error.hop is not None and "bad frame" in error.message  # not inflated, malformed


@pytest.mark.parametrize(
    "change",
    [{"session": SessionId("other")}, {"position": 7}, {"span": LayerSpan(2, 3)}],
    ids=["session", "position", "layers"],
)
def test_an_answer_for_another_session_position_or_span_is_refused(
    change: dict[str, object],
) -> None:
    sent = FrameMeta(SESSION, ModelId("m"), LayerSpan(2, 4), 0)
    hidden = torch.ones(1, 3, 8)
    hop = Hop(NodeId("liar"), "http://liar:1", LayerSpan(2, 4))
    honest = checked_output(hop, *answer_frame(hidden, sent), WireLimits(), sent, hidden)
    assert honest.shape == (1, 3, 8)
    lie = replace(sent, **change)
    with pytest.raises(HopError, match="bad frame"):
        checked_output(hop, *answer_frame(hidden, lie), WireLimits(), sent, hidden)


def test_a_real_http_hop_answering_nan_is_that_hops_failure() -> None:
    """Over the real transport: the entry refuses the frame and blames the hop that sent it."""
    runner = Poisoned(EchoRunner(ModelId("m"), LayerSpan(2, 4)), 0, float("nan"))
    error = refused(create_node_app(runner), WireLimits())  # type: ignore[arg-type]
    assert error.hop is not None and error.hop.node_id == "liar"
    assert "NaN or Inf" in error.message


KEY = "hostile-hop-swarm-key-padded-to-128-bits-0123456789"


def test_a_hop_that_signs_its_answers_is_believed() -> None:
    signed = create_node_app(EchoRunner(ModelId("m"), LayerSpan(2, 4)), access=AccessConfig(KEY))
    out = ask(signed, WireLimits(), Signer(KEY), node_id="unregistered")
    assert isinstance(out, torch.Tensor) and out.shape == (1, 3, 8)
    misaddressed = refused(signed, WireLimits(), signer=Signer(KEY), node_id="node-b")
    assert misaddressed.status == 401  # the proof named another node: a stale route, failover


def test_an_unsigned_answer_is_that_hops_failure() -> None:
    """A man in the middle (or a hop without the key) answering a well-formed frame."""
    app = Starlette()

    async def forward(request: Request) -> Response:
        meta = FrameMeta(SESSION, ModelId("m"), LayerSpan(2, 4), 0)
        headers, body = answer_frame(torch.ones(1, 3, 8), meta)
        await request.body()
        return Response(body, headers=headers, media_type="application/octet-stream")

    app.add_route("/forward", forward, methods=["POST"])
    error = refused(app, WireLimits(), signer=Signer(KEY))
    assert error.hop is not None and "X-Meshnet-Answer" in error.message

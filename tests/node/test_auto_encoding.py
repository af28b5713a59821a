"""`auto` encoding over real links (ADR-0037): two echo hops under uvicorn, one reached
directly over loopback and one through a `LinkProxy` pacing bytes at 16 Mbit/s. After a
decode step (the round trip) and a few prefill chunks (the rate), each sender compresses
for the slow hop only, and each hop answers in the encoding it was sent."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from meshnet.config import AccessConfig, WireConfig, WireLimits
from meshnet.entry.transport import HttpTransport
from meshnet.node.app import NodeService, create_app
from meshnet.node.runner import EchoRunner
from meshnet.security.signing import Signer
from meshnet.types import Hop, LayerSpan, ModelId, NodeId
from meshnet.wire import FrameMeta
from meshnet.wire.links import LinkRates
from tests.conftest import run
from tests.e2e.slowlink import Link, LinkProxy
from tests.owned import new_session
from tests.security.test_server import serving

KEY = "auto-encoding-test-key-0123456789abcdef"
MODEL = ModelId("m")
SPAN = LayerSpan(10, 20)
SLOW_BPS = 16e6  # the proxied link
# between the two links: loopback in one process measures hundreds of MB/s, the proxy 2 MB/s
WIRE = WireConfig(auto_compress_below_mbit_s=100.0)


@contextlib.contextmanager
def hop(name: str, link: Link | None) -> Iterator[tuple[Hop, NodeService]]:
    service = NodeService(
        [EchoRunner(MODEL, SPAN)], WireLimits(), WIRE, node_id=name, signer=Signer(KEY)
    )
    app = create_app(service=service, access=AccessConfig(swarm_key=KEY))
    with serving(app) as port:
        if link is not None:
            port = LinkProxy(port, link).port
        yield Hop(NodeId(name), f"http://127.0.0.1:{port}", SPAN), service


def received(service: NodeService, encoding: str) -> float:
    return float(service.metrics.bytes_received.labels(encoding)._value.get())


async def traffic(transport: HttpTransport, hops: list[Hop], session: str, chunks: int) -> None:
    """Into each hop, a decode step and then `chunks` 128-token prefill chunks."""
    step, chunk = torch.randn(1, 1, 576), torch.randn(1, 128, 576)
    try:
        for target in hops:
            meta = FrameMeta(new_session(), MODEL, SPAN, 0)
            await transport.forward(target, meta, step)
            for i in range(chunks):
                at = FrameMeta(meta.session, MODEL, SPAN, 1 + 128 * i)
                assert torch.equal(await transport.forward(target, at, chunk), chunk.bfloat16())
    finally:
        await transport.aclose()


def test_auto_compresses_for_the_slow_link_only_and_answers_mirror_the_request() -> None:
    links = LinkRates()
    transport = HttpTransport(WIRE, signer=Signer(KEY), links=links)
    with hop("fast", None) as (fast, fast_node), hop("slow", Link(0.001, SLOW_BPS)) as slow_pair:
        slow, slow_node = slow_pair
        run(traffic(transport, [fast, slow], "a", chunks=2))
        before = {n: received(s, "zstd-shuffle") for n, s in [("f", fast_node), ("s", slow_node)]}
        run(traffic(transport, [fast, slow], "b", chunks=3))
        fast_rate, slow_rate = links.bytes_per_s("fast"), links.bytes_per_s("slow")
        assert fast_rate is not None and slow_rate is not None
        assert 0.5 * SLOW_BPS / 8 < slow_rate < 1.5 * SLOW_BPS / 8  # what the proxy paces
        assert fast_rate > 50 * slow_rate
        # once measured: the slow hop gets (and answers) compressed chunks, the fast one raw
        assert received(slow_node, "zstd-shuffle") - before["s"] > 3 * 128 * 576
        assert received(fast_node, "zstd-shuffle") == before["f"]
        assert received(fast_node, "none") >= 3 * 128 * 576 * 2
        sent = transport.metrics.bytes_received
        assert sent.labels("zstd-shuffle")._value.get() > 3 * 128 * 576  # the slow hop's answers

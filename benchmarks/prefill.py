"""Pipelined prefill against one chunk at a time, on emulated independent machines.

    python benchmarks/prefill.py          # 512 and 2048 tokens, 0 / 5 ms, 100 Mbit/s
    python benchmarks/prefill.py --tiny   # what the tests run

`benchmarks/wan.py` runs real stages, but on one machine: its three processes share two
cores, so overlapping them cannot show what separate machines would. Here the entry's real
`Pipeline` (its prefill scheduling, queues, chunk numbering) drives stages whose compute is
emulated: each stage is its own "machine" that takes `chunk_ms` per 128 tokens, one frame
at a time, and each leg between the entry and a hop costs `delay` plus serialization at the
link rate. So the table isolates what the design gets out of overlap, against a pipeline's
bound (`bound_ms`: the stages' chunk times once, then the slowest stage's per further
chunk; a relayed hop's chunk time is its compute and its two legs), with the entry's span in
pieces of 128, 256 and 512 tokens.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

import torch

from meshnet.config import EntryConfig, WireConfig, WireLimits
from meshnet.entry.pipeline import Pipeline
from meshnet.entry.routes import StaticRoutes
from meshnet.node.app import NodeService
from meshnet.node.runner import EchoRunner, Frame
from meshnet.node.scheduler import Failed
from meshnet.types import Hop, LayerSpan, ModelId, NodeId
from meshnet.wire import FrameMeta

MODEL, HIDDEN, CHUNK = ModelId("emulated"), 576, 128
BYTES_PER_TOKEN = HIDDEN * 2  # bf16 on the wire


class SlowRunner(EchoRunner):
    """The entry's span: `chunk_ms` of (sleeping) compute per 128 tokens, on its thread."""

    def __init__(self, span: LayerSpan, chunk_ms: float) -> None:
        super().__init__(MODEL, span)
        self.chunk_ms = chunk_ms

    def forward(self, meta: FrameMeta, hidden: torch.Tensor) -> torch.Tensor:
        time.sleep(self.chunk_ms / 1000 * hidden.shape[1] / CHUNK)
        return super().forward(meta, hidden)

    def forward_many(self, frames: list[Frame]) -> list[torch.Tensor | Failed]:
        return [self.forward(*frame) for frame in frames]


class EmulatedLinks:
    """Remote hops on their own machines: one frame at a time each, behind slow links."""

    def __init__(self, chunk_ms: float, delay_ms: float, rate_bps: float | None) -> None:
        self.chunk_ms, self.delay_ms, self.rate_bps = chunk_ms, delay_ms, rate_bps
        self.runners: dict[str, EchoRunner] = {}
        self.busy: dict[str, asyncio.Lock] = {}

    def leg_s(self, tokens: int) -> float:
        serialization = tokens * BYTES_PER_TOKEN * 8 / self.rate_bps if self.rate_bps else 0.0
        return self.delay_ms / 1000 + serialization

    async def forward(self, hop: Hop, meta: FrameMeta, hidden: torch.Tensor) -> torch.Tensor:
        tokens = hidden.shape[1]
        await asyncio.sleep(self.leg_s(tokens))
        runner = self.runners.setdefault(hop.address, EchoRunner(MODEL, hop.span))
        async with self.busy.setdefault(hop.address, asyncio.Lock()):
            await asyncio.sleep(self.chunk_ms / 1000 * tokens / CHUNK)
            out = runner.forward(meta, hidden)
        await asyncio.sleep(self.leg_s(tokens))
        return out

    async def push(self, hops: list[Hop], meta: FrameMeta, hidden: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError("this benchmark relays")

    async def close_session(self, hop: Hop, session: object, keep: bool = False) -> None:
        if hop.address in self.runners:
            self.runners[hop.address].drop(session, keep)  # type: ignore[arg-type]


class Head:
    def embed_tokens(self, ids: torch.Tensor, position: int) -> torch.Tensor:
        return torch.zeros(*ids.shape, HIDDEN, dtype=torch.bfloat16)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return torch.zeros(*hidden.shape[:-1], 8)


async def prefill_s(
    tokens: int, chunk_ms: float, links: EmulatedLinks, pipelined: bool, piece: int
) -> float:
    """Seconds for one `tokens`-token prompt through entry 0:10 and hops 10:20, 20:30."""
    local = SlowRunner(LayerSpan(0, 10), chunk_ms)
    hops = [Hop(NodeId(f"n{i}"), f"n{i}", LayerSpan(10 * i, 10 * i + 10)) for i in (1, 2)]
    wire = WireConfig(chunk_tokens=CHUNK)
    pipeline = Pipeline(
        MODEL, 30, Head(), local, NodeService([local], WireLimits(), wire), StaticRoutes(hops),
        links, wire,
        config=EntryConfig(pipelined_prefill=pipelined, prefill_piece_tokens=piece),
    )  # fmt: skip
    session = await pipeline.open()
    started = time.perf_counter()
    await pipeline.feed(session, [1] * tokens, lambda logits: 0)
    took = time.perf_counter() - started
    await pipeline.close(session)
    return took


def bound_ms(tokens: int, chunk_ms: float, links: EmulatedLinks) -> float:
    """A pipeline's time: every stage's chunk time once (the first chunk's way through),
    then the slowest stage's for each further chunk. A relayed hop's chunk time is its
    compute plus its two legs (the entry sends it a chunk once it answered the last)."""
    chunks, hops = -(-tokens // CHUNK), 2
    hop_ms = chunk_ms + 2 * 1000 * links.leg_s(CHUNK)
    return chunk_ms + hops * hop_ms + (chunks - 1) * max(chunk_ms, hop_ms)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--chunk-ms", type=float, default=60.0, help="compute per chunk, stage")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    lengths, delays, pieces = [512, 2048], [0.0, 5.0, 25.0], [128, 256, 512]
    if args.tiny:
        lengths, delays, pieces = [512], [5.0], [256]
    chunk_ms = 5.0 if args.tiny else args.chunk_ms
    repeats = 1 if args.tiny else args.repeats
    print(
        "| tokens | one-way delay | link | one at a time ms | pipelined ms (piece) | bound "
        "| x bound | speedup |"
    )
    print("|---:|---:|---|---:|---:|---:|---:|---:|")
    for tokens in lengths:
        for delay in delays:
            links = EmulatedLinks(chunk_ms, delay, 100e6)
            one = statistics.median(
                asyncio.run(prefill_s(tokens, chunk_ms, links, False, 512)) for _ in range(repeats)
            )
            bound = bound_ms(tokens, chunk_ms, links)
            for piece in pieces:
                ms = 1000 * statistics.median(
                    asyncio.run(prefill_s(tokens, chunk_ms, links, True, piece))
                    for _ in range(repeats)
                )
                print(
                    f"| {tokens} | {delay:.0f} ms | 100 Mbit/s | {1000 * one:.0f} | {ms:.0f} "
                    f"({piece}) | {bound:.0f} | {ms / bound:.2f} | {1000 * one / ms:.2f}x |",
                    flush=True,
                )


if __name__ == "__main__":
    main()

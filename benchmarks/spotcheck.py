"""What integrity spot checks cost, and how fast they catch a lying copy.

    python benchmarks/spotcheck.py          # rates 0, 0.02, 0.1, 0.5; 64 tokens; 3 repeats
    python benchmarks/spotcheck.py --tiny   # rates 0 and 1, 8 tokens (what the tests run)

One process, the default model at this CPU's default weights: an entry span 0:10 and
copies of 10:20 and 20:30 (three of 20:30), as in-process hops over the real wire format,
so a check's compute on another copy runs on the same cores as the generation: the drop
in tokens/s is what the checks cost the mesh. "re-run per token" counts the tokens the
checks made other copies compute, per generated token. Then one copy of 20:30 (the one on
the route) lies, adding noise of 30% of its answer's scale: "tokens to ban" is how many
tokens a generation had produced when a check banned it. Medians of `--repeats`.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import time

import torch

from meshnet.assemble.entry import load_entry_model
from meshnet.config import NodeConfig, WireConfig, WireLimits
from meshnet.entry.bans import Bans
from meshnet.entry.generation import Generator
from meshnet.entry.pipeline import Pipeline
from meshnet.entry.routes import StaticRoutes
from meshnet.entry.spotcheck import SpotChecker
from meshnet.entry.transport import InProcessTransport
from meshnet.node.app import NodeService
from meshnet.node.runner import Frame, ShardRunner, one_by_one
from meshnet.node.scheduler import Failed
from meshnet.node.startup import load_runner
from meshnet.text.events import Delta, Finished
from meshnet.text.params import GenerationParams, SamplingParams
from meshnet.types import Hop, LayerSpan, NodeId
from meshnet.wire import FrameMeta

SPANS = {"a": (10, 20), "a2": (10, 20), "b": (20, 30), "b2": (20, 30), "b3": (20, 30)}
PROMPT = [{"role": "user", "content": "Write a short story about a lighthouse keeper."}]


class Noisy:
    """A copy that answers its runner's output plus noise of `scale` times its spread."""

    def __init__(self, runner: ShardRunner, scale: float) -> None:
        self.runner, self.scale = runner, scale
        self.model, self.span = runner.model, runner.span

    def forward(self, meta: FrameMeta, hidden: torch.Tensor) -> torch.Tensor:
        out = self.runner.forward(meta, hidden)
        return out + self.scale * out.float().std() * torch.randn_like(out.float())

    def forward_many(self, frames: list[Frame]) -> list[torch.Tensor | Failed]:
        return one_by_one(self.forward, frames)

    def drop(self, session: str) -> bool:
        return self.runner.drop(session)  # type: ignore[arg-type]

    def session_count(self) -> int:
        return self.runner.session_count()


def build(
    rate: float, runners: dict[str, ShardRunner], entry: object
) -> tuple[Generator, SpotChecker]:
    quant = entry.runner.shard.quant  # type: ignore[attr-defined]  # every copy's, as told by a tracker
    hops = [Hop(NodeId(f"node-{n}"), n, LayerSpan(*s), quant) for n, s in SPANS.items()]
    wire = WireConfig()
    service = NodeService([entry.runner], WireLimits(), wire)  # type: ignore[attr-defined]
    checker = SpotChecker(rate, random.Random(1), Bans(ban_s=3600.0))
    pipeline = Pipeline(
        entry.runner.model,  # type: ignore[attr-defined]
        30,
        entry.head,  # type: ignore[attr-defined]
        entry.runner,  # type: ignore[attr-defined]
        service,
        StaticRoutes(hops),
        InProcessTransport(runners, wire),
        wire,
        spot_checker=checker,
    )
    generator = Generator(pipeline, entry.codec, 2048, random.Random(0))  # type: ignore[attr-defined]
    return generator, checker


async def generate(
    generator: Generator, checker: SpotChecker, tokens: int
) -> tuple[float, int, int]:
    """Seconds for one greedy generation of up to `tokens` (its checks included), the tokens
    it made, and how many it had made when the first ban fell (0: none)."""
    params = GenerationParams(max_tokens=tokens, sampling=SamplingParams(temperature=0.0))
    ids = generator.codec.chat(PROMPT)
    made, banned_at = 0, 0
    start = time.perf_counter()
    async for event in generator.stream(ids, params):
        if isinstance(event, Finished):
            made = event.completion_tokens
        elif not banned_at and checker.bans.active():
            banned_at = made + 1
        made += isinstance(event, Delta)
    await checker.drain()
    if not banned_at and checker.bans.active():
        banned_at = made
    return time.perf_counter() - start, made, banned_at


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    tokens, repeats = (8, 1) if args.tiny else (args.tokens, args.repeats)
    rates = [0.0, 1.0] if args.tiny else [0.0, 0.02, 0.1, 0.5]
    torch.manual_seed(0)
    config = NodeConfig(model="default")
    entry = load_entry_model(config, "default", "default", LayerSpan(0, 10))
    runners = {
        n: load_runner(config, "default", "default", LayerSpan(*s)) for n, s in SPANS.items()
    }
    print("| rate | tokens/s | vs rate 0 | checks | re-run per token |")
    print("|---:|---:|---:|---:|---:|")
    base = None
    for rate in rates:
        times, checks, rerun = [], 0, 0
        for _ in range(repeats):
            generator, checker = build(rate, runners, entry)
            took, made, _ = asyncio.run(generate(generator, checker, tokens))
            times.append(took / made)
            rerun += checker.tokens_rerun
            checks += checker.checks_run
        speed = 1 / statistics.median(times)
        base = base or speed
        print(
            f"| {rate} | {speed:.1f} | {speed / base:.2f} | {checks / repeats:.1f} | "
            f"{rerun / repeats / tokens:.1f} |"
        )
    print()
    print("| rate | liar banned | honest banned | tokens to ban |")
    print("|---:|---|---|---:|")
    for rate in rates[1:]:
        lying = {**runners, "b": Noisy(runners["b"], 0.3)}
        generator, checker = build(rate, lying, entry)  # type: ignore[arg-type]
        _, _, at = asyncio.run(generate(generator, checker, tokens))
        banned = checker.bans.active()
        honest = sorted(n for n in banned if n != "node-b")
        print(f"| {rate} | {'node-b' in banned} | {honest or 'none'} | {at or '-'} |")


if __name__ == "__main__":
    main()

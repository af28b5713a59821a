"""A model-free entry node: a counting head, echo runners, in-process hops, a char codec.

The fake head embeds token id `i` as a vector whose first element is `i`; echo runners pass
it through unchanged (over the real wire format); the head's logits then favour `i + 1`, so
the "model" continues any text with the next characters of the alphabet, and id 0 (reached
after 127) ends the sequence.

Echo runners cannot show a wrong cache: their output is their input. With `context=True`
each hop is a `ContextRunner` instead, whose output depends on every token its cache holds,
and the `ContextHead` reads that into its logits, so a token too many or too few in any
cache, or a hop skipped, changes the logprobs (the greedy text stays the alphabet).
"""

from __future__ import annotations

import random
from dataclasses import replace

import torch

from meshnet.config import EntryConfig, RetryPolicy, WireConfig, WireLimits
from meshnet.entry.generation import Generator
from meshnet.entry.pipeline import Pipeline
from meshnet.entry.routes import StaticRoutes
from meshnet.entry.spotcheck import SpotChecker
from meshnet.entry.transport import InProcessTransport
from meshnet.node.app import NodeService
from meshnet.node.runner import EchoRunner
from meshnet.text.codec import CharCodec
from meshnet.text.events import Delta, Event, Finished
from meshnet.text.params import GenerationParams
from meshnet.types import Hop, LayerSpan, ModelId, NodeId, SessionId
from meshnet.wire import FrameMeta

VOCAB = 128
HIDDEN = 8
MODEL = ModelId("fake")
DIGEST = 7  # a context runner adds (sum of the ids its cache holds) mod DIGEST to element 1
CONTEXT_MARGIN = 2.0  # small: a logprob near 0 would not show the context (float32)
HOP_OFFSET = 10.0  # and this times its span's end to elements 2: (that no head reads)


class CountingHead:
    """Embeds id i as [i, 0, ...]; predicts i + 1 (mod VOCAB) with a margin of `margin`."""

    def __init__(self, margin: float = 20.0) -> None:
        self.margin = margin

    def embed_tokens(self, ids: torch.Tensor, position: int) -> torch.Tensor:
        hidden = torch.zeros(*ids.shape, HIDDEN)
        hidden[..., 0] = ids.float()
        return hidden

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        ids = hidden[..., 0].float().round().long()
        out = torch.zeros(*ids.shape, VOCAB)
        out.scatter_(-1, ((ids + 1) % VOCAB).unsqueeze(-1), self.margin)
        return out


class ContextRunner(EchoRunner):
    """An echo runner whose rows depend on its cache, as a model's do: row r gets, added to
    element 1, the sum of the ids (element 0) of every token the session holds up to and
    including r, mod `DIGEST`, and a per-hop offset to the elements no head reads. Rewinds
    drop tokens and forks copy them as a cache would."""

    def __init__(self, model: ModelId, span: LayerSpan) -> None:
        super().__init__(model, span)
        self.context: dict[SessionId, list[int]] = {}

    def forward(self, meta: FrameMeta, hidden: torch.Tensor) -> torch.Tensor:
        new = meta.session not in self._sessions
        held = self.context.get(meta.fork) if new and meta.fork else None
        out = super().forward(meta, hidden).clone()  # refuses, changing nothing, as it did
        if held is None:
            held = [] if new else self.context[meta.session]
        ids = held[: meta.position] + hidden[0, :, 0].float().round().long().tolist()
        self.context[meta.session] = ids
        sums = torch.tensor(ids).cumsum(0)[meta.position :] % DIGEST
        out[0, :, 1] += sums.to(out.dtype)
        out[0, :, 2:] += HOP_OFFSET * self.span.end  # an answer is never its input
        return out

    def drop(self, session: SessionId, keep: bool = False) -> bool:
        if not keep:
            self.context.pop(session, None)
        return super().drop(session, keep)


class ContextHead(CountingHead):
    """The counting head's choice, with a margin of `CONTEXT_MARGIN` plus a quarter of the
    context runners' sums in element 1 (three hops adding `s` each: `3s`; one skipped:
    `2s`). Greedy text stays the alphabet (so prompt lookup still drafts); the logprobs
    show what every cache held."""

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        ids = hidden[..., 0].float().round().long()
        margin = CONTEXT_MARGIN + 0.25 * hidden[..., 1].float().round()
        out = torch.zeros(*ids.shape, VOCAB)
        out.scatter_(-1, ((ids + 1) % VOCAB).unsqueeze(-1), margin.unsqueeze(-1))
        return out


async def events_of(generator: Generator, prompt: str, params: GenerationParams) -> list[Event]:
    """Every event of one request for `prompt`, in order."""
    return [e async for e in generator.stream(generator.codec.encode(prompt), params)]


async def scored(
    generator: Generator, prompt: str, params: GenerationParams
) -> tuple[str, Finished, list[float]]:
    """One answer's text, end and each token's logprob (asked for here): over context
    runners the logprobs show what every cache held when each token was chosen."""
    events = await events_of(generator, prompt, replace(params, logprobs=params.logprobs or 0))
    end = events[-1]
    assert isinstance(end, Finished)
    text = "".join(e.text for e in events if isinstance(e, Delta))
    return text, end, [s.logprob for e in events for s in getattr(e, "logprobs", ())]


def fake_mesh(
    margin: float = 20.0,
    chunk_tokens: int = 128,
    replicas: bool = False,
    copies: tuple[str, ...] = (),
    spot_checker: SpotChecker | None = None,
    push: bool = False,
    pipelined: bool = True,
    piece_tokens: int = 512,
    max_drafts: int = 0,
    head: object | None = None,
    context: bool = False,
    prefix_sharing: str = "client",
) -> tuple[Generator, InProcessTransport, dict[str, EchoRunner]]:
    """A generator over an entry span 0:2 and two echo hops 2:4 and 4:6 (in-process).

    With `replicas`, hops a2 (2:4) and b2 (4:6) stand by for failover; `copies` adds more
    (`a3`: another copy of 2:4, `b3` of 4:6). With `push`, steps go through the whole
    route as one `Transport.push` call (ADR-0034); `pipelined` prompts overlap across the
    hops (ADR-0036), the entry's span running them in pieces of `piece_tokens`; with
    `max_drafts`, prompt-lookup speculation (ADR-0038); `head` replaces the counting head;
    `context` makes every runner a `ContextRunner` read by a `ContextHead`.
    """
    runner = ContextRunner if context else EchoRunner
    local = runner(MODEL, LayerSpan(0, 2))
    spans = {"a": LayerSpan(2, 4), "b": LayerSpan(4, 6)}
    if replicas:
        spans |= {"a2": LayerSpan(2, 4), "b2": LayerSpan(4, 6)}
    spans |= {name: spans[name[0]] for name in copies}
    runners = {name: runner(MODEL, span) for name, span in spans.items()}
    hops = [Hop(NodeId(f"node-{name}"), name, span) for name, span in spans.items()]
    wire = WireConfig(chunk_tokens=chunk_tokens)
    transport = InProcessTransport(runners, wire)
    service = NodeService([local], WireLimits(), wire)
    retry = RetryPolicy(max_attempts=3, base_s=0.001, cap_s=0.002)
    pipeline = Pipeline(
        MODEL,
        6,
        head or (ContextHead if context else CountingHead)(margin),
        local,
        service,
        StaticRoutes(hops),
        transport,
        wire,
        config=EntryConfig(
            retry=retry,
            push=push,
            pipelined_prefill=pipelined,
            prefill_piece_tokens=piece_tokens,
            prefix_sharing=prefix_sharing,
        ),
        spot_checker=spot_checker,
    )
    runners["local"] = local
    generator = Generator(pipeline, CharCodec(), 4096, random.Random(0), max_drafts=max_drafts)
    return generator, transport, runners

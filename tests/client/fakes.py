"""A model-free entry node: a counting head, echo runners, in-process hops, a char codec.

The fake head embeds token id `i` as a vector whose first element is `i`; echo runners pass
it through unchanged (over the real wire format); the head's logits then favour `i + 1`, so
the "model" continues any text with the next characters of the alphabet, and id 0 (reached
after 127) ends the sequence.
"""

from __future__ import annotations

import random

import torch

from meshnet.client.codec import CharCodec
from meshnet.client.generation import Generator
from meshnet.client.pipeline import Pipeline
from meshnet.client.routes import StaticRoutes
from meshnet.client.transport import Hop, InProcessTransport
from meshnet.config import WireConfig, WireLimits
from meshnet.node.app import NodeService
from meshnet.node.runner import EchoRunner
from meshnet.types import LayerSpan, ModelId, NodeId

VOCAB = 128
HIDDEN = 8
MODEL = ModelId("fake")


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


def fake_mesh(
    margin: float = 20.0, chunk_tokens: int = 128
) -> tuple[Generator, InProcessTransport, dict[str, EchoRunner]]:
    """A generator over an entry span 0:2 and two echo hops 2:4 and 4:6 (in-process)."""
    local = EchoRunner(MODEL, LayerSpan(0, 2))
    runners = {"a": EchoRunner(MODEL, LayerSpan(2, 4)), "b": EchoRunner(MODEL, LayerSpan(4, 6))}
    hops = [
        Hop(NodeId("node-a"), "a", LayerSpan(2, 4)),
        Hop(NodeId("node-b"), "b", LayerSpan(4, 6)),
    ]
    wire = WireConfig(chunk_tokens=chunk_tokens)
    transport = InProcessTransport(runners, wire)
    service = NodeService([local], WireLimits(), wire)
    pipeline = Pipeline(
        MODEL, 6, CountingHead(margin), local, service, StaticRoutes(hops), transport, wire
    )
    runners["local"] = local
    return Generator(pipeline, CharCodec(), 4096, random.Random(0)), transport, runners

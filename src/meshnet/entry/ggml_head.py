"""An entry's head computed by ggml (`models.ggml_head.GgmlHead`) with the torch `Head`'s
surface the pipeline uses (ADR-0051)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from meshnet.models.ggml_head import GgmlHead


@dataclass(frozen=True)
class Vocabulary:
    num_embeddings: int


class GgmlHeadModule:
    """ids [B, T] in, hidden states [B, T, H] float32 out; logits [B, T, V] float32 in host
    memory."""

    int8_head = None

    def __init__(self, head: GgmlHead) -> None:
        self.ggml = head
        self.embed = Vocabulary(head.vocab)

    def embed_tokens(self, ids: torch.Tensor, position: int) -> torch.Tensor:
        out = self.ggml.embed(ids.reshape(-1).numpy())
        return torch.from_numpy(out).reshape(*ids.shape, -1)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        rows = hidden.reshape(-1, hidden.shape[-1]).float().numpy()
        return torch.from_numpy(self.ggml.logits(rows)).reshape(*hidden.shape[:-1], -1)

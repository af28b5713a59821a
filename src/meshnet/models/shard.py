"""Runnable model parts: a `Shard` of layers `[start, end)` and the entry node's `Head`."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from meshnet.models.device import to_host
from meshnet.models.layer_ops import positions_for
from meshnet.models.products import Int8Rows, int8_rows_of
from meshnet.models.registry import Architecture
from meshnet.types import LayerSpan, Quant


@dataclass
class Shard:
    """Layers `span` of one model, ready to run with a per-session cache."""

    arch: Architecture
    config: Any  # the architecture's config (`Architecture.hf_config`)
    span: LayerSpan
    layers: nn.ModuleList
    extras: Any  # what the architecture's layers need besides the cache (rotary embedding)
    compute_dtype: torch.dtype
    quant: Quant
    fast: Any = None  # the architecture's fast path (ADR-0021), or None: the eager layers
    device: str = "cpu"  # where its weights, caches and compute live: "cpu" or "cuda:N"

    @torch.inference_mode()
    def forward(self, hidden: torch.Tensor, cache: Any, position: int) -> torch.Tensor:
        """`hidden` [B, T, H] (any float, any device) at `position` -> [B, T, H] bf16 in host
        memory; appends to `cache` (a `models.cache.SpanCache`)."""
        x = hidden.to(device=self.device, dtype=self.compute_dtype)
        out: torch.Tensor
        if self.fast is not None:
            out = self.fast.forward(x, cache, position)
        else:
            out = self.arch.run_layers(self.layers, x, cache.as_eager(), position, self.extras)
        return to_host(out.to(torch.bfloat16))

    @property
    def batches(self) -> bool:
        """Whether `forward_many` runs its sessions as one pass (the fast path)."""
        return self.fast is not None

    @torch.inference_mode()
    def forward_many(
        self, hiddens: list[torch.Tensor], caches: list[Any], positions: list[int]
    ) -> list[torch.Tensor]:
        """Several sessions at once: `hiddens[b]` [1, T_b, H] at `positions[b]` of `caches[b]`
        -> [1, T_b, H] bf16 each, in host memory. Sessions are independent: each attends
        over its own cache. One pass on the fast path; one session after another otherwise."""
        xs = [h.to(device=self.device, dtype=self.compute_dtype) for h in hiddens]
        if self.fast is None:
            return [self.forward(*args) for args in zip(xs, caches, positions, strict=True)]
        outs: list[torch.Tensor] = self.fast.forward_many(xs, caches, positions)
        return [to_host(out.to(torch.bfloat16)) for out in outs]

    def weight_bytes(self) -> int:
        """Bytes this shard's weights hold (see `held_bytes`)."""
        return held_bytes(self)


def unset_embedding(count: int, width: int) -> nn.Embedding:
    """A `count` x `width` embedding table whose values are loaded next: no random start.

    Built under `torch.device("meta")`, `nn.Embedding` would draw its start with a reference
    `normal_` that imports `torch._dynamo` (1.4 s of an entry's start-up on this machine)."""
    return nn.Embedding(count, width, _weight=torch.empty(count, width))


class Head(nn.Module):
    """Embeddings (plus learned positions, for GPT-2), final norm and LM head."""

    def __init__(
        self,
        embed: nn.Embedding,
        pos_embed: nn.Embedding | None,
        norm: nn.Module,
        lm_head: nn.Linear,
    ) -> None:
        super().__init__()
        self.embed = embed
        self.pos_embed = pos_embed
        self.norm = norm
        self.lm_head = lm_head
        # int8 entries multiply by int8 rows of the LM head (`quantize_lm_head`), feeding
        # them activations in this dtype (their compute dtype)
        self.int8_head: Int8Rows | None = None
        self.int8_dtype = torch.float32

    def quantize_lm_head(self, compute: torch.dtype) -> None:
        """Multiply by int8 rows of the LM head from now on (ADR-0046): a decode step's head
        product reads half the bytes of bf16, and batches of rows stay cheap on CPUs without
        fast bf16. An untied LM head's dense weight is let go."""
        self.int8_head = int8_rows_of(self.lm_head.weight.data)
        self.int8_dtype = compute
        if self.lm_head.weight is not self.embed.weight:
            self.lm_head.weight = nn.Parameter(self.lm_head.weight.data[:0], requires_grad=False)

    @torch.inference_mode()
    def embed_tokens(self, ids: torch.Tensor, position: int) -> torch.Tensor:
        """Token ids [B, T] at `position` -> hidden states [B, T, H] in the head's dtype, on
        the head's device."""
        ids = ids.to(self.embed.weight.device)
        hidden: torch.Tensor = self.embed(ids)
        if self.pos_embed is not None:
            hidden = hidden + self.pos_embed(positions_for(ids, position))
        return hidden

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Hidden states [B, T, H] (any float dtype, any device) -> logits [B, T, V] in
        float32, in host memory (samplers run there)."""
        weight = self.lm_head.weight
        x = self.norm(hidden.to(device=weight.device, dtype=weight.dtype))
        if self.int8_head is not None:
            return to_host(self.int8_head(x.to(self.int8_dtype)).float())
        logits: torch.Tensor = self.lm_head(x)
        return to_host(logits.float())


def held_bytes(shard: Shard) -> int:
    """Bytes of the distinct storages a shard's layers and fast path hold.

    Counts every tensor once however many views share it: parameters and buffers,
    bitsandbytes' side tensors (nf4 absmax and code, int8 row scales `SCB`, wherever
    bitsandbytes keeps them after the first forward) and the fast path's own tensors (fused
    biases, the int8 product's bf16 scales). Fused weights are views: they add nothing.
    """
    roots: list[Any] = [shard.layers]
    if shard.fast is not None:
        roots.append(shard.fast.layers)
    storages: dict[int, int] = {}
    for tensor in _tensors(roots, depth=4):
        storage = tensor.untyped_storage()
        if storage.nbytes() and tensor.device.type != "meta":
            storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def _tensors(value: Any, depth: int) -> Iterator[torch.Tensor]:
    """Tensors reachable from `value`: modules, their bitsandbytes states, lists, plain
    objects' attributes (the fast path's products and norms), `depth` levels down."""
    if isinstance(value, torch.Tensor):
        yield value
        for name in ("SCB", "quant_state"):  # bitsandbytes hangs these on its parameters
            yield from _tensors(getattr(value, name, None), depth - 1)
    elif depth <= 0 or value is None:
        return
    elif isinstance(value, nn.Module):
        for module in value.modules():
            for tensor in [*module.parameters(recurse=False), *module.buffers(recurse=False)]:
                yield from _tensors(tensor, depth)
            yield from _tensors(getattr(module, "state", None), depth - 1)  # int8 after a call
    elif isinstance(value, list | tuple):
        for item in value:
            yield from _tensors(item, depth - 1)
    elif hasattr(value, "__dict__"):
        for item in vars(value).values():
            yield from _tensors(item, depth - 1)

"""The int8 fast path's decode step as one compiled graph (`torch.compile`, inductor).

Between its matrix products a decode step runs ~70 small ops a layer (norms, rotary, cache
writes, attention, residuals); eager PyTorch pays ~2 us of dispatch for each, ~6 ms a token
for the default model's 30 layers here. Compiled, inductor fuses them into a few C++ loops
and calls the int8 products as they are: the 30-layer step went from ~19 ms to 12.4-14.5 ms
on this 2-core machine (ADR-0023).

Shapes are fixed but one: a decoded token attends over a window of the cache (the tokens
held rounded up to a multiple of `WINDOW_TOKENS`) with a mask past its position, and the
window's length is a dynamic dimension, so a growing session does not recompile. The
position is a tensor. Compilation happens in the shard's warm-up at load; inductor keeps
what it built in its cache on disk (57-68 s the first time for 30 layers here, seconds
after). Only int8 spans compile: fp32 and bf16 must stay bit-for-bit equal to transformers,
and fused loops round differently.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch

from meshnet.models.layer_ops import rotate
from meshnet.models.llama_fused import Dims, FusedLayer

if TYPE_CHECKING:
    from meshnet.models.cache import StaticKV

log = logging.getLogger(__name__)
# Positions a decoded token attends over, rounded up to this: the mask hides at most 127
# unwritten ones. The whole capacity (up to 2x the tokens) made a 3,000-token step 32 ms
# against 30 ms eager here: attention reads the fp32 cache, 6 MB a layer at 4,096 tokens.
WINDOW_TOKENS = 128


class DecodeGraph:
    """One token (batch 1) through every layer of a `FastSpan`, compiled."""

    def __init__(self, layers: list[FusedLayer], dims: Dims) -> None:
        self.layers = layers
        self.dims = dims
        self.groups = dims.heads // dims.kv_heads
        self.compiled: Any = torch.compile(self._step, fullgraph=True, dynamic=False)
        self.built = False

    def __call__(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        kv: StaticKV,
        position: int,
    ) -> torch.Tensor | None:
        """x [1, 1, H] at `position` -> [1, 1, H]; writes the token's keys and values to `kv`
        (batch 1, room reserved) but leaves its length to the caller.

        None when the first call (which builds the graph) fails: no C++ compiler, an
        unsupported op. The caller then runs the step eagerly from then on.
        """
        window = min(kv.capacity, -(-(position + 1) // WINDOW_TOKENS) * WINDOW_TOKENS)
        keys = [k[0, :, :window] for k in kv.keys.unbind(0)]  # per layer [kv, window, D]
        values = [v[0, :, :window] for v in kv.values.unbind(0)]
        for cache in (*keys, *values):
            torch._dynamo.mark_dynamic(cache, 1)  # the window grows with the session
        args = (x.view(1, -1), *rope, keys, values, torch.tensor([position]))
        if self.built:
            return self.compiled(*args).view(1, 1, -1)  # type: ignore[no-any-return]
        try:
            out = self.compiled(*args)
        except Exception as exc:  # the compiler toolchain's boundary: any failure -> eager
            log.warning("could not compile the decode step (%s); it runs eagerly", exc)
            return None
        self.built = True
        log.info("decode step of %d layers compiled", len(self.layers))
        return out.view(1, 1, -1)  # type: ignore[no-any-return]

    def _step(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        keys: list[torch.Tensor],
        values: list[torch.Tensor],
        position: torch.Tensor,
    ) -> torch.Tensor:
        at = torch.arange(keys[0].shape[1])  # [window]
        unwritten = at > position
        for layer, k, v in zip(self.layers, keys, values, strict=True):
            masked = (
                unwritten if layer.window is None else unwritten | (at <= position - layer.window)
            )
            x = self._layer(layer, x, cos, sin, k, v, position, masked)
        return x

    def _layer(
        self,
        layer: FusedLayer,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        position: torch.Tensor,
        masked: torch.Tensor,
    ) -> torch.Tensor:
        dims = self.dims
        qk, new_values = layer.project(x, dims)  # [1, heads + kv, D], [1, kv, D]
        qk = rotate(qk[0], cos, sin)  # [heads + kv, D]
        keys.index_copy_(1, position, qk[dims.heads :].unsqueeze(1))
        values.index_copy_(1, position, new_values[0].unsqueeze(1))
        q = qk[: dims.heads].view(dims.kv_heads, self.groups, dims.head_dim)
        scores = torch.bmm(q, keys.transpose(1, 2)).float() * dims.scale  # [kv, groups, window]
        probs = torch.softmax(scores.masked_fill(masked, float("-inf")), dim=-1)
        attended = torch.bmm(probs.to(values.dtype), values).reshape(1, -1)  # [1, heads D]
        return layer.finish(x, attended)


def compiled_decode(layers: list[FusedLayer], dims: Dims) -> DecodeGraph | None:
    """A `DecodeGraph` for `layers`, or None (with a log line) where inductor cannot build
    one. Building happens at the first call (the shard's warm-up); see `FastSpan.compile`.
    """
    try:
        return DecodeGraph(layers, dims)
    except (RuntimeError, ImportError) as exc:
        log.warning("torch.compile is not available (%s); decode runs eagerly", exc)
        return None

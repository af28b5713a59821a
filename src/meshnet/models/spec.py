"""`ModelSpec`: the few numbers of a model's config that meshnet plans with (no torch)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class ModelSpec:
    """Shape of a decoder-only transformer, read from its config without any weights."""

    model_type: str  # the registry key, e.g. "llama", "gpt2"
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    vocab_size: int
    tie_word_embeddings: bool
    max_positions: int
    extra: dict[str, object] = field(default_factory=dict, compare=False)  # arch-specific

    @property
    def head_dim(self) -> int:
        """Width of one attention head: the config's `head_dim` where it sets one (Qwen3's
        heads are wider than hidden / heads), else hidden / heads."""
        width = self.extra.get("head_dim")
        return int(str(width)) if width else self.hidden_size // self.num_heads

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """KV-cache bytes one token costs in one layer (keys and values)."""
        return 2 * self.num_kv_heads * self.head_dim * dtype_bytes

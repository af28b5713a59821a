"""`ModelSpec`: the few numbers of a model's config that meshnet plans with (no torch)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any


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

    @classmethod
    def from_config(
        cls,
        config: Mapping[str, Any],
        model_type: str,
        defaults: Mapping[str, Any],
        extra: dict[str, object],
    ) -> ModelSpec:
        """The spec of a Hugging Face `config.json`; `defaults` fills the fields an
        architecture may leave out (`tie_word_embeddings`, `max_position_embeddings`)."""
        heads = int(config["num_attention_heads"])
        return cls(
            model_type=model_type,
            num_layers=int(config["num_hidden_layers"]),
            hidden_size=int(config["hidden_size"]),
            num_heads=heads,
            num_kv_heads=int(config.get("num_key_value_heads") or heads),
            intermediate_size=int(config["intermediate_size"]),
            vocab_size=int(config["vocab_size"]),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", defaults["tie"])),
            max_positions=int(config.get("max_position_embeddings", defaults["positions"])),
            extra=extra,
        )

    @property
    def head_dim(self) -> int:
        """Width of one attention head: the config's `head_dim` where it sets one (Qwen3's
        heads are wider than hidden / heads), else hidden / heads."""
        width = self.extra.get("head_dim")
        return int(str(width)) if width else self.hidden_size // self.num_heads

    def config_kwargs(self) -> dict[str, object]:
        """The transformers config fields every decoder shares, for a config built from a
        GGUF file's metadata (no config.json)."""
        return {
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "max_position_embeddings": self.max_positions,
            "rms_norm_eps": self.extra["rms_norm_eps"],
            "tie_word_embeddings": self.tie_word_embeddings,
        }

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """KV-cache bytes one token costs in one layer (keys and values)."""
        return 2 * self.num_kv_heads * self.head_dim * dtype_bytes

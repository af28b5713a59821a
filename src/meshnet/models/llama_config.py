"""The Llama family's layer config, read without transformers.

A node that only runs layers must not pay for transformers' config and modeling modules
(their imports alone hold ~150 MiB of a process, ADR-0041). `FamilyConfig` carries what the
family's layers need, read from a `config.json` mapping or a GGUF file's spec with the same
defaults and rules as transformers' Llama, Mistral, Qwen2 and Qwen3 configs (tests compare
the two field by field). Its attribute names are transformers' where code reads both.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from meshnet.models.spec import ModelSpec

DEFAULT_THETA = 10_000.0
# transformers' per-type defaults for what a config.json may leave out
_MAX_POSITIONS = {"llama": 2048, "mistral": 4096 * 32, "qwen2": 32768, "qwen3": 32768}
_HEAD_DIM = {"qwen3": 128}  # Qwen3's `head_dim` when a config.json leaves it out
_DEFAULT_WINDOW = 4096  # Mistral/Qwen `sliding_window` when a config.json leaves it out
_DEFAULT_WINDOW_LAYERS = 28  # Qwen's `max_window_layers`


@dataclass(frozen=True)
class FamilyConfig:
    """One Llama-family model's layer shapes, rotary parameters and per-layer windows."""

    model_type: str
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    vocab_size: int
    max_position_embeddings: int
    hidden_act: str
    qkv_bias: bool  # biases on q/k/v (Qwen2 always)
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool  # Qwen3's RMSNorm over each query and key head
    rope: Mapping[str, Any]  # rope_type, rope_theta and the type's own parameters
    windows: tuple[int | None, ...]  # each layer's sliding window, None: full attention
    source: Mapping[str, Any] = field(default_factory=dict, compare=False)

    def to_dict(self) -> dict[str, Any]:
        """The transformers-style config mapping it was read from (`model_type` included)."""
        return {**self.source, "model_type": self.model_type}


def from_mapping(raw: Mapping[str, Any]) -> FamilyConfig:
    """A `config.json` mapping (or `ModelSpec.config_kwargs` plus rope fields) as transformers
    would read it for its `model_type`."""
    model_type = str(raw["model_type"])
    heads = int(raw["num_attention_heads"])
    hidden = int(raw["hidden_size"])
    layers = int(raw["num_hidden_layers"])
    bias = bool(raw.get("attention_bias", False))
    return FamilyConfig(
        model_type=model_type,
        hidden_size=hidden,
        intermediate_size=int(raw["intermediate_size"]),
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=int(raw.get("num_key_value_heads") or heads),
        head_dim=int(raw.get("head_dim", _HEAD_DIM.get(model_type)) or hidden // heads),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        vocab_size=int(raw.get("vocab_size", 32000)),
        max_position_embeddings=int(
            raw.get("max_position_embeddings", _MAX_POSITIONS.get(model_type, 2048))
        ),
        hidden_act=str(raw.get("hidden_act", "silu")),
        qkv_bias={"mistral": False, "qwen2": True}.get(model_type, bias),
        o_bias={"mistral": False, "qwen2": False}.get(model_type, bias),
        mlp_bias=model_type == "llama" and bool(raw.get("mlp_bias", False)),
        qk_norm=model_type == "qwen3",
        rope=rope_parameters(raw),
        windows=layer_windows(raw, model_type, layers),
        source=dict(raw),
    )


def from_spec(spec: ModelSpec) -> FamilyConfig:
    """A GGUF file's model (no config.json): its spec's fields and rope base."""
    raw = {
        **spec.config_kwargs(),
        "model_type": spec.model_type,
        "attention_bias": bool(spec.extra.get("attention_bias")),
        "rope_parameters": {"rope_type": "default", "rope_theta": spec.extra["rope_theta"]},
    }
    return from_mapping(raw)


def rope_parameters(raw: Mapping[str, Any]) -> dict[str, Any]:
    """`rope_parameters` (transformers 5) or the older `rope_scaling` + `rope_theta`, with
    the type under `rope_type` and the base under `rope_theta`."""
    params = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
    params.setdefault("rope_type", params.pop("type", "default"))
    params.setdefault("rope_theta", float(raw.get("rope_theta", DEFAULT_THETA)))
    if params["rope_type"] in ("llama3", "yarn", "longrope"):
        params.setdefault(
            "original_max_position_embeddings",
            raw.get("original_max_position_embeddings", raw.get("max_position_embeddings")),
        )
    return params


def layer_windows(raw: Mapping[str, Any], model_type: str, layers: int) -> tuple[int | None, ...]:
    """Each layer's sliding window by transformers' rules: Mistral slides every layer when
    `sliding_window` is set; Qwen2/Qwen3 slide the layers `layer_types` marks (by default
    those from `max_window_layers` on, when `use_sliding_window`); Llama never slides."""
    if model_type == "mistral":
        window = raw.get("sliding_window", _DEFAULT_WINDOW)
        return (int(window) if window else None,) * layers
    if model_type not in ("qwen2", "qwen3"):
        return (None,) * layers
    window = raw.get("sliding_window", _DEFAULT_WINDOW) if raw.get("use_sliding_window") else None
    first = int(raw.get("max_window_layers", _DEFAULT_WINDOW_LAYERS))
    types = raw.get("layer_types") or [
        "sliding_attention" if window is not None and i >= first else "full_attention"
        for i in range(layers)
    ]
    return tuple(int(window) if window and t == "sliding_attention" else None for t in types)

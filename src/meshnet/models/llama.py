"""The Llama family: Llama 2/3, SmolLM2, Mistral, Qwen2 and Qwen3 (same layer structure;
Qwen3 adds an RMSNorm over each query and key head, and may set its own head width).

Sliding-window attention: Mistral's layers all attend over the last `sliding_window` tokens
when its config sets one; Qwen2/Qwen3 mark such layers in `layer_types`. `shard.layer_window`
reads a built layer's window, and every path masks by it.

The layers are our own modules (`llama_layers.py`, op for op transformers'), so a node that
only runs layers never imports transformers (ADR-0041). torch is imported inside the
functions that build modules, so sizing from a config stays torch-free.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import Any

from meshnet.errors import ModelError
from meshnet.models import llama_config, registry
from meshnet.models.llama_config import FamilyConfig
from meshnet.models.spec import ModelSpec

# model_type -> (transformers module, config class, rotary class): only for rotary types
# `llama_layers` does not compute (yarn, dynamic...)
_CLASSES = {
    "llama": ("llama", "LlamaConfig", "LlamaRotaryEmbedding"),
    "mistral": ("mistral", "MistralConfig", "MistralRotaryEmbedding"),
    "qwen2": ("qwen2", "Qwen2Config", "Qwen2RotaryEmbedding"),
    "qwen3": ("qwen3", "Qwen3Config", "Qwen3RotaryEmbedding"),
}

# GGUF (llama.cpp) tensor names for one layer, by the HF name's suffix.
_GGUF_LAYER = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
}
_GGUF_ARCHS = ("llama", "qwen2", "qwen3")  # llama.cpp's names for the family's files
_GGUF_HEAD = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}


def _transformers_rotary(config: FamilyConfig) -> Any:
    """transformers' rotary module for `config` (a rotary type `llama_layers` lacks)."""
    module_name, config_name, rotary_name = _CLASSES[config.model_type]
    package = f"transformers.models.{module_name}"
    configs = importlib.import_module(f"{package}.configuration_{module_name}")
    modeling = importlib.import_module(f"{package}.modeling_{module_name}")
    config_cls, rotary_cls = getattr(configs, config_name), getattr(modeling, rotary_name)
    raw = {k: v for k, v in config.source.items() if k not in ("architectures", "model_type")}
    return rotary_cls(config=config_cls(**{**raw, "rope_parameters": dict(config.rope)}))


class LlamaFamily:
    model_types: tuple[str, ...] = tuple(_CLASSES)

    def spec_from_config(self, config: Mapping[str, Any]) -> ModelSpec:
        model_type = str(config["model_type"])
        extra: dict[str, object] = {
            "attention_bias": bool(config.get("attention_bias", False)) or model_type == "qwen2",
            "head_dim": llama_config.from_mapping(config).head_dim,
            "qk_norm": model_type == "qwen3",
        }
        defaults = {"tie": False, "positions": 2048}
        return ModelSpec.from_config(config, model_type, defaults, extra)

    def spec_from_gguf(self, fields: Mapping[str, Any], tensor_names: set[str]) -> ModelSpec:
        """llama.cpp's `llama` (Llama, SmolLM2, most Mistral files), `qwen2` and `qwen3`."""
        arch = str(fields["general.architecture"])
        if arch not in _GGUF_ARCHS:
            raise ModelError(f"GGUF architecture {arch!r} is not in the Llama family")

        def field(name: str, default: Any = None) -> Any:
            value = fields.get(f"{arch}.{name}", default)
            if value is None:
                raise ModelError(f"GGUF {arch} file has no '{arch}.{name}'")
            return value

        heads = int(field("attention.head_count"))
        head_dim = int(field("attention.key_length", 0)) or None
        return ModelSpec(
            model_type=arch,
            num_layers=int(field("block_count")),
            hidden_size=int(field("embedding_length")),
            num_heads=heads,
            num_kv_heads=int(field("attention.head_count_kv", heads)),
            intermediate_size=int(field("feed_forward_length")),
            vocab_size=int(field("vocab_size", 0) or 0),
            tie_word_embeddings="output.weight" not in tensor_names,
            max_positions=int(field("context_length", 2048)),
            extra={
                "rope_theta": float(field("rope.freq_base", 10000.0)),
                "rms_norm_eps": float(field("attention.layer_norm_rms_epsilon")),
                "head_dim": head_dim if head_dim != field("embedding_length") // heads else None,
                "attention_bias": "blk.0.attn_q.bias" in tensor_names,
                "qk_norm": "blk.0.attn_q_norm.weight" in tensor_names,
            },
        )

    def layer_params(self, spec: ModelSpec) -> tuple[int, int, int]:
        h, i = spec.hidden_size, spec.intermediate_size
        q, kv = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
        out_rows = q + 2 * kv + h + 3 * i  # q, k, v, o, gate, up, down
        linear = h * (q + 2 * kv) + q * h + 3 * h * i
        bias = (q + 2 * kv) if spec.extra.get("attention_bias") else 0
        # q/k norms [D] each, and the fast path's one row per head of them (`HeadNorm`)
        qk_norm = (2 + spec.num_heads + spec.num_kv_heads) * spec.head_dim
        qk_norm = qk_norm if spec.extra.get("qk_norm") else 0
        return linear, out_rows, 2 * h + bias + qk_norm  # two RMSNorms (+ q/k/v biases, q/k norms)

    def layer_names(self, index: int) -> list[str]:
        return [f"model.layers.{index}."]

    def head_names(self) -> dict[str, list[str]]:
        return {
            "embed.weight": ["model.embed_tokens.weight"],
            "norm.weight": ["model.norm.weight"],
            "lm_head.weight": ["lm_head.weight"],
        }

    def gguf_name(self, hf_name: str, spec: ModelSpec) -> tuple[str, str | None]:
        if hf_name in _GGUF_HEAD:
            return _GGUF_HEAD[hf_name], None
        _, _, index, rest = hf_name.split(".", 3)  # model.layers.{i}.{module}.{param}
        module, param = rest.rsplit(".", 1)
        # llama.cpp interleaves the rotary halves of q/k rows for its `llama` files only
        permute = {"self_attn.q_proj": "q", "self_attn.k_proj": "k"}.get(module)
        if spec.model_type != "llama" or param != "weight":
            permute = None
        return f"blk.{index}.{_GGUF_LAYER[module]}.{param}", permute

    def hf_config(self, spec: ModelSpec, raw: Mapping[str, Any]) -> FamilyConfig:
        """The layer config, without transformers (ADR-0041)."""
        return llama_config.from_mapping(raw) if raw else llama_config.from_spec(spec)

    def build_layer(self, config: FamilyConfig, index: int) -> Any:
        from meshnet.models.llama_layers import DecoderLayer

        return DecoderLayer(config, index)

    def layer_extras(self, config: FamilyConfig) -> Any:
        from meshnet.models.llama_layers import NATIVE_ROPE, Rotary

        if config.rope["rope_type"] in NATIVE_ROPE:
            return Rotary(config)
        return _transformers_rotary(config)

    def run_layers(self, layers: Any, hidden: Any, cache: Any, position: int, extras: Any) -> Any:
        from meshnet.models.layer_ops import (
            causal_mask,
            kept_columns,
            layer_window,
            positions_for,
        )

        embeddings = extras(hidden, position_ids=positions_for(hidden, position))  # [B, T, D] x2
        windows = [layer_window(x) for x in layers]
        cache.slide(windows)  # a sliding layer's cache keeps only what it can still see
        masks = {w: causal_mask(hidden, position, w) for w in set(windows)}
        for i, (layer, window) in enumerate(zip(layers, windows, strict=True)):
            hidden = layer(hidden, embeddings, kept_columns(masks[window], cache, i), cache)
        return hidden

    def fast_path(self, layers: Any, config: Any, extras: Any, compile: bool) -> Any | None:
        from meshnet.models.llama_fast import fast_span

        return fast_span(layers, config, extras, compile)

    def build_head(self, config: Any) -> Any:
        from torch import nn

        from meshnet.models.llama_layers import RMSNorm
        from meshnet.models.shard import Head, unset_embedding

        norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        return Head(
            unset_embedding(config.vocab_size, config.hidden_size),
            None,
            norm,
            nn.Linear(config.hidden_size, config.vocab_size, bias=False),
        )


registry.register(LlamaFamily())

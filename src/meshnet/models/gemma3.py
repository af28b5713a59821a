"""Gemma 3 (text): the layers of Gemma 3 270M to 27B, through transformers' own classes.

What sets it apart from the Llama family: five sliding-window layers (local attention over the
last `sliding_window` tokens, rotary base 10,000) to each global one (rotary base from the
config); q/k norms; four RMSNorms a layer, each scaling by (1 + weight); a GELU-tanh MLP;
embeddings scaled by sqrt(hidden); a tied 262k-token vocabulary, the biggest tensor of the
small models (`sizing.head_bytes` counts it). llama.cpp stores every norm weight as 1 + w
(its RMSNorm multiplies by the weight alone), so GGUF norms are read back as w.

No fast path: the layers run as transformers runs them (ADR-0021's fast path is Llama's).
torch and transformers are imported inside the functions that build modules.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from meshnet.errors import ModelError
from meshnet.models import registry
from meshnet.models.spec import ModelSpec

LOCAL_ROPE_THETA = 10_000.0  # the sliding layers' rotary base in every Gemma 3
_GGUF_LAYER = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "post_attention_norm",
    "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
}
_GGUF_HEAD = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
}


class Gemma3:
    model_types: tuple[str, ...] = ("gemma3_text", "gemma3")  # HF model_type, GGUF arch

    def spec_from_config(self, config: Mapping[str, Any]) -> ModelSpec:
        config = config.get("text_config", config)  # a multimodal checkpoint's text part
        defaults = {"tie": True, "positions": 32768}
        extra: dict[str, object] = {"head_dim": int(config.get("head_dim") or 256)}
        return ModelSpec.from_config(config, "gemma3_text", defaults, extra)

    def spec_from_gguf(self, fields: Mapping[str, Any], tensor_names: set[str]) -> ModelSpec:
        def field(name: str) -> Any:
            if f"gemma3.{name}" not in fields:
                raise ModelError(f"GGUF gemma3 file has no 'gemma3.{name}'")
            return fields[f"gemma3.{name}"]

        heads = int(field("attention.head_count"))
        return ModelSpec(
            model_type="gemma3_text",
            num_layers=int(field("block_count")),
            hidden_size=int(field("embedding_length")),
            num_heads=heads,
            num_kv_heads=int(fields.get("gemma3.attention.head_count_kv", heads)),
            intermediate_size=int(field("feed_forward_length")),
            vocab_size=len(fields.get("tokenizer.ggml.tokens", [])),
            tie_word_embeddings="output.weight" not in tensor_names,
            max_positions=int(fields.get("gemma3.context_length", 32768)),
            extra={
                "head_dim": int(field("attention.key_length")),
                "rope_theta": float(fields.get("gemma3.rope.freq_base", 1_000_000.0)),
                "rms_norm_eps": float(field("attention.layer_norm_rms_epsilon")),
                "sliding_window": int(field("attention.sliding_window")),
            },
        )

    def layer_params(self, spec: ModelSpec) -> tuple[int, int, int]:
        h, i, d = spec.hidden_size, spec.intermediate_size, spec.head_dim
        q, kv = spec.num_heads * d, spec.num_kv_heads * d
        linear = h * (q + 2 * kv) + q * h + 3 * h * i
        out_rows = q + 2 * kv + h + 3 * i
        return linear, out_rows, 4 * h + 2 * d  # four RMSNorms and the q/k norms

    def layer_names(self, index: int) -> list[str]:
        return [f"model.layers.{index}.", f"model.language_model.layers.{index}."]

    def head_names(self) -> dict[str, list[str]]:
        return {
            "embed.weight": [
                "model.embed_tokens.weight",
                "model.language_model.embed_tokens.weight",
            ],
            "norm.weight": ["model.norm.weight", "model.language_model.norm.weight"],
            "lm_head.weight": ["lm_head.weight"],
        }

    def gguf_name(self, hf_name: str, spec: ModelSpec) -> tuple[str, str | None]:
        if hf_name in _GGUF_HEAD:
            name = _GGUF_HEAD[hf_name]
            return name, "plus_one" if name.endswith("norm.weight") else None
        if hf_name == "lm_head.weight":
            return "output.weight", None
        _, _, index, rest = hf_name.split(".", 3)  # model.layers.{i}.{module}.{param}
        module, param = rest.rsplit(".", 1)
        undo = "plus_one" if module.endswith("norm") else None  # stored as 1 + w
        return f"blk.{index}.{_GGUF_LAYER[module]}.{param}", undo

    def hf_config(self, spec: ModelSpec, raw: Mapping[str, Any]) -> Any:
        from transformers import Gemma3TextConfig

        if raw:
            text = dict(raw.get("text_config", raw))
            return _sdpa(
                Gemma3TextConfig(**{k: v for k, v in text.items() if k != "architectures"})
            )
        theta = float(spec.extra["rope_theta"])  # type: ignore[arg-type]
        return _sdpa(
            Gemma3TextConfig(
                **spec.config_kwargs(),
                sliding_window=spec.extra["sliding_window"],
                rope_parameters={
                    "full_attention": {"rope_type": "default", "rope_theta": theta},
                    "sliding_attention": {"rope_type": "default", "rope_theta": LOCAL_ROPE_THETA},
                },
            )
        )

    def build_layer(self, config: Any, index: int) -> Any:
        from transformers.models.gemma3.modeling_gemma3 import Gemma3DecoderLayer

        return Gemma3DecoderLayer(config, layer_idx=index)

    def layer_extras(self, config: Any) -> Any:
        from transformers.models.gemma3.modeling_gemma3 import Gemma3RotaryEmbedding

        return Gemma3RotaryEmbedding(config=config)

    def run_layers(self, layers: Any, hidden: Any, cache: Any, position: int, extras: Any) -> Any:
        from meshnet.models.layer_ops import (
            causal_mask,
            kept_columns,
            layer_window,
            positions_for,
        )

        positions = positions_for(hidden, position)
        kinds = {layer.self_attn.layer_type for layer in layers}
        rope = {kind: extras(hidden, positions, kind) for kind in kinds}  # (cos, sin) each
        windows = [layer_window(x) for x in layers]
        cache.slide(windows)  # local layers keep only their window (and room for rollbacks)
        masks = {w: causal_mask(hidden, position, w) for w in set(windows)}
        for i, layer in enumerate(layers):
            hidden = layer(
                hidden,
                position_embeddings=rope[layer.self_attn.layer_type],
                attention_mask=kept_columns(masks[windows[i]], cache, i),
                position_ids=positions,
                cache=cache,
                use_cache=True,
            )
        return hidden

    def fast_path(self, layers: Any, config: Any, extras: Any, compile: bool) -> Any | None:
        return None  # transformers' layers (see the module docstring)

    def build_head(self, config: Any) -> Any:
        import torch
        from torch import nn
        from transformers.models.gemma3.modeling_gemma3 import (
            Gemma3RMSNorm,
            Gemma3TextScaledWordEmbedding,
        )

        from meshnet.models.shard import Head

        scale = config.hidden_size**0.5
        embed = Gemma3TextScaledWordEmbedding(
            config.vocab_size, config.hidden_size, config.pad_token_id, scale
        )
        with torch.device("cpu"):  # a buffer no checkpoint holds: real even when built on meta
            embed.embed_scale = torch.tensor(scale)
        return Head(
            embed,
            None,
            Gemma3RMSNorm(config.hidden_size, eps=config.rms_norm_eps),
            nn.Linear(config.hidden_size, config.vocab_size, bias=False),
        )


def _sdpa(config: Any) -> Any:
    config._attn_implementation = "sdpa"
    return config


registry.register(Gemma3())

"""GGUF files of the Llama family beyond `llama`: a tiny Qwen3 and a tiny Qwen2 written as
llama.cpp names and lays out their tensors (no rotary interleaving for qwen; q/k norms, q/k/v
biases; F32 or Q8_0), read back through our reader; and the refusals a bad file gets at
start-up."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch

from meshnet.errors import ModelError
from meshnet.models.loader import load_shard
from meshnet.models.source import resolve
from meshnet.types import LayerSpan

LAYER = {
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
    "post_attention_layernorm": "ffn_norm",
}


HEAD = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}


def write_gguf(folder: Path, out: Path, arch: str, quantized: bool) -> Path:
    """The tiny checkpoint in `folder` as a GGUF file of architecture `arch`: metadata as
    llama.cpp writes it, matrices Q8_0 when `quantized`, everything else F32."""
    import gguf
    from safetensors.torch import load_file

    config = __import__("json").loads((folder / "config.json").read_text())
    state = load_file(str(folder / "model.safetensors"))
    writer = gguf.GGUFWriter(str(out), arch)
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_rope_freq_base(config["rope_parameters"]["rope_theta"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_token_list([f"t{i}" for i in range(config["vocab_size"])])
    for name, tensor in state.items():
        values = tensor.float().numpy()
        if name.startswith("model.layers."):
            _, _, index, rest = name.split(".", 3)
            module, param = rest.rsplit(".", 1)
            target = f"blk.{index}.{LAYER[module]}.{param}"
        else:
            target = HEAD[name]
        if quantized and values.ndim == 2:
            kind = gguf.GGMLQuantizationType.Q8_0
            writer.add_tensor(target, gguf.quants.quantize(values, kind), raw_dtype=kind)
        else:
            writer.add_tensor(target, values)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


@pytest.mark.parametrize("quantized", [False, True], ids=["f32", "q8_0"])
@pytest.mark.parametrize(("tiny", "arch"), [("qwen3-plain", "qwen3"), ("qwen2", "qwen2")])
def test_a_qwen_gguf_reads_like_its_checkpoint(
    tiny_folder: Callable[[str], Path], tmp_path: Path, quantized: bool, tiny: str, arch: str
) -> None:
    """Qwen3: q/k norms, heads wider than hidden / heads; Qwen2: q/k/v biases, tied head."""
    folder = tiny_folder(tiny)
    source = resolve(str(write_gguf(folder, tmp_path / f"{arch}.gguf", arch, quantized)))
    checkpoint = resolve(str(folder))
    assert source.spec == checkpoint.spec
    assert source.spec.head_dim == (32 if arch == "qwen3" else 16)
    assert source.spec.extra["qk_norm"] == (arch == "qwen3")
    assert source.spec.extra["attention_bias"] == (arch == "qwen2")
    span = LayerSpan(0, source.spec.num_layers)
    ours, theirs = load_shard(source, span, "fp32"), load_shard(checkpoint, span, "fp32")
    torch.manual_seed(0)
    x = torch.randn(1, 20, source.spec.hidden_size)
    a, b = ours.forward(x, _cache(), 0).float(), theirs.forward(x, _cache(), 0).float()
    if quantized:  # Q8_0 keeps 8 bits a weight: outputs move well under 2%
        assert float((a - b).norm() / b.norm()) < 0.02
    else:
        assert torch.equal(a, b)


def _cache() -> object:
    from meshnet.models.cache import new_cache

    return new_cache()


def test_an_unsupported_gguf_architecture_is_refused_by_name(
    tiny_folder: Callable[[str], Path], tmp_path: Path
) -> None:
    path = write_gguf(tiny_folder("qwen3-plain"), tmp_path / "mamba.gguf", "mamba", False)
    with pytest.raises(ModelError, match="mamba.gguf: GGUF architecture 'mamba' is not supported"):
        resolve(str(path))


def test_a_tensor_type_meshnet_cannot_read_is_refused_at_start(
    tiny_folder: Callable[[str], Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import gguf.quants

    path = write_gguf(tiny_folder("qwen3-plain"), tmp_path / "odd.gguf", "qwen3", True)

    def cannot(data: np.ndarray, kind: object) -> np.ndarray:
        raise NotImplementedError(f"no dequantization for {kind}")

    monkeypatch.setattr(gguf.quants, "dequantize", cannot)
    with pytest.raises(ModelError, match=r"odd.gguf \(qwen3\): tensor .* is Q8_0, a type"):
        resolve(str(path))

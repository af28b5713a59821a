"""Quantizing a layer as it loads: its compute dtype, and its linears swapped as its scheme
says (`models/quant/`: fp32, bf16, int8, nf4, q4; gguf is ggml's and never comes here).

The fast path runs int8 weights with PyTorch's weight-only kernel (`models/products.py`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping

import torch
from torch import nn

from meshnet.models import sizing
from meshnet.models.int4 import Int4Blocks
from meshnet.models.quant import scheme_of
from meshnet.models.quant.compute import preferred_compute
from meshnet.models.quant.nf4 import nf4_packed_for_cpu
from meshnet.models.quant.scheme import Linear
from meshnet.models.spec import ModelSpec
from meshnet.types import Quant, parse_quant

log = logging.getLogger(__name__)
# bitsandbytes logs a warning on every int8 matmul whose input is not fp16 (it casts); that is
# by design here (activations are fp32/bf16), so keep it out of our logs.
logging.getLogger("bitsandbytes.autograd._functions").setLevel(logging.ERROR)


def compute_dtype(quant: str, device: str = "cpu") -> torch.dtype:
    """The dtype a shard on `device` computes in: its scheme's, or the preferred compute
    dtype (`preferred_compute`) for schemes that follow it."""
    compute = scheme_of(quant).compute
    if compute == "preferred":
        compute = preferred_compute(device)
    return torch.float32 if compute == "fp32" else torch.bfloat16


def local_layer_bytes(spec: ModelSpec, quant: Quant, device: str = "cpu") -> int:
    """Bytes one layer of `spec` at `quant` holds on `device` in this process
    (`sizing.layer_bytes` with that device's compute dtype and nf4 layout)."""
    packed = scheme_of(quant).repacked_for_bf16 and nf4_packed_for_cpu(device)
    return sizing.layer_bytes(spec, quant, preferred_compute(device), packed_nf4=packed)


def head_dtype(quant: str) -> torch.dtype:
    """The entry's head (embeddings, LM head): fp32 beside fp32 layers, else bf16, as
    `sizing.entry_head_bytes` counts it (int8 entries also multiply by int8 rows of the LM
    head, ADR-0046). An fp32 LM head costs a decode step 9.5 ms on an AVX-512 BF16 host,
    bf16 3.2."""
    return torch.float32 if scheme_of(quant).head_bytes_per_value == 4 else torch.bfloat16


def check_quant(quant: str) -> Quant:
    return parse_quant(quant)


def quantize_layer(
    layer: nn.Module, quant: str, device: str = "cpu", blocks: Mapping[str, Int4Blocks] = {}
) -> nn.Module:
    """Cast `layer` to its compute dtype on `device` and, for int8/nf4/q4, swap its linear
    weights (bitsandbytes quantizes each on its first move, straight to `device`). For q4,
    `blocks` holds the 4-bit codes the checkpoint already has, by module path ("mlp.up_proj");
    any other linear is quantized from its float weights."""
    dtype = compute_dtype(quant, device)
    layer = layer.to(dtype)
    swap = scheme_of(quant).swap
    if swap is not None:
        _swap_linears(layer, swap, dtype, device, blocks)
    return move_rest(layer, device)


def move_rest(module: nn.Module, device: str) -> nn.Module:
    """Move every parameter and buffer of `module` not yet on `device` there, one module at a
    time: bitsandbytes' quantized weights, already placed, are left alone (moving them again
    would re-run their quantizing hook)."""
    target = torch.device(device)
    for part in module.modules():
        for name, param in list(part.named_parameters(recurse=False)):
            if param.device != target:
                moved = nn.Parameter(param.data.to(target), requires_grad=False)
                setattr(part, name, moved)
        for name, buffer in list(part.named_buffers(recurse=False)):
            if buffer is not None and buffer.device != target:
                persistent = name not in part._non_persistent_buffers_set
                part.register_buffer(name, buffer.to(target), persistent=persistent)
    return module


def _swap_linears(
    module: nn.Module,
    swap: Callable[..., nn.Module],
    dtype: torch.dtype,
    device: str,
    blocks: Mapping[str, Int4Blocks],
    prefix: str = "",
) -> None:
    """Every linear under `module` replaced by `swap` of it (a scheme's, `models/quant/`)."""
    for name, child in module.named_children():
        path = prefix + name
        weight = _linear_weight(child)
        if weight is None:
            _swap_linears(child, swap, dtype, device, blocks, path + ".")
            continue
        linear = Linear(weight, getattr(child, "bias", None), path, blocks.get(path))
        setattr(module, name, swap(linear, dtype, device))


def _linear_weight(module: nn.Module) -> torch.Tensor | None:
    """The [out, in] weight of an `nn.Linear`, or of GPT-2's transposed `Conv1D`."""
    if isinstance(module, nn.Linear):
        return module.weight.data
    if type(module).__name__ == "Conv1D":  # transformers' GPT-2 projection: weight is [in, out]
        weight: torch.Tensor = module.weight.data  # type: ignore[assignment]
        return weight.t().contiguous()
    return None

"""Load only what a node serves: the tensors of one layer span, or the head.

Layers are built on the meta device from their family's modules (the Llama family's own,
transformers' for the others), then each tensor is read, checked (name and shape) and
assigned, one at a time: the full model never exists in memory.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from torch import nn

from meshnet.errors import ModelError
from meshnet.models import quantize
from meshnet.models.checkpoint import Checkpoint, GgufCheckpoint, SafetensorsCheckpoint
from meshnet.models.gguf_file import read_gguf
from meshnet.models.int4 import Int4Blocks
from meshnet.models.quant import check_device, scheme_of
from meshnet.models.quant.compute import default_quant
from meshnet.models.shard import Head, Shard
from meshnet.models.source import ModelSource, layer_tensor_names
from meshnet.observe.progress import progress
from meshnet.types import LayerSpan

log = logging.getLogger(__name__)


def open_checkpoint(
    source: ModelSource, span: LayerSpan | None = None, cache_dir: Path | None = None
) -> Checkpoint:
    """The tensor reader of `source`; for hub ids, fetches only the files `span` needs."""
    if source.kind == "gguf":
        return GgufCheckpoint(source.path, source.arch, source.spec)
    if source.kind == "hub":
        from meshnet.models.checkpoint import safetensors_index
        from meshnet.models.hub import fetch_weight_files

        repo = source.repo_id or source.model_id
        if (source.path / "model.safetensors.index.json").exists():
            files = safetensors_index(source.path)
            wanted = layer_tensor_names(source, span or [], set(files))
            if span is None:  # the head: whatever is not a layer
                wanted = set(files) - layer_tensor_names(
                    source, range(source.spec.num_layers), set(files)
                )
            fetch_weight_files(repo, {files[n] for n in wanted}, cache_dir)
        else:
            fetch_weight_files(repo, {"model.safetensors"}, cache_dir)
    return SafetensorsCheckpoint.open(source.path)


def read_state(
    module: nn.Module,
    checkpoint: Checkpoint,
    names: dict[str, list[str]],
) -> dict[str, torch.Tensor]:
    """Read every tensor `module` expects, trying each key's candidate names in order; a
    tensor two keys name (a tied LM head) is read once."""
    state: dict[str, torch.Tensor] = {}
    read: dict[str, torch.Tensor] = {}
    for key, expected in module.state_dict().items():
        found = next((n for n in names[key] if checkpoint.has(n)), None)
        if found is None:
            raise ModelError(f"checkpoint has no tensor {names[key][0]!r}")
        tensor = read[found] if found in read else read.setdefault(found, checkpoint.read(found))
        if tuple(tensor.shape) != tuple(expected.shape):
            raise ModelError(
                f"tensor {found!r} has shape {tuple(tensor.shape)}; the config "
                f"implies {tuple(expected.shape)}"
            )
        state[key] = tensor
    return state


def load_layer(
    source: ModelSource,
    config: Any,
    checkpoint: Checkpoint,
    index: int,
    local_index: int,
    quant: str,
    device: str = "cpu",
) -> nn.Module:
    """Build layer `index` on the meta device, fill it from the checkpoint (on the host) and
    quantize it onto `device`."""
    arch = source.arch
    with torch.device("meta"):
        layer = arch.build_layer(config, index)
    prefixes = arch.layer_names(index)
    names = {key: [p + key for p in prefixes] for key in layer.state_dict()}
    keeps = bool(scheme_of(quant).keeps_file_blocks)  # q4: the file's 4-bit codes, as they are
    blocks = read_int4_blocks(layer, checkpoint, names) if keeps else {}
    layer.load_state_dict(read_state(layer, checkpoint, names), assign=True, strict=True)
    for module in layer.modules():  # the shard's cache numbers its layers from 0
        if hasattr(module, "layer_idx"):
            setattr(module, "layer_idx", local_index)  # noqa: B010 - not a Tensor attribute
    return quantize.quantize_layer(layer, quant, device, blocks).eval()


def read_int4_blocks(
    layer: nn.Module, checkpoint: Checkpoint, names: dict[str, list[str]]
) -> dict[str, Int4Blocks]:
    """The 4-bit codes the checkpoint holds for `layer`'s linear weights, by module path."""
    blocks = {}
    for path, module in layer.named_modules():
        key = f"{path}.weight"
        if type(module) is not nn.Linear or key not in names:
            continue
        found = next((n for n in names[key] if checkpoint.has(n)), None)
        q4 = None if found is None else checkpoint.read_int4(found)
        if q4 is not None:
            blocks[path] = q4
    return blocks


def load_shard(
    source: ModelSource,
    span: LayerSpan,
    quant: str | None = None,
    checkpoint: Checkpoint | None = None,
    fast: bool = True,
    compile: bool = False,
    device: str = "cpu",
) -> Shard:
    """Load layers `span` of `source` at `quant` (default: bf16 where fast, else fp32) onto
    `device` ("cpu" or "cuda:N", resolved: `models.device.resolve_device`).

    With `fast`, the architecture's fast path runs the layers where it can (ADR-0021); with
    `compile` too, it may compile its decode step (int8 layers, ADR-0023). The shard is
    warmed up (one prefill, one decode step: compilation happens there) before it returns.
    """
    quant = quantize.check_quant(quant or default_quant(device))
    check_device(quant, device)
    if span.end > source.spec.num_layers:
        raise ModelError(f"layers {span} are outside the model's {source.spec.num_layers} layers")
    config = source.arch.hf_config(source.spec, source.raw_config)
    checkpoint = checkpoint or open_checkpoint(source, span)
    layers = nn.ModuleList()
    with progress(f"loading {source.model_id} layers {span} ({quant})", len(span)) as task:
        for local, index in enumerate(span):
            layers.append(load_layer(source, config, checkpoint, index, local, quant, device))
            task.advance()
    checkpoint.release()
    extras = source.arch.layer_extras(config)
    if isinstance(extras, nn.Module):  # the rotary embedding's frequencies
        extras = extras.to(device)
    dtype = quantize.compute_dtype(quant, device)
    shard = Shard(source.arch, config, span, layers, extras, dtype, quant, device=device)
    if fast:
        shard.fast = source.arch.fast_path(layers, config, extras, compile)
        why = "" if shard.fast else " (no fast path for this architecture or quantization)"
        log.info("layers %s run %s%s", span, "the fast path" if shard.fast else "eagerly", why)
    warm_up(shard)
    trim_heap()
    return shard


def trim_heap() -> None:
    """Hand the C heap's free pages back to the system (glibc's `malloc_trim`): loading
    frees float copies of every tensor, and glibc keeps ~16 MiB of them per 10 layers of the
    default model resident otherwise. A no-op where there is no glibc."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return
    libc.malloc_trim(0)


def warm_up(shard: Shard) -> None:
    """One 2-token prefill and one decode step on a throwaway cache: first-call costs (kernel
    selection, allocator growth) are paid before the node says it is ready."""
    from meshnet.models.cache import new_cache

    cache = new_cache()
    width = int(shard.config.hidden_size)
    shard.forward(torch.zeros(1, 2, width), cache, 0)
    shard.forward(torch.zeros(1, 1, width), cache, 2)


def load_head(
    source: ModelSource,
    dtype: torch.dtype = torch.float32,
    checkpoint: Checkpoint | None = None,
    device: str = "cpu",
) -> Head:
    """Embeddings, final norm and LM head on `device`; the LM head shares the embedding when
    tied."""
    config = source.arch.hf_config(source.spec, source.raw_config)
    checkpoint = checkpoint or open_checkpoint(source, None)
    with torch.device("meta"):
        head: Head = source.arch.build_head(config)  # type: ignore[assignment]
    names = source.arch.head_names()
    tied = source.spec.tie_word_embeddings or not any(
        checkpoint.has(n) for n in names["lm_head.weight"]
    )
    if tied:
        names = {**names, "lm_head.weight": names["embed.weight"]}
    head.load_state_dict(read_state(head, checkpoint, names), assign=True, strict=True)
    head = head.to(device=device, dtype=dtype)
    if tied:
        head.lm_head.weight = head.embed.weight
    checkpoint.release()
    trim_heap()
    return head.eval()


def load_tokenizer(source: ModelSource, cache_dir: Path | None = None) -> Any:
    """The model's tokenizer (with its chat template), through transformers.

    Building one from a GGUF file's vocabulary takes ~10 s on this machine; the result is
    saved once under `cache_dir` (default `$MESHNET_CACHE` or `~/.cache/meshnet`) and loaded
    from there (~0.2 s) by every later process. It is keyed by the file's header (vocabulary,
    template and index: what the tokenizer is made of), so another copy of the same file (a
    fresh virtual environment's, another mtime) finds it too.
    """
    from transformers import AutoTokenizer

    folder, kwargs = source.tokenizer_location()
    if source.kind != "gguf":
        return AutoTokenizer.from_pretrained(folder, **kwargs)
    root = cache_dir or Path(os.environ.get("MESHNET_CACHE", Path.home() / ".cache" / "meshnet"))
    cached = root / "tokenizers" / f"{source.path.stem}-{header_digest(source.path)[:16]}"
    if (cached / "tokenizer_config.json").exists():
        return AutoTokenizer.from_pretrained(str(cached))
    with progress(f"converting {source.path.name}'s vocabulary to a tokenizer (once)"):
        tokenizer = AutoTokenizer.from_pretrained(folder, **kwargs)
    _save_atomically(tokenizer, cached)
    return tokenizer


def _save_atomically(tokenizer: Any, target: Path) -> None:
    """Save into a fresh folder, then rename it into place: concurrent processes may race."""
    target.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(dir=target.parent, prefix=".partial-"))
    tokenizer.save_pretrained(str(scratch))
    try:
        scratch.rename(target)
    except OSError:  # another process got there first; its copy is as good as ours
        shutil.rmtree(scratch, ignore_errors=True)


def header_digest(path: Path) -> str:
    """SHA-256 of a GGUF file's header: the bytes before its tensor data (a few MB)."""
    start = read_gguf(path).data_start
    with path.open("rb") as f:
        return hashlib.sha256(f.read(start)).hexdigest()

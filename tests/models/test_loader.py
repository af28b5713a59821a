"""Loading only the span: memory, name and shape checks, sources."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from meshnet.errors import ModelError
from meshnet.models.checkpoint import SafetensorsCheckpoint
from meshnet.models.loader import load_head, load_shard
from meshnet.models.source import ModelSource, resolve
from meshnet.types import LayerSpan

# VmHWM is this process's own peak RSS; ru_maxrss would carry over the parent's peak on exec.
PEAK_SCRIPT = """
import re, sys
def hwm():
    status = open("/proc/self/status").read()
    return int(re.search(r"VmHWM:\\s+(\\d+) kB", status).group(1))
from meshnet.models.source import resolve
from meshnet.models.loader import load_shard
from meshnet.models.gguf_file import read_gguf
from meshnet.types import LayerSpan
source = resolve("default")
read_gguf(source.path)
import transformers.models.llama.modeling_llama  # imports are overhead, not weights
base = hwm()
shard = load_shard(source, LayerSpan.parse(sys.argv[1]), "fp32")
peak = hwm()
print(base * 1024, peak * 1024, shard.weight_bytes())
"""


def peak_rss(span: str) -> tuple[int, int, int]:
    out = subprocess.run(
        [sys.executable, "-c", PEAK_SCRIPT, span], check=True, capture_output=True, text=True
    ).stdout.split()
    base, peak, weights = map(int, out)
    return base, peak, weights


@pytest.mark.slow
def test_ten_of_thirty_layers_peak_at_a_third_of_the_memory() -> None:
    base10, peak10, weights10 = peak_rss("10:20")
    base30, peak30, weights30 = peak_rss("0:30")
    grown10, grown30 = peak10 - base10, peak30 - base30
    overhead = 48 << 20  # allocator slack and one dequantized tensor in flight
    print(
        f"peak growth: 10 layers {grown10 >> 20} MiB, 30 layers {grown30 >> 20} MiB; "
        f"weights {weights10 >> 20} / {weights30 >> 20} MiB"
    )
    assert grown30 >= weights30  # the measurement sees the weights at all
    assert grown10 <= grown30 / 3 + overhead


def test_missing_tensor_is_named(tiny_folder: Callable[[str], Path], tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    folder = tmp_path / "broken"
    shutil.copytree(tiny_folder("llama"), folder)
    tensors = load_file(folder / "model.safetensors")
    del tensors["model.layers.3.mlp.up_proj.weight"]
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    source = resolve(str(folder))
    load_shard(source, LayerSpan(0, 3), "fp32")  # other layers load fine
    with pytest.raises(ModelError, match=r"model\.layers\.3\.mlp\.up_proj\.weight"):
        load_shard(source, LayerSpan(2, 5), "fp32")


def test_mismatched_shape_is_named(tiny_folder: Callable[[str], Path], tmp_path: Path) -> None:
    folder = tmp_path / "wide"
    shutil.copytree(tiny_folder("gpt2"), folder)
    config = json.loads((folder / "config.json").read_text())
    config["n_inner"] = 300
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelError, match=r"mlp\.c_fc\.weight.*shape"):
        load_shard(resolve(str(folder)), LayerSpan(0, 1), "fp32")


def test_span_outside_the_model_and_unknown_sources_are_refused(
    tiny_folder: Callable[[str], Path],
) -> None:
    with pytest.raises(ModelError, match="outside"):
        load_shard(resolve(str(tiny_folder("gpt2"))), LayerSpan(4, 7), "fp32")
    with pytest.raises(ModelError, match="cannot find model"):
        resolve("/no/such/folder")


def test_sharded_index_reads_only_the_files_it_needs(
    tiny_folder: Callable[[str], Path], tmp_path: Path
) -> None:
    from transformers import AutoModelForCausalLM

    folder = tmp_path / "sharded"
    model = AutoModelForCausalLM.from_pretrained(tiny_folder("llama"))
    model.save_pretrained(folder, max_shard_size="100KB")
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 2
    checkpoint = SafetensorsCheckpoint.open(folder)
    shard = load_shard(resolve(str(folder)), LayerSpan(4, 6), "fp32", checkpoint)
    assert not checkpoint._open  # released after the load
    assert checkpoint.opened == {
        index["weight_map"][n]
        for n in index["weight_map"]
        if n.startswith(("model.layers.4.", "model.layers.5."))
    }
    reference = model.model.layers[4].mlp.up_proj.weight
    assert torch.equal(shard.layers[0].mlp.up_proj.weight, reference)


def test_hub_id_resolves_offline_from_a_prepared_cache(
    tiny_folder: Callable[[str], Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import huggingface_hub.constants as hub_constants

    monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", True)
    cache = tmp_path / "hub"
    snapshot = cache / "models--meshnet-test--tiny-llama" / "snapshots" / ("0" * 40)
    shutil.copytree(tiny_folder("llama"), snapshot)
    (cache / "models--meshnet-test--tiny-llama" / "refs").mkdir()
    (cache / "models--meshnet-test--tiny-llama" / "refs" / "main").write_text("0" * 40)
    source = resolve("meshnet-test/tiny-llama", cache_dir=cache)
    assert source.kind == "hub" and source.spec.num_layers == 6
    from meshnet.models.loader import open_checkpoint

    shard = load_shard(
        source, LayerSpan(0, 2), "fp32", open_checkpoint(source, LayerSpan(0, 2), cache_dir=cache)
    )
    assert len(shard.layers) == 2
    with pytest.raises(ModelError, match="neither cached nor reachable"):
        resolve("meshnet-test/absent", cache_dir=cache)


def test_head_ties_the_lm_head_to_the_embeddings(default_source: object) -> None:
    head = load_head(default_source)  # type: ignore[arg-type]
    assert head.lm_head.weight.data_ptr() == head.embed.weight.data_ptr()


@pytest.mark.slow
def test_gguf_tokenizer_is_cached_and_loads_the_same(
    default_source: ModelSource, tmp_path: Path
) -> None:
    """A fresh conversion of the GGUF vocabulary (into an empty cache) against what a later
    process loads from that cache: same ids for the chat template, same special tokens."""
    from meshnet.models.loader import load_tokenizer

    fresh = load_tokenizer(default_source, cache_dir=tmp_path)  # converts (~10 s), saves
    assert list((tmp_path / "tokenizers").iterdir())
    started = time.perf_counter()
    cached = load_tokenizer(default_source, cache_dir=tmp_path)
    assert time.perf_counter() - started < 3.0  # loading the saved folder, not converting
    messages = [{"role": "user", "content": "Héllo, wörld: 1 + 2?"}]
    [ids, expected] = [
        t.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)
        for t in (cached, fresh)
    ]
    assert ids["input_ids"] == expected["input_ids"]
    assert cached.eos_token_id == fresh.eos_token_id == 2
    # another copy of the file (a fresh virtual environment's: another path and mtime) finds
    # the same cached tokenizer: the cache is keyed by the file's header, not its mtime
    copy = tmp_path / "elsewhere" / default_source.path.name
    copy.parent.mkdir()
    shutil.copyfile(default_source.path, copy)
    started = time.perf_counter()
    load_tokenizer(resolve(str(copy)), cache_dir=tmp_path)
    assert time.perf_counter() - started < 3.0
    assert len(list((tmp_path / "tokenizers").iterdir())) == 1


@pytest.mark.parametrize("which", ["default", "gemma3"])
def test_ggmls_dequantizer_equals_the_gguf_packages_for_every_quantized_type(which: str) -> None:
    """`GgufCheckpoint.read` dequantizes with ggml's C code (Q4_1, Q8_0, Q5_0, Q4_K, Q6_K in
    the two files): the same float32 values as gguf's numpy reader, one tensor of each type."""
    from gguf.quants import dequantize as reference

    from meshnet.models.ggml_lib import dequantize
    from meshnet.models.gguf_file import read_gguf
    from tests.models.fixtures import gemma3_gguf

    path = gemma3_gguf() if which == "gemma3" else resolve("default").path
    seen: dict[str, Any] = {}  # the smallest tensor of each type
    for tensor in sorted(read_gguf(path).tensors, key=lambda t: -t.data.nbytes):
        seen[tensor.tensor_type.name] = tensor
    quantized = {n: t for n, t in seen.items() if n not in ("F32", "F16")}
    assert quantized
    for tensor in quantized.values():
        ours = dequantize(tensor.data, int(tensor.tensor_type))
        assert ours is not None
        assert np.array_equal(ours, reference(tensor.data, tensor.tensor_type))
    assert dequantize(np.zeros((2, 4), np.uint8), 0) is None  # F32: not quantized


def test_the_fast_gguf_index_equals_the_gguf_packages_reader(default_source: ModelSource) -> None:
    """Our reader parses the default file in a fraction of the time; same fields, same data."""
    from gguf import GGUFReader

    from meshnet.models.gguf_file import read_gguf

    ours = read_gguf(default_source.path)
    theirs = GGUFReader(str(default_source.path))
    fields = {n: f.contents() for n, f in theirs.fields.items() if not n.startswith("GGUF.")}
    assert fields == ours.fields
    assert len(ours.tensors) == len(theirs.tensors) == 272
    for mine, reference in zip(ours.tensors, theirs.tensors, strict=True):
        assert (mine.name, mine.tensor_type) == (reference.name, reference.tensor_type)
        assert mine.data.dtype == reference.data.dtype
        assert np.array_equal(mine.data, reference.data)


def test_a_gguf_vocabulary_is_decoded_on_access(default_source: ModelSource) -> None:
    """String arrays stay bytes in the map until read (~10 MiB less in every node)."""
    from gguf import GGUFReader

    from meshnet.models.gguf_file import StringArray, read_gguf

    tokens = read_gguf(default_source.path).fields["tokenizer.ggml.tokens"]
    expected = GGUFReader(str(default_source.path)).fields["tokenizer.ggml.tokens"].contents()
    assert isinstance(tokens, StringArray) and len(tokens) == len(expected) == 49152
    assert (tokens[0], tokens[-1]) == (expected[0], expected[-1])
    assert tokens[100:103] == expected[100:103]
    with pytest.raises(IndexError):
        tokens[49152]

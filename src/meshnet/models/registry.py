"""The architecture registry: `model_type` -> `Architecture`. Imports no torch.

Each architecture module registers itself on import; `get` imports them all once. Adding a
family is one file in this package plus its name in `_MODULES`.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Protocol

from meshnet.errors import ModelError
from meshnet.models.spec import ModelSpec

if TYPE_CHECKING:
    import torch
    from torch import nn

_MODULES = ("meshnet.models.llama", "meshnet.models.gpt2", "meshnet.models.gemma3")
_REGISTRY: dict[str, Architecture] = {}


class Architecture(Protocol):
    """Everything meshnet needs to know about one family of decoder-only models."""

    model_types: tuple[str, ...]

    def spec_from_config(self, config: Mapping[str, Any]) -> ModelSpec:
        """Read a Hugging Face `config.json` dict."""
        ...

    def spec_from_gguf(self, fields: Mapping[str, Any], tensor_names: set[str]) -> ModelSpec:
        """Read GGUF metadata (`general.architecture` already matched)."""
        ...

    def layer_params(self, spec: ModelSpec) -> tuple[int, int, int]:
        """(params in linear weights, their output rows, all other params) of one layer."""
        ...

    def layer_names(self, index: int) -> list[str]:
        """Checkpoint-name prefixes tried, in order, for layer `index` (e.g. `model.layers.3.`)."""
        ...

    def head_names(self) -> dict[str, list[str]]:
        """Head part -> checkpoint names tried, in order (embed, norm, lm_head, ...)."""
        ...

    def gguf_name(self, hf_name: str, spec: ModelSpec) -> tuple[str, str | None]:
        """GGUF tensor name for an HF name, and what llama.cpp's converter did to it that
        reading must undo: `q`/`k` (rotary halves interleaved), `plus_one` (a norm weight
        stored as 1 + w) or None."""
        ...

    def hf_config(self, spec: ModelSpec, raw: Mapping[str, Any]) -> Any:
        """The config its modules are built from: transformers' `PretrainedConfig`, or the
        architecture's own record (the Llama family's `FamilyConfig`); it has `to_dict()`,
        `hidden_size` and `max_position_embeddings`."""
        ...

    def build_layer(self, config: Any, index: int) -> nn.Module:
        """One decoder layer (on the current default device) numbered `index`."""
        ...

    def run_layers(
        self, layers: Any, hidden: torch.Tensor, cache: Any, position: int, extras: Any
    ) -> torch.Tensor:
        """Run `layers` on `hidden` [B, T, H] whose first token is at `position`."""
        ...

    def layer_extras(self, config: Any) -> Any:
        """Per-shard helpers the layers need (e.g. the rotary embedding)."""
        ...

    def build_head(self, config: Any) -> nn.Module:
        """Embeddings, final norm and LM head as one module."""
        ...

    def fast_path(self, layers: Any, config: Any, extras: Any, compile: bool) -> Any | None:
        """A faster runner of `layers` with `forward(hidden, cache, position)`, or None.

        It must compute what `run_layers` computes (same dtype, same results within
        rounding) over a `SpanCache`; None keeps the eager layers (ADR-0021). With
        `compile`, it may compile its decode step where that keeps its results (ADR-0023).
        """
        ...


def register(arch: Architecture) -> Architecture:
    for model_type in arch.model_types:
        _REGISTRY[model_type] = arch
    return arch


def get(model_type: str) -> Architecture:
    """The architecture for `model_type`, or a `ModelError` listing the supported ones."""
    if not _REGISTRY:
        for module in _MODULES:
            importlib.import_module(module)
    try:
        return _REGISTRY[model_type]
    except KeyError:
        raise ModelError(
            f"unsupported model type {model_type!r}; meshnet supports {sorted(_REGISTRY)}"
        ) from None

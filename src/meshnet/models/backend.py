"""Which backend computes a node's layers (ADR-0051): a pure decision, no torch.

ggml computes a GGUF file's layers at the file's own types on the CPU; torch computes
everything else (checkpoint folders, hub ids, CUDA) and any conversion asked with `--quant`.
"""

from __future__ import annotations

from typing import Literal

from meshnet.errors import ConfigError
from meshnet.models.quant import scheme_of
from meshnet.types import Backend, Quant

Chosen = Literal["torch", "ggml"]


def choose_backend(
    asked: Backend, *, gguf: bool, device: str, quant: Quant | None, has_graph: bool
) -> Chosen:
    """The backend for `asked` given the source (`gguf`: a GGUF file), the resolved device,
    the `--quant` asked (None: none) and whether ggml has a graph for the architecture.
    ConfigError for a combination that cannot run, naming why."""
    file_types = quant is not None and scheme_of(quant).file_types
    if asked == "torch":
        if file_types:
            raise ConfigError(
                f"--quant {quant} keeps the file's own types, which only ggml computes"
            )
        return "torch"
    needs = file_types or asked == "ggml"
    why = _ggml_refusal(gguf=gguf, device=device, quant=quant, has_graph=has_graph)
    if why is None:
        return "ggml"
    if needs:
        raise ConfigError(f"the ggml backend cannot serve this: {why}")
    return "torch"


def _ggml_refusal(*, gguf: bool, device: str, quant: Quant | None, has_graph: bool) -> str | None:
    if not gguf:
        return "it computes GGUF files only (use --backend torch for checkpoints)"
    if device != "cpu":
        return f"it runs on the CPU, not {device}"
    if quant is not None and not scheme_of(quant).file_types:
        return f"--quant {quant} converts the weights, which is torch's work"
    if not has_graph:
        return "it has no graph for this architecture"
    return None

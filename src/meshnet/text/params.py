"""What a request asks of generation: length, stop sequences and how to sample."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens; validated where requests are parsed (the API's schemas)."""

    temperature: float = 1.0  # 0 = greedy
    top_k: int = 0  # keep the k most likely tokens; 0 = all
    top_p: float = 1.0  # keep the smallest set whose probability reaches top_p; 1 = all
    seed: int | None = None  # reproducible sampling; None = fresh randomness per request


@dataclass(frozen=True)
class GenerationParams:
    max_tokens: int = 256
    stop: tuple[str, ...] = ()
    sampling: SamplingParams = SamplingParams()

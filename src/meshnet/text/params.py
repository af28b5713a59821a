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
    # OpenAI's: minus penalty x count (frequency) or x 1 (presence) for each generated token
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    # CTRL's (llama.cpp's, transformers'): a recent token's logit / p when > 0, else x p
    repetition_penalty: float = 1.0

    @property
    def penalized(self) -> bool:
        return (self.frequency_penalty, self.presence_penalty, self.repetition_penalty) != (
            0.0,
            0.0,
            1.0,
        )


@dataclass(frozen=True)
class GenerationParams:
    max_tokens: int = 256
    stop: tuple[str, ...] = ()
    sampling: SamplingParams = SamplingParams()
    logprobs: int | None = None  # report each token's log-probability and this many others
    schema: str | None = None  # a JSON schema (as JSON text) the output must match
    lark: str | None = None  # or a grammar in llguidance's lark dialect (tools, ADR-0044)
    n: int = 1  # answers to the prompt, sharing its prefill (ADR-0045)
    cache_prompt: bool = True  # reuse a kept prompt prefix, and keep this one (ADR-0058)

"""Structured output: a request's JSON schema as a token mask, by llguidance (ADR-0043).

`Grammar` follows one generation: before each pick, `mask` sets every token the schema does
not allow next to -inf (end of text only once the JSON is complete); after it, `advance`
feeds the picked token. A codec gives the llguidance tokenizer once (`grammar_tokenizer`);
compiling a schema takes well under a millisecond, a mask ~0.1-0.5 ms on the default
model's 49,152 tokens (`benchmarks/grammar.py`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from meshnet.errors import RequestError
from meshnet.text.json_limits import check_schema


class Grammar:
    """One generation's constraint: a JSON schema over `tokenizer` (an `LLTokenizer`)."""

    def __init__(
        self,
        tokenizer: Any,
        schema: Mapping[str, Any] | None,
        field: str,
        lark: str | None = None,
    ) -> None:
        """A JSON `schema`, or a grammar in llguidance's `lark` dialect (tools' "a call or
        words"); a 400 naming `field` when it cannot be used."""
        import llguidance

        text = check_schema(schema or {}, field)
        try:
            if lark is not None:
                grammar = llguidance.LLMatcher.grammar_from_lark(lark)
            else:
                grammar = llguidance.LLMatcher.grammar_from_json_schema(text)
        except (ValueError, RuntimeError) as exc:
            raise RequestError(f"the JSON schema is not usable: {exc}", field=field) from None
        self.matcher = llguidance.LLMatcher(tokenizer, grammar)
        if self.matcher.is_error():
            error = self.matcher.get_error()
            raise RequestError(f"the JSON schema is not usable: {error}", field=field)
        self.vocab = int(tokenizer.vocab_size)

    def mask(self, logits: torch.Tensor) -> torch.Tensor:
        """`logits` [V] as float32 with every token the schema forbids next at -inf."""
        scores = logits.float().reshape(-1)
        bits = np.frombuffer(self.matcher.compute_bitmask(), dtype=np.uint8)  # 1 bit a token
        allowed = np.unpackbits(bits, bitorder="little")[: min(self.vocab, scores.numel())]
        ok = torch.from_numpy(allowed.astype(bool))
        out = scores.new_full(scores.shape, float("-inf"))
        out[: ok.numel()] = scores[: ok.numel()].masked_fill(~ok, float("-inf"))
        return out

    def advance(self, token: int) -> None:
        """Feed the picked token (an end-of-text token ends the grammar)."""
        self.matcher.consume_token(token)

    @property
    def done(self) -> bool:
        """The JSON is complete (end of text is allowed)."""
        return bool(self.matcher.is_accepting())

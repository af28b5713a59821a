"""Token log-probabilities in OpenAI's two shapes: chat's `logprobs.content` list, and the
legacy completions' parallel lists (`tokens`, `token_logprobs`, `top_logprobs`,
`text_offset`). A token's text is its own decoding (`TokenText`), as OpenAI gives it."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from meshnet.text.events import TokenLogprob

TokenText = Callable[[int], str]  # a token id's own text


def _entry(text: str, logprob: float) -> dict[str, Any]:
    return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}


def chat_logprobs(scores: tuple[TokenLogprob, ...], text: TokenText) -> dict[str, Any]:
    """`choices[i].logprobs` of a chat answer or chunk: one entry per token, best first."""
    content = [
        _entry(text(s.token), s.logprob)
        | {"top_logprobs": [_entry(text(t), lp) for t, lp in s.top]}
        for s in scores
    ]
    return {"content": content, "refusal": None}


@dataclass
class CompletionLogprobs:
    """The legacy shape, with `text_offset` counted across a stream's chunks."""

    text: TokenText
    offset: int = 0  # characters of the completion before the next token

    def block(self, scores: tuple[TokenLogprob, ...]) -> dict[str, Any]:
        tokens = [self.text(s.token) for s in scores]
        offsets = []
        for token in tokens:
            offsets.append(self.offset)
            self.offset += len(token)
        return {
            "tokens": tokens,
            "token_logprobs": [s.logprob for s in scores],
            "top_logprobs": [{self.text(t): lp for t, lp in s.top} for s in scores],
            "text_offset": offsets,
        }

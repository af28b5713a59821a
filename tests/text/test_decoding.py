"""Incremental detokenization with the default model's real tokenizer: the deltas a stream
sends add up to the tokenizer's own decode of all ids, multi-byte characters included, and
each token decodes only a short window (review finding 9)."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from meshnet.text.codec import HfCodec
from meshnet.text.decoding import Decoding
from meshnet.text.params import GenerationParams

TEXTS = [
    "The capital of France is Paris.",
    "Ça coûte 12,50 € — très cher! 日本語のテキスト 🙂🚀 naïve café",
    "def f(x):\n    return x ** 2  # squares\n\n\n",
]


class Counting:
    """A codec that counts how many ids it was asked to decode."""

    def __init__(self, codec: HfCodec) -> None:
        self.codec, self.decoded = codec, 0
        self.eos_token_ids: frozenset[int] = frozenset()  # no id ends these streams

    def encode(self, text: str) -> list[int]:
        return self.codec.encode(text)

    def chat(self, messages: Any) -> list[int]:
        return self.codec.chat(messages)

    def decode(self, ids: Any) -> str:
        self.decoded += len(ids)
        return self.codec.decode(ids)


def stream(codec: Any, ids: list[int]) -> str:
    state, params = Decoding(), GenerationParams(max_tokens=len(ids))
    return "".join(state.accept(token, codec, params) for token in ids)


@pytest.mark.parametrize("text", TEXTS)
def test_the_deltas_add_up_to_the_whole_decode(smollm_tokenizer: Any, text: str) -> None:
    codec = HfCodec(smollm_tokenizer)
    ids = codec.encode(text)
    assert stream(codec, ids) == codec.decode(ids) == text


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(st.text(min_size=1, max_size=80))
def test_any_text_streams_back_as_its_decode(smollm_tokenizer: Any, text: str) -> None:
    codec = HfCodec(smollm_tokenizer)
    ids = codec.encode(text)
    if ids:
        assert stream(codec, ids) == codec.decode(ids)


def test_each_token_decodes_a_short_window(smollm_tokenizer: Any) -> None:
    codec = Counting(HfCodec(smollm_tokenizer))
    ids = codec.encode("word " * 600)  # 600 tokens
    stream(codec, ids)
    # the old way decoded every id again for each token: 600 * 601 / 2 = 180,300 ids
    assert codec.decoded < 10 * len(ids)

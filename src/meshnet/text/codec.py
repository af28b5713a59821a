"""Text <-> token ids for the entry node: the `TextCodec` seam, a transformers one and a fake."""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any, Protocol

from meshnet.errors import RequestError

Message = dict[str, str]  # {"role": ..., "content": ...}


class TextCodec(Protocol):
    eos_token_ids: frozenset[int]

    def encode(self, text: str) -> list[int]: ...

    def chat(self, messages: Sequence[Message]) -> list[int]:
        """The prompt for a chat: the model's chat template, ready for the assistant's turn."""
        ...

    def decode(self, ids: Sequence[int]) -> str: ...

    def grammar_tokenizer(self) -> Any:
        """The vocabulary as llguidance's `LLTokenizer`, for structured output (made once)."""
        ...


class HfCodec:
    """A transformers tokenizer and its chat template."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        eos = tokenizer.eos_token_id
        self.eos_token_ids = frozenset([eos] if isinstance(eos, int) else eos or [])
        self._grammar: Any = None

    def encode(self, text: str) -> list[int]:
        """A completion prompt's ids, with the beginning-of-text token where the model's
        tokenizer adds one (Gemma's `<bos>`; SmolLM2 adds none)."""
        return list(self.tokenizer.encode(text, add_special_tokens=True))

    def chat(self, messages: Sequence[Message]) -> list[int]:
        if not getattr(self.tokenizer, "chat_template", None):
            raise RequestError("this model has no chat template; use /v1/completions")
        ids = self.tokenizer.apply_chat_template(
            list(messages), add_generation_prompt=True, tokenize=True, return_dict=True
        )["input_ids"]
        return [int(i) for i in ids]

    def decode(self, ids: Sequence[int]) -> str:
        return str(self.tokenizer.decode(list(ids), skip_special_tokens=True))

    def grammar_tokenizer(self) -> Any:
        """From the fast tokenizer's own JSON (~0.6 s for the default model's, once)."""
        if self._grammar is None:
            import llguidance

            backend = copy.copy(self.tokenizer.backend_tokenizer)
            backend.no_padding()
            backend.no_truncation()
            eos = sorted(self.eos_token_ids)
            self._grammar = llguidance.LLTokenizer(backend.to_str(), eos_token=eos[0])
        return self._grammar


class CharCodec:
    """The fake: one token per character (its code point); id 0 ends a sequence."""

    eos_token_ids = frozenset({0})

    def encode(self, text: str) -> list[int]:
        return [ord(c) for c in text]

    def chat(self, messages: Sequence[Message]) -> list[int]:
        text = "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant: "
        return self.encode(text)

    def decode(self, ids: Sequence[int]) -> str:
        return "".join(chr(i) for i in ids if i > 0)

    def grammar_tokenizer(self) -> Any:
        import llguidance

        return llguidance.LLTokenizer(llguidance.TokenizerWrapper(_AsciiVocabulary()))


class _AsciiVocabulary:
    """`CharCodec`'s 128 ids as llguidance sees a tokenizer: id i is the byte i, 0 ends."""

    eos_token_id, bos_token_id = 0, None
    tokens = [bytes([i]) for i in range(128)]

    def __call__(self, text: bytes) -> list[int]:
        return list(text)

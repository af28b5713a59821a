"""Sampled token ids -> the text a stream may send now (stop sequences held back).

Detokenizing is incremental (review finding 9: decoding every id again for each token was
O(n^2) on the event loop): each token decodes only a short window of ids, from the last
point where the text was stable to the end, and the new text is what that window adds to
its own stable prefix. A window ending in an unfinished UTF-8 sequence (U+FFFD) waits for
the next token. The end of a request decodes all ids once, so the final text is exactly
the tokenizer's decode of everything.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from meshnet.text.codec import TextCodec
from meshnet.text.events import FinishReason
from meshnet.text.params import GenerationParams
from meshnet.text.stops import scan


@dataclass
class Decoding:
    """A request's decoding state: tokens so far, text emitted, and why it ended."""

    generated: list[int] = field(default_factory=list)
    emitted: int = 0  # characters of the decoded text already sent
    text: str = ""  # the decoded text of `generated[:read]`
    prefix: int = 0  # ids before this decoded with the text before them (a stable point)
    read: int = 0  # ids decoded into `text`
    reason: FinishReason | None = None
    first_s: float = 0.0

    def accept(self, token: int, codec: TextCodec, params: GenerationParams) -> str:
        """Take one sampled token; the text that may be emitted now (may be empty)."""
        if token in codec.eos_token_ids:
            self.reason = "stop"
            return self._flush(codec.decode(self.generated))
        self.generated.append(token)
        text = self._decode(codec)
        cut = scan(text, params.stop)
        if cut.stopped:
            self.reason = "stop"
            return self._take(text, cut.safe_end)
        if len(self.generated) >= params.max_tokens:
            self.reason = "length"
            return self._flush(codec.decode(self.generated))
        return self._take(text, cut.safe_end)

    def _decode(self, codec: TextCodec) -> str:
        """The text of every id so far, decoding only the window since the last stable point."""
        before = codec.decode(self.generated[self.prefix : self.read])
        window = codec.decode(self.generated[self.prefix :])
        if window.endswith("\ufffd") or not window.startswith(before):
            return self.text  # an unfinished character: wait for the next id
        self.text += window[len(before) :]
        self.prefix, self.read = self.read, len(self.generated)
        return self.text

    def _take(self, text: str, end: int) -> str:
        delta = text[self.emitted : end] if end > self.emitted else ""
        self.emitted = max(self.emitted, end)
        return delta

    def _flush(self, text: str) -> str:
        """Everything not sent yet: text held back for a stop sequence that never came."""
        return self._take(text, len(text))

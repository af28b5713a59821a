"""Sampled token ids -> the text a stream may send now (stop sequences held back)."""

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
    reason: FinishReason | None = None
    first_s: float = 0.0

    def accept(self, token: int, codec: TextCodec, params: GenerationParams) -> str:
        """Take one sampled token; the text that may be emitted now (may be empty)."""
        if token in codec.eos_token_ids:
            self.reason = "stop"
            return self._flush(codec.decode(self.generated))
        self.generated.append(token)
        text = codec.decode(self.generated)
        cut = scan(text, params.stop)
        if cut.stopped:
            self.reason = "stop"
            return self._take(text, cut.safe_end)
        if len(self.generated) >= params.max_tokens:
            self.reason = "length"
            return self._flush(text)
        return self._take(text, cut.safe_end)

    def _take(self, text: str, end: int) -> str:
        delta = text[self.emitted : end] if end > self.emitted else ""
        self.emitted = max(self.emitted, end)
        return delta

    def _flush(self, text: str) -> str:
        """Everything not sent yet: text held back for a stop sequence that never came."""
        return self._take(text, len(text))

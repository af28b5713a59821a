"""Stop sequences over streamed text: what may be shown now, and where generation ends.

Pure: given all text generated so far, `scan` says how much of it is safe to emit and whether
a stop sequence ended it. Text that could still become a stop sequence is held back, and so
is a trailing U+FFFD (half a multi-byte character not yet decoded).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Scan:
    safe_end: int  # characters [0, safe_end) may be emitted
    stopped: bool  # a stop sequence starts at safe_end; generation is over


def scan(text: str, stops: Sequence[str]) -> Scan:
    """Where `text` may be cut for emission, given stop sequences `stops`."""
    first = min((i for s in stops if s and (i := text.find(s)) >= 0), default=-1)
    if first >= 0:
        return Scan(first, True)
    end = len(text)
    for stop in stops:
        end = min(end, len(text) - _partial_suffix(text, stop))
    while end > 0 and text[end - 1] == "\ufffd":
        end -= 1
    return Scan(end, False)


def _partial_suffix(text: str, stop: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `stop`."""
    for length in range(min(len(stop) - 1, len(text)), 0, -1):
        if text.endswith(stop[:length]):
            return length
    return 0

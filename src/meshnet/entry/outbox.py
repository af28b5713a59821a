"""The request outbox: summaries of the generations an entry finished, until a heartbeat
carries them to the tracker (its dashboard's feed)."""

from __future__ import annotations

from collections import deque

from meshnet.tracker import messages as msg


class Outbox:
    """At most `msg.MAX_REQUESTS` summaries, oldest dropped first; they are for display."""

    def __init__(self) -> None:
        self._summaries: deque[msg.RequestSummary] = deque(maxlen=msg.MAX_REQUESTS)

    def append(self, summary: msg.RequestSummary) -> None:
        self._summaries.append(summary)

    def take(self) -> list[msg.RequestSummary]:
        """Everything held, oldest first; the outbox is empty after."""
        taken = list(self._summaries)
        self._summaries.clear()
        return taken

    def __len__(self) -> int:
        return len(self._summaries)

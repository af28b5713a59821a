"""Where an entry's pushed steps wait (ADR-0034): the last hop of a pushed route posts its
output to the entry's `/push`, and the node's server hands it here."""

from __future__ import annotations

import asyncio

from meshnet.errors import SessionError, WireError
from meshnet.types import LayerSpan, SessionId
from meshnet.wire import FrameMeta
from meshnet.wire.frame import Hidden


class Inbox:
    """An entry's pushed steps, each waiting for the frame its last hop posts."""

    def __init__(self) -> None:
        # (session, position) -> (future output, the last hop's layers, the shape expected)
        self._waiting: dict[
            tuple[SessionId, int], tuple[asyncio.Future[Hidden], LayerSpan, tuple[int, ...]]
        ] = {}

    def expect(
        self, session: SessionId, position: int, span: LayerSpan, shape: tuple[int, ...]
    ) -> asyncio.Future[Hidden]:
        future: asyncio.Future[Hidden] = asyncio.get_running_loop().create_future()
        self._waiting[(session, position)] = (future, span, shape)
        return future

    def cancel(self, session: SessionId, position: int) -> None:
        self._waiting.pop((session, position), None)

    def deliver(self, meta: FrameMeta, hidden: Hidden) -> None:
        """Hand a posted frame to the step waiting for it; 409 when none waits, 400 when it
        is not the frame that step waits for."""
        waiting = self._waiting.get((meta.session, meta.position))
        if waiting is None or waiting[0].done():
            raise SessionError(
                f"no pushed step of session {meta.session} at position {meta.position} waits here",
                field="X-Meshnet-Session",
            )
        future, span, shape = waiting
        if (meta.span, tuple(hidden.shape)) != (span, shape):
            raise WireError(
                f"the pushed answer is (layers, shape) {(str(meta.span), tuple(hidden.shape))}, "
                f"not {(str(span), shape)}",
                field="X-Meshnet-Layers",
            )
        future.set_result(hidden)

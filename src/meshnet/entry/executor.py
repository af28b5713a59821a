"""The executor seam: how code beside a node's spans (an entry's pipeline) runs model work on
the node's compute thread, batched with every other session's. `NodeService` is one."""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any, Protocol, TypeVar

from meshnet.node.scheduler import BatchFn
from meshnet.types import SessionId

T = TypeVar("T")


class Executor(Protocol):
    """Runs model work on the process's compute thread (the node's `NodeService` is one)."""

    async def call(self, fn: Callable[..., T], *args: object) -> T:
        """Run `fn(*args)` alone on the compute thread."""
        ...

    async def submit(
        self,
        key: Hashable | None,
        run: BatchFn,
        item: Any,
        tokens: int = 1,
        member: Hashable = None,
        wait_s: float = 0.0,
    ) -> Any:
        """Run `item` with the other items queued under `key`, as `run(items)`; `member`
        (a session) will send the next step of `key` too, and the round waits up to
        `wait_s` for the members of the last one."""
        ...

    def forget(self, session: SessionId) -> None:
        """`session` has ended: no batch waits for it."""
        ...

    def admit_session(self, session: SessionId) -> None:
        """Raise when this process takes no new session (draining, or at `max_sessions`);
        else hold a place for `session` until `admitted`."""
        ...

    def admitted(self, session: SessionId) -> None:
        """`session`'s first call is over (its cache counts by itself now)."""
        ...

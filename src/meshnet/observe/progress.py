"""Progress of long work (loading a shard, converting a vocabulary, waiting for coverage).

On a terminal it is a live `rich` bar on stderr; elsewhere (a log file, CI) it is a few log
lines: the start, each quarter, the end with the time taken, so logs stay short.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import time
from collections.abc import Iterator
from typing import TextIO

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

log = logging.getLogger(__name__)


class Task:
    """One piece of long work with `total` steps (None: unknown)."""

    def __init__(self, description: str, total: int | None) -> None:
        self.description = description
        self.total = total
        self.done = 0
        self.started_s = time.monotonic()

    def advance(self, steps: int = 1) -> None:
        self.done += steps

    def update(self, done: int, total: int | None = None) -> None:
        """Set the steps done (and the total, when it changed)."""
        self.total = total if total is not None else self.total
        self.done = done


class _LoggedTask(Task):
    """Logs at 0%, 25%, 50%, 75% and 100%, never more."""

    def __init__(self, description: str, total: int | None) -> None:
        super().__init__(description, total)
        self.quarter = 0
        log.info("%s: started%s", description, f" ({total} steps)" if total else "")

    def update(self, done: int, total: int | None = None) -> None:
        super().update(done, total)
        if self.total and self.done * 4 >= (self.quarter + 1) * self.total and self.done:
            self.quarter = min(4, self.done * 4 // self.total)
            if self.quarter < 4:
                log.info("%s: %d/%d", self.description, self.done, self.total)

    def advance(self, steps: int = 1) -> None:
        self.update(self.done + steps)


class _LiveTask(Task):
    def __init__(self, description: str, total: int | None, bar: Progress) -> None:
        super().__init__(description, total)
        self.bar = bar
        self.id = bar.add_task(description, total=total)

    def update(self, done: int, total: int | None = None) -> None:
        super().update(done, total)
        self.bar.update(self.id, completed=done, total=self.total)

    def advance(self, steps: int = 1) -> None:
        self.update(self.done + steps)


@contextlib.contextmanager
def progress(
    description: str,
    total: int | None = None,
    *,
    live: bool | None = None,
    out: TextIO | None = None,
) -> Iterator[Task]:
    """A task to `advance` while the work runs; `live` (default: stderr is a terminal)."""
    out = out or sys.stderr
    live = out.isatty() if live is None else live
    if not live:
        task: Task = _LoggedTask(description, total)
        yield task
        log.info("%s: done in %.1f s", description, time.monotonic() - task.started_s)
        return
    console = Console(file=out, force_terminal=True)
    columns = (
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
    )
    # log lines written meanwhile go through the bar's stderr proxy, above the bar
    redirect = out is sys.stderr
    with Progress(
        *columns, console=console, redirect_stdout=False, redirect_stderr=redirect
    ) as bar:
        yield _LiveTask(description, total, bar)

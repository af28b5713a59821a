"""Logging set-up: a session id on every line about a session, text or JSON lines.

The session a line is about travels in a context variable, set where a session's work
starts (a `/forward` call on a node, a generation at the entry) and copied into worker
threads with the task's context; a filter stamps it onto every record.
"""

from __future__ import annotations

import contextlib
import contextvars
import json
import logging
import sys
from collections.abc import Iterator
from datetime import UTC, datetime
from typing import Literal, TextIO

LogFormat = Literal["text", "json"]
current_session: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "meshnet_session", default=None
)
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s%(session_tag)s: %(message)s"


@contextlib.contextmanager
def session_context(session: str) -> Iterator[None]:
    """Lines logged inside carry `session` (restored on exit; same task only)."""
    token = current_session.set(session)
    try:
        yield
    finally:
        current_session.reset(token)


class SessionFilter(logging.Filter):
    """Adds `record.session` (or None) and `record.session_tag` (` [session X]` or '')."""

    def filter(self, record: logging.LogRecord) -> bool:
        session = getattr(record, "session", None) or current_session.get()
        record.session = session
        record.session_tag = f" [session {session}]" if session else ""
        return True


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, message, session, exception."""

    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, object] = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        session = getattr(record, "session", None)
        if session:
            line["session"] = session
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        return json.dumps(line, ensure_ascii=False)


_CONTROL = {c: f"\\x{c:02x}" for c in [*range(32), 127] if c != 9} | {10: "\\n", 13: "\\r"}


class TextFormatter(logging.Formatter):
    """`TEXT_FORMAT` lines whose message cannot start a line of its own: control characters
    a remote party put into it (a report's reason, a hop's error text) are escaped, so one
    record is one line (review finding 13). Tracebacks keep their lines."""

    def __init__(self) -> None:
        super().__init__(TEXT_FORMAT)

    def formatMessage(self, record: logging.LogRecord) -> str:  # noqa: N802 (logging's name)
        record.message = record.message.translate(_CONTROL)
        return super().formatMessage(record)


class _StderrHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """Writes to whatever `sys.stderr` is now: a live progress bar may have swapped it."""

    @property
    def stream(self) -> TextIO:
        return sys.stderr

    @stream.setter
    def stream(self, _: TextIO) -> None:
        pass


def handler(fmt: LogFormat) -> logging.Handler:
    out = _StderrHandler()
    out.addFilter(SessionFilter())
    out.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    return out


def configure(level: str = "INFO", fmt: LogFormat = "text") -> None:
    """Root logging for a meshnet process (replaces any handlers set before)."""
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler(fmt))
    root.setLevel(level.upper())
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per heartbeat otherwise

"""Session-tagged logs: the context variable reaches the line, in text and in JSON."""

from __future__ import annotations

import asyncio
import io
import json
import logging

import pytest

from meshnet.cli import main
from meshnet.config import WireConfig, WireLimits
from meshnet.node.app import NodeService
from meshnet.observe.logs import JsonFormatter, SessionFilter, handler, session_context

log = logging.getLogger("meshnet.test")


def captured(fmt: str) -> tuple[logging.Logger, io.StringIO]:
    out = io.StringIO()
    logger = logging.getLogger(f"meshnet.test.{fmt}")
    logger.handlers.clear()
    logger.propagate = False
    to_string = logging.StreamHandler(out)  # the process handler's filter and formatter
    to_string.addFilter(SessionFilter())
    to_string.setFormatter(handler(fmt).formatter)  # type: ignore[arg-type]
    logger.addHandler(to_string)
    logger.setLevel(logging.INFO)
    return logger, out


def test_a_line_inside_a_session_names_it_and_one_outside_does_not() -> None:
    logger, out = captured("text")
    with session_context("s-abc"):
        logger.info("prefill of %d tokens", 38)
    logger.info("no session here")
    first, second = out.getvalue().splitlines()
    assert first.endswith("meshnet.test.text [session s-abc]: prefill of 38 tokens")
    assert second.endswith("meshnet.test.text: no session here")


def test_json_lines_parse_and_carry_the_session_and_the_exception() -> None:
    logger, out = captured("json")
    with session_context("s-1"):
        try:
            raise ValueError("boom")
        except ValueError:
            logger.exception("hop failed")
    line = json.loads(out.getvalue())
    assert line["session"] == "s-1" and line["message"] == "hop failed"
    assert line["level"] == "ERROR" and "ValueError: boom" in line["exception"]
    assert line["time"].endswith("+00:00")


def test_work_on_the_worker_thread_logs_under_the_callers_session() -> None:
    service = NodeService([], WireLimits(), WireConfig())
    seen: list[str | None] = []

    def work() -> None:
        record = logging.LogRecord("x", logging.INFO, __file__, 1, "m", None, None)
        SessionFilter().filter(record)
        seen.append(record.session)  # type: ignore[attr-defined]

    async def call() -> None:
        with session_context("s-worker"):
            await service.call(work)  # the worker thread, not this one

    asyncio.run(call())
    assert seen == ["s-worker"]


@pytest.mark.parametrize(
    "argv", [["--log-format", "json", "status"], ["status", "--log-format", "json"]]
)
def test_log_format_json_is_taken_before_or_after_the_command(argv: list[str]) -> None:
    root = logging.getLogger()
    saved = list(root.handlers), root.level
    try:
        main([*argv, "--tracker", "http://127.0.0.1:9"])  # nothing listens: fails fast
        assert isinstance(root.handlers[0].formatter, JsonFormatter)
    finally:
        root.handlers[:] = saved[0]
        root.setLevel(saved[1])


def test_a_newline_in_a_remote_field_gives_one_text_line() -> None:
    """Review finding 13: a report reason with a newline forged a log line of its own."""
    out = io.StringIO()
    text = logging.StreamHandler(out)
    text.setFormatter(handler("text").formatter)
    text.addFilter(SessionFilter())
    log = logging.getLogger("meshnet.test.injection")
    log.addHandler(text)
    try:
        log.warning("report: %s", "gone\n2026-12-02 12:00:00,000 INFO meshnet: all good\x1b[2J")
    finally:
        log.removeHandler(text)
    lines = out.getvalue().splitlines()
    assert len(lines) == 1 and "\\n2026-12-02" in lines[0] and "\\x1b[2J" in lines[0]

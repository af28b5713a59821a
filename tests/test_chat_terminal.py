"""`meshnet chat` at a terminal: keys typed while an answer streams are neither echoed nor
kept (a real pseudo-terminal), Ctrl-C stops an answer and not the chat, and the sampling
defaults and flags reach the request body."""

from __future__ import annotations

import io
import os
import pty
import termios
from collections.abc import Generator
from typing import Any

import pytest

from meshnet import terminal
from meshnet.cli import build_parser
from meshnet.cli.client import generate_options
from meshnet.terminal import GenerateOptions, muted, run_chat


def test_keys_typed_during_an_answer_are_not_echoed_nor_kept() -> None:
    master, slave = pty.openpty()
    keys = os.fdopen(slave, "r")
    try:
        assert termios.tcgetattr(slave)[3] & termios.ECHO
        with muted(keys):
            assert not termios.tcgetattr(slave)[3] & termios.ECHO
            os.write(master, b"typed at the answer\n")
        assert termios.tcgetattr(slave)[3] & termios.ECHO  # echo is back for the question
        os.set_blocking(slave, False)
        with pytest.raises(BlockingIOError):
            os.read(slave, 100)  # and what was typed is gone
    finally:
        keys.close()
        os.close(master)


class CtrlCAt(io.StringIO):
    """A terminal that gets Ctrl-C while `text` is being written."""

    def __init__(self, text: str) -> None:
        super().__init__()
        self.text: str | None = text

    def write(self, s: str) -> int:
        if s == self.text:
            self.text = None  # once
            raise KeyboardInterrupt
        return super().write(s)


def test_ctrl_c_stops_the_answer_and_the_chat_goes_on(monkeypatch: pytest.MonkeyPatch) -> None:
    asked: list[list[dict[str, str]]] = []
    closed: list[bool] = []

    def fake_stream(client: Any, options: Any, body: dict[str, Any]) -> Generator[str]:
        asked.append([dict(m) for m in body["messages"]])
        try:
            yield from (["Par", "is", " is", " lovely"] if len(asked) == 1 else ["Berlin."])
        finally:
            closed.append(True)

    monkeypatch.setattr(terminal, "stream", fake_stream)
    lines = iter(["France?", "Germany?", ""])
    out = CtrlCAt(" is")
    assert run_chat("http://127.0.0.1:9", GenerateOptions(), lambda _: next(lines), out) == 0
    assert "Paris [stopped]\nBerlin.\n" in out.getvalue()
    assert asked[1] == [
        {"role": "user", "content": "France?"},
        {"role": "assistant", "content": "Paris"},  # what was shown stays in the conversation
        {"role": "user", "content": "Germany?"},
    ]
    assert closed == [True, True]  # the stopped answer's HTTP stream was closed at once


def test_chat_samples_as_llama_cpp_users_expect_unless_told_otherwise() -> None:
    parser = build_parser()
    defaults = generate_options(parser.parse_args(["chat"]))
    assert (defaults.temperature, defaults.top_k, defaults.top_p) == (0.8, 40, 0.95)
    assert defaults.repetition_penalty == 1.1
    flags = ["chat", "--repetition-penalty", "1", "--presence-penalty", "0.5", "--top-k", "0"]
    options = generate_options(parser.parse_args(flags))
    assert (options.repetition_penalty, options.presence_penalty, options.top_k) == (1.0, 0.5, 0)

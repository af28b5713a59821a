"""Progress of long work: a live bar on a terminal, a few log lines elsewhere."""

from __future__ import annotations

import io
import logging
from collections.abc import Callable
from pathlib import Path

import pytest

from meshnet.observe.progress import progress


def test_without_a_terminal_it_logs_start_quarters_and_end_only(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="meshnet.observe.progress")
    with progress("loading default layers 0:40", 40, live=False) as task:
        for _ in range(40):
            task.advance()
    lines = [r.getMessage() for r in caplog.records]
    assert lines[0] == "loading default layers 0:40: started (40 steps)"
    assert lines[1:4] == [f"loading default layers 0:40: {n}/40" for n in (10, 20, 30)]
    assert lines[4].startswith("loading default layers 0:40: done in ")
    assert len(lines) == 5


def test_on_a_terminal_it_draws_a_bar_with_the_count() -> None:
    out = io.StringIO()
    with progress("layers served", 30, live=True, out=out) as task:
        task.update(10)
        task.update(30)
    drawn = out.getvalue()
    assert "layers served" in drawn and "30/30" in drawn
    assert "\x1b[" in drawn  # terminal control codes: a live display


def test_work_of_unknown_size_logs_start_and_end(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="meshnet.observe.progress")
    with progress("converting the vocabulary", live=False):
        pass
    assert [r.getMessage().split(" in ")[0] for r in caplog.records] == [
        "converting the vocabulary: started",
        "converting the vocabulary: done",
    ]


def test_loading_a_span_reports_its_progress(
    caplog: pytest.LogCaptureFixture, tiny_folder: Callable[[str], Path]
) -> None:
    from meshnet.models.loader import load_shard
    from meshnet.models.source import resolve
    from meshnet.types import LayerSpan

    source = resolve(str(tiny_folder("llama")))
    caplog.set_level(logging.INFO, logger="meshnet.observe.progress")
    load_shard(source, LayerSpan(0, 2), "fp32")
    lines = [r.getMessage() for r in caplog.records]
    assert lines[0].endswith("layers 0:2 (fp32): started (2 steps)")
    assert "layers 0:2 (fp32): done in " in lines[-1]

"""Every benchmark runs once at tiny size, so none can rot."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def run_tiny(name: str, timeout_s: float = 300) -> str:
    result = subprocess.run(
        [sys.executable, str(BENCHMARKS / name), "--tiny"],
        check=True,
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )
    return result.stdout


def test_wire_benchmark_prints_a_table() -> None:
    out = run_tiny("wire.py")
    rows = [line for line in out.splitlines() if line.startswith("| synthetic")]
    assert {row.split("|")[3].strip() for row in rows} == {"none", "zstd", "zstd-shuffle"}


@pytest.mark.parametrize("name", sorted(p.name for p in BENCHMARKS.glob("*.py")))
def test_every_benchmark_has_a_tiny_mode(name: str) -> None:
    assert "--tiny" in (BENCHMARKS / name).read_text()

"""Import-boundary rules: the package tree is the architecture."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "meshnet"
HTTP_FRAMEWORKS = ("starlette", "fastapi", "httpx", "uvicorn", "aiohttp")


def modules_after_import(module: str) -> set[str]:
    code = f"import sys, {module}; print('\\n'.join(sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True)
    return {name.split(".")[0] for name in out.stdout.split()}


def test_wire_imports_no_http_framework() -> None:
    loaded = modules_after_import("meshnet.wire")
    assert not loaded & set(HTTP_FRAMEWORKS)


def python_says(code: str) -> str:
    """What a fresh interpreter prints after running `code`."""
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True)
    return out.stdout.strip()


def test_tracker_never_imports_torch() -> None:
    code = (
        "import sys; from meshnet.tracker.serve import build_registry; "
        "from meshnet.config import TrackerConfig; build_registry(TrackerConfig()); "
        "print(sorted(m for m in ('torch', 'transformers', 'bitsandbytes') if m in sys.modules))"
    )
    assert python_says(code) == "[]"


def test_sizing_from_a_config_needs_no_torch() -> None:
    code = (
        "import sys; from meshnet.models.source import resolve; "
        "from meshnet.models.sizing import layer_bytes; "
        "layer_bytes(resolve('default').spec, 'nf4'); print('torch' in sys.modules)"
    )
    assert python_says(code) == "False"


@pytest.mark.parametrize("module", ["meshnet.types", "meshnet.errors", "meshnet.config"])
def test_base_modules_import_nothing_heavy(module: str) -> None:
    assert not modules_after_import(module) & {"torch", "numpy", *HTTP_FRAMEWORKS}


def test_no_source_file_outgrows_400_lines() -> None:
    long = {p.name: n for p in SRC.rglob("*.py") if (n := len(p.read_text().splitlines())) > 400}
    assert not long


def test_no_print_in_library_code() -> None:
    allowed = {"cli", "demo.py", "terminal.py", "status.py"}  # the terminal front ends
    offenders = [
        str(p.relative_to(SRC))
        for p in SRC.rglob("*.py")
        if p.relative_to(SRC).parts[0] not in allowed and "print(" in p.read_text()
    ]
    assert not offenders

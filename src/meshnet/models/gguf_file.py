"""GGUF metadata without torch: the memory-mapped reader and its fields (numpy only)."""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import Any


@lru_cache(maxsize=4)
def gguf_reader(path: Path) -> Any:
    """The memory-mapped reader of a GGUF file (parsing its vocabulary takes seconds)."""
    from gguf import GGUFReader

    return GGUFReader(str(path))


def gguf_fields(path: Path) -> dict[str, Any]:
    """All GGUF metadata as plain Python values."""
    reader = gguf_reader(path)
    return {name: field.contents() for name, field in reader.fields.items()}

"""Shared fixtures and helpers."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Awaitable, Iterator
from pathlib import Path
from typing import TypeVar

import pytest

T = TypeVar("T")


def run(coro: Awaitable[T]) -> T:
    """Run one coroutine to completion (tests stay synchronous; no plugin needed)."""

    async def wrapper() -> T:
        return await coro

    return asyncio.run(wrapper())


pytest_plugins = ["tests.models.fixtures"]


@pytest.fixture(scope="session", autouse=True)
def private_home(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """Tests, and every process they start, see a fresh temporary HOME: node folders and key
    files never land in the user's `~/.meshnet`. The tokenizer cache (`$MESHNET_CACHE`) stays
    where it was: it is a cache, and converting the GGUF vocabulary costs each run seconds."""
    saved = {name: os.environ.get(name) for name in ("HOME", "MESHNET_CACHE")}
    cache = saved["MESHNET_CACHE"] or str(Path.home() / ".cache" / "meshnet")
    home = tmp_path_factory.mktemp("home")
    os.environ.update(HOME=str(home), MESHNET_CACHE=cache)
    try:
        yield home
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """`gpu` tests need a CUDA device: where PyTorch sees none they are skipped, with why."""
    if not any(item.get_closest_marker("gpu") for item in items):
        return
    import torch

    from meshnet.models.device import no_cuda_reason

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason=f"needs a CUDA device: {no_cuda_reason()}")
    for item in items:
        if item.get_closest_marker("gpu"):
            item.add_marker(skip)

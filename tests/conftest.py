"""Shared fixtures and helpers."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

T = TypeVar("T")


def run(coro: Awaitable[T]) -> T:
    """Run one coroutine to completion (tests stay synchronous; no plugin needed)."""

    async def wrapper() -> T:
        return await coro

    return asyncio.run(wrapper())


pytest_plugins = ["tests.models.fixtures"]

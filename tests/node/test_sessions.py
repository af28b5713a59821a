"""Session caches: continuity, rollback, expiry and the memory cap."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from meshnet.errors import SessionError, SessionNotFoundError
from meshnet.models.loader import load_shard
from meshnet.models.source import resolve
from meshnet.node.sessions import SessionStore, expired, over_budget
from meshnet.node.torch_runner import TorchShardRunner
from meshnet.types import LayerSpan, ModelId, SessionId
from meshnet.wire import FrameMeta

S = SessionId


@pytest.mark.parametrize(
    ("used", "now", "ttl", "gone"),
    [
        ({S("a"): 0.0, S("b"): 5.0}, 10.0, 6.0, [S("a")]),
        ({S("a"): 0.0}, 6.0, 6.0, []),
        ({}, 1.0, 1.0, []),
    ],
)
def test_expired(
    used: dict[SessionId, float], now: float, ttl: float, gone: list[SessionId]
) -> None:
    assert expired(used, now, ttl) == gone


@pytest.mark.parametrize(
    ("sizes", "cap", "keep", "victims"),
    [
        ({S("a"): 5, S("b"): 5, S("c"): 5}, 10, S("c"), [S("a")]),
        ({S("a"): 5, S("b"): 5, S("c"): 5}, 4, S("c"), [S("a"), S("b")]),
        ({S("a"): 5, S("b"): 5}, 4, S("a"), [S("b")]),
        ({S("a"): 5}, 10, None, []),
    ],
)
def test_over_budget_evicts_least_recently_used(
    sizes: dict[SessionId, int], cap: int, keep: SessionId | None, victims: list[SessionId]
) -> None:
    assert over_budget(sizes, cap, keep) == victims


@pytest.fixture(scope="module")
def runner_factory(tiny_folder: Callable[[str], Path]) -> Callable[..., TorchShardRunner]:
    source = resolve(str(tiny_folder("llama")))
    shard = load_shard(source, LayerSpan(2, 4), "fp32")

    def make(**kwargs: float) -> TorchShardRunner:
        return TorchShardRunner(ModelId("tiny"), shard, **kwargs)  # type: ignore[arg-type]

    return make


def meta(session: str, position: int, index: int = 0, total: int = 1) -> FrameMeta:
    return FrameMeta(SessionId(session), ModelId("tiny"), LayerSpan(2, 4), position, index, total)


def test_gap_and_overlap_are_refused_and_change_nothing(
    runner_factory: Callable[..., TorchShardRunner],
) -> None:
    runner = runner_factory()
    x = torch.randn(1, 5, 64)
    first = runner.forward(meta("s", 0), x)
    for position in (3, 7):  # overlap, gap
        with pytest.raises(SessionError, match="overlap|gap"):
            runner.forward(meta("s", position), x[:, :1])
    with pytest.raises(SessionNotFoundError):
        runner.forward(meta("new", 4), x[:, :1])
    step = runner.forward(meta("s", 5), x[:, :1])
    again = runner_factory()
    again.forward(meta("s", 0), x)
    assert torch.equal(step, again.forward(meta("s", 5), x[:, :1]))  # cache was untouched
    assert first.shape == x.shape


def test_failed_forward_rolls_the_cache_back(
    runner_factory: Callable[..., TorchShardRunner],
) -> None:
    runner = runner_factory()
    runner.forward(meta("s", 0), torch.randn(1, 4, 64))
    with pytest.raises(RuntimeError):
        runner.forward(meta("s", 4), torch.randn(1, 2, 63))  # wrong hidden size fails inside
    from meshnet.models.cache import cache_length

    assert cache_length(runner.sessions._sessions[SessionId("s")].cache) == 4
    runner.forward(meta("s", 4), torch.randn(1, 1, 64))


def test_idle_sessions_expire_and_the_cap_evicts(
    runner_factory: Callable[..., TorchShardRunner],
) -> None:
    clock = [0.0]
    runner = runner_factory()
    runner.sessions = SessionStore(
        runner.sessions.new_cache,
        runner.sessions.measure,
        ttl_s=10.0,
        max_bytes=3000,
        clock=lambda: clock[0],
    )
    runner.forward(meta("a", 0), torch.randn(1, 3, 64))  # 2 layers x 2 x 2 heads x 16 x 4 B x 3
    clock[0] = 5.0
    runner.forward(meta("b", 0), torch.randn(1, 3, 64))
    assert runner.session_count() == 1  # 1536 B each: "a" evicted to fit 3000 B
    with pytest.raises(SessionNotFoundError):
        runner.forward(meta("a", 3), torch.randn(1, 1, 64))
    clock[0] = 16.0
    runner.sessions.expire()
    assert runner.session_count() == 0
    assert runner.drop(SessionId("b")) is False

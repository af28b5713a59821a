"""Session caches: continuity, rollback, expiry and the memory cap."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from meshnet.errors import LimitError, SessionError, SessionNotFoundError, WireError
from meshnet.models.loader import load_shard
from meshnet.models.source import resolve
from meshnet.node.sessions import SessionStore, expired, make_room, over_budget
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
    runner_factory: Callable[..., TorchShardRunner], monkeypatch: pytest.MonkeyPatch
) -> None:
    runner = runner_factory()
    runner.forward(meta("s", 0), torch.randn(1, 4, 64))
    real = runner.shard.forward

    def grows_then_fails(hidden: torch.Tensor, cache: object, position: int) -> torch.Tensor:
        real(hidden, cache, position)  # the cache grows...
        raise RuntimeError("a kernel failed")  # ...then the call fails

    monkeypatch.setattr(runner.shard, "forward", grows_then_fails)
    with pytest.raises(RuntimeError):
        runner.forward(meta("s", 4), torch.randn(1, 2, 64))
    monkeypatch.undo()
    from meshnet.models.cache import cache_length

    assert cache_length(runner.sessions._sessions[SessionId("s")].cache) == 4
    runner.forward(meta("s", 4), torch.randn(1, 1, 64))


@pytest.mark.parametrize(
    ("shape", "position", "field"),
    [((1, 2, 63), 4, "X-Meshnet-Shape"), ((2, 1, 64), 4, "X-Meshnet-Shape")],
)
def test_frames_the_shard_cannot_run_are_refused_before_it_runs(
    runner_factory: Callable[..., TorchShardRunner],
    shape: tuple[int, int, int],
    position: int,
    field: str,
) -> None:
    runner = runner_factory()
    runner.forward(meta("s", 0), torch.randn(1, 4, 64))
    with pytest.raises(WireError) as refused:
        runner.forward(meta("s", position), torch.randn(*shape))
    assert refused.value.field == field
    assert runner.sessions._sessions[SessionId("s")].length == 4


def test_positions_past_the_context_are_refused(
    runner_factory: Callable[..., TorchShardRunner],
) -> None:
    runner = runner_factory()
    context = int(runner.shard.config.max_position_embeddings)
    with pytest.raises(WireError) as refused:
        runner.forward(meta("s", 0), torch.randn(1, context + 1, 64))
    assert refused.value.field == "X-Meshnet-Position" and runner.session_count() == 0
    # a frame ending exactly at the context is the last one that fits (test review 12-07,
    # S1: refusing it, off by one, passed every fast test); one token more is refused
    runner.forward(meta("s", 0), torch.randn(1, context - 1, 64))
    runner.forward(meta("s", context - 1), torch.randn(1, 1, 64))
    with pytest.raises(WireError, match="exceed the model's context"):
        runner.forward(meta("s", context), torch.randn(1, 1, 64))


def test_the_cap_evicts_idle_sessions_refuses_otherwise_and_idle_ones_expire(
    runner_factory: Callable[..., TorchShardRunner],
) -> None:
    clock = [0.0]
    runner = runner_factory()
    runner.sessions = SessionStore(
        runner.sessions.new_cache,
        runner.sessions.measure,
        ttl_s=100.0,
        max_bytes=3000,
        evict_idle_s=10.0,
        clock=lambda: clock[0],
    )
    runner.forward(meta("a", 0), torch.randn(1, 3, 64))  # 2 layers x 2 x 2 heads x 16 x 4 B x 3
    clock[0] = 5.0
    with pytest.raises(LimitError):  # 1536 B each: "b" does not fit, and "a" is in use
        runner.forward(meta("b", 0), torch.randn(1, 3, 64))
    assert runner.session_count() == 1 and runner.sessions.refused == 1
    runner.forward(meta("a", 3), torch.randn(1, 1, 64))  # "a" was untouched
    clock[0] = 20.0
    runner.forward(meta("b", 0), torch.randn(1, 3, 64))  # "a" idle 15 s: evicted for room
    assert runner.session_count() == 1
    with pytest.raises(SessionNotFoundError):
        runner.forward(meta("a", 4), torch.randn(1, 1, 64))
    clock[0] = 121.0
    runner.sessions.expire()
    assert runner.session_count() == 0
    assert runner.drop(SessionId("b")) is False


@pytest.mark.parametrize(
    ("idle", "used", "need", "expected"),
    [
        ({}, 0, 100, []),  # fits
        ({"a": (50, 1.0)}, 50, 100, None),  # "a" is busy: refuse
        ({"a": (50, 20.0)}, 50, 100, ["a"]),  # "a" is idle: evict it
        ({"a": (50, 20.0), "b": (50, 20.0)}, 100, 60, ["a"]),  # evict only as much as needed
        ({"a": (50, 20.0), "b": (60, 1.0)}, 110, 100, None),  # evicting "a" is not enough
    ],
)
def test_make_room(
    idle: dict[str, tuple[int, float]], used: int, need: int, expected: list[str] | None
) -> None:
    assert make_room(idle, used, need, 120, 10.0) == expected  # type: ignore[arg-type]


REWIND_CASES = [
    ("llama", "fp32", 6),  # static cache: written by position (the fast path)
    ("llama", "bf16", 6),
    ("llama", "int8", 6),
    ("gpt2", "fp32", 6),  # eager cache: appended, so a token too many shows
    ("gemma3_text", "fp32", 300),  # eager, sliding layers already trimmed to their window
]


@pytest.mark.parametrize(("model_type", "quant", "prompt"), REWIND_CASES)
def test_a_rewind_drops_rejected_drafts_and_continues_as_a_fresh_cache_would(
    model_type: str, quant: str, prompt: int, tiny_folder: Callable[[str], Path]
) -> None:
    """ADR-0038: `prompt` tokens in, then 3 at position `prompt - 2` with the rewind flag:
    the output is a cache that only ever held the first `prompt - 2`, in every kind of cache;
    beyond 64 tokens back, or unflagged, refused."""
    from dataclasses import replace

    from meshnet.models.cache import cache_length

    source = resolve(str(tiny_folder(model_type)))
    runner = TorchShardRunner(ModelId("tiny"), load_shard(source, LayerSpan(2, 4), quant))  # type: ignore[arg-type]
    width, kept = int(runner.shard.config.hidden_size), prompt - 2
    torch.manual_seed(0)
    x, more = torch.randn(1, prompt, width), torch.randn(1, 3, width)
    runner.forward(meta("a", 0), x)
    with pytest.raises(SessionError, match="overlap"):
        runner.forward(meta("a", kept), more)  # without the flag
    rewound = runner.forward(replace(meta("a", kept), rewind=True), more)
    runner.forward(meta("b", 0), x[:, :kept])
    fresh = runner.forward(meta("b", kept), more)
    assert torch.allclose(rewound.float(), fresh.float(), atol=1e-5, rtol=0)
    session = runner.sessions._sessions[SessionId("a")]
    assert session.length == cache_length(session.cache) == kept + 3
    runner.forward(meta("a", kept + 3), torch.randn(1, 70, width))
    with pytest.raises(SessionError, match="at most 64"):
        runner.forward(replace(meta("a", kept + 8), rewind=True), more)
    assert session.length == cache_length(session.cache) == kept + 73  # refused: unchanged

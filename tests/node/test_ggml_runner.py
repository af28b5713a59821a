"""The ggml runner behind the node's seam (ADR-0051): the session contract of the torch runner
(continuity, rewinds, forks, batched rounds, refusals that change nothing), and the choice of
backend from the source, device and `--quant`."""

from __future__ import annotations

import pytest
import torch

from meshnet.errors import ConfigError, SessionError, WireError
from meshnet.models.backend import choose_backend
from meshnet.models.source import resolve
from meshnet.node.compute import compute_threads
from meshnet.node.ggml_runner import ggml_runner
from meshnet.node.scheduler import Failed
from meshnet.node.torch_runner import TorchShardRunner
from meshnet.types import LayerSpan, ModelId, SessionId
from meshnet.wire import FrameMeta

SPAN = LayerSpan(4, 9)
WIDTH = 576


def meta(
    session: str, position: int, *, fork: str | None = None, rewind: bool = False
) -> FrameMeta:
    forked = SessionId(fork) if fork else None
    return FrameMeta(SessionId(session), ModelId("m"), SPAN, position, fork=forked, rewind=rewind)


@pytest.fixture(scope="module")
def runner() -> TorchShardRunner:
    return ggml_runner(
        ModelId("m"),
        resolve("default").path,
        SPAN,
        threads=compute_threads(),
        ttl_s=600.0,
        max_cache_bytes=1 << 28,
        evict_idle_s=10.0,
    )


def hidden(tokens: int, seed: int = 0) -> torch.Tensor:
    torch.manual_seed(seed)
    return torch.randn(1, tokens, WIDTH).to(torch.bfloat16)


def test_sessions_continue_rewind_and_fork_as_with_torch(runner: TorchShardRunner) -> None:
    prompt, steps = hidden(6), hidden(3, seed=1)
    runner.forward(meta("a", 0), prompt)
    first = runner.forward(meta("a", 6), steps)
    assert first.dtype == torch.bfloat16 and first.shape == (1, 3, WIDTH)
    again = runner.forward(meta("a", 6, rewind=True), steps)  # drafts rejected, sent again
    assert torch.equal(first, again)
    forked = runner.forward(meta("b", 6, fork="a"), steps)
    assert torch.equal(first, forked)
    held = runner.sessions._sessions
    assert held[SessionId("a")].length == held[SessionId("b")].length == 9
    assert runner.cache_bytes() == sum(s.cache.nbytes for s in held.values())


def test_a_kept_prefix_leaves_the_pool_and_forks_answer_as_before(
    runner: TorchShardRunner,
) -> None:
    """ADR-0058: rounds attend over the pool's taken cells, so a kept prefix moves out."""
    prompt, steps = hidden(40, seed=2), hidden(2, seed=3)
    runner.forward(meta("p", 0), prompt)
    want = runner.forward(meta("p", 40), steps)
    pool = runner.shard.ggml.pool  # type: ignore[attr-defined]
    taken = int((pool.owner >= 0).sum())
    assert runner.drop(SessionId("p"), keep=True)
    assert int((pool.owner >= 0).sum()) == taken - 42  # its cells are free
    assert runner.prefix_stats().kept_bytes == 42 * runner.sessions.bytes_per_token
    hits = runner.prefix_stats().hits
    got = runner.forward(meta("q", 40, fork="p"), steps)
    assert torch.equal(want, got)
    with pytest.raises(SessionError, match="ended"):  # a kept prefix takes no frames
        runner.forward(meta("p", 42), steps[:, :1])
    assert runner.prefix_stats().hits == hits + 1


def test_a_batched_round_answers_each_session_as_alone(runner: TorchShardRunner) -> None:
    for sid, length in (("x1", 3), ("y1", 5), ("x2", 3), ("y2", 5)):
        runner.forward(meta(sid, 0), hidden(length, seed=length))
    alone = [
        runner.forward(meta("x1", 3), hidden(1, 7)),
        runner.forward(meta("y1", 5), hidden(1, 8)),
    ]
    together = runner.forward_many(
        [
            (meta("x2", 3), hidden(1, 7)),
            (meta("y2", 5), hidden(1, 8)),
            (meta("x2", 3), hidden(1, 9)),
        ]
    )
    for a, b in zip(together[:2], alone, strict=True):
        assert isinstance(a, torch.Tensor)
        torch.testing.assert_close(a.float(), b.float(), rtol=0.02, atol=0.05)
    assert isinstance(together[2], Failed)  # x2 twice in one round: refused alone
    assert isinstance(together[2].error, SessionError)


def test_refused_frames_change_nothing(runner: TorchShardRunner) -> None:
    runner.forward(meta("r", 0), hidden(4))
    with pytest.raises(SessionError):
        runner.forward(meta("r", 7), hidden(1))  # not where the session stopped
    with pytest.raises(WireError, match="batch 1"):
        runner.forward(meta("r", 4), torch.zeros(2, 1, WIDTH, dtype=torch.bfloat16))
    with pytest.raises(WireError, match="hidden size"):
        runner.forward(meta("r", 4), torch.zeros(1, 1, 64, dtype=torch.bfloat16))
    with pytest.raises(WireError, match="context"):
        runner.forward(meta("r", 4), torch.zeros(1, 8200, WIDTH, dtype=torch.bfloat16))
    assert runner.sessions._sessions[SessionId("r")].length == 4
    runner.forward(meta("r", 4), hidden(1))  # and it goes on


@pytest.mark.parametrize(
    ("asked", "gguf", "device", "quant", "chosen"),
    [
        ("auto", True, "cpu", None, "ggml"),
        ("auto", True, "cpu", "gguf", "ggml"),
        ("auto", True, "cpu", "int8", "torch"),  # a conversion asked for: torch's work
        ("auto", True, "cuda:0", None, "torch"),
        ("auto", False, "cpu", None, "torch"),  # a checkpoint folder
        ("torch", True, "cpu", None, "torch"),
        ("ggml", True, "cpu", None, "ggml"),
    ],
)
def test_the_backend_follows_source_device_and_quant(
    asked: str, gguf: bool, device: str, quant: str | None, chosen: str
) -> None:
    got = choose_backend(asked, gguf=gguf, device=device, quant=quant, has_graph=True)  # type: ignore[arg-type]
    assert got == chosen


@pytest.mark.parametrize(
    ("asked", "gguf", "device", "quant", "has_graph", "why"),
    [
        ("ggml", False, "cpu", None, True, "GGUF files only"),
        ("ggml", True, "cuda:0", None, True, "on the CPU"),
        ("ggml", True, "cpu", "q4", True, "converts the weights"),
        ("ggml", True, "cpu", None, False, "no graph"),
        ("torch", True, "cpu", "gguf", True, "only ggml computes"),
        ("auto", False, "cpu", "gguf", True, "GGUF files only"),
    ],
)
def test_a_backend_that_cannot_serve_is_refused_naming_why(
    asked: str, gguf: bool, device: str, quant: str | None, has_graph: bool, why: str
) -> None:
    with pytest.raises(ConfigError, match=why):
        choose_backend(asked, gguf=gguf, device=device, quant=quant, has_graph=has_graph)  # type: ignore[arg-type]


def test_dropping_a_long_session_gives_its_cells_pages_back(runner: TorchShardRunner) -> None:
    """Review K1: the drop runs on the compute thread, which then returns the pages of the
    free cells past the last taken one (`KvPool.give_back`)."""
    pool = runner.shard.ggml.pool  # type: ignore[attr-defined]
    runner.forward(meta("long", 0), hidden(1200, seed=4))
    assert pool.resident >= 1200
    assert runner.drop(SessionId("long"))
    assert pool.resident == pool.used_cells() < 1200

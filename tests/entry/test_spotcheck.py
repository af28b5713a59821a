"""Integrity spot checks: who a disagreement bans, and a lying copy caught in a generation."""

from __future__ import annotations

import random

import pytest
import torch

from meshnet.entry.bans import Bans
from meshnet.entry.hops import Hops
from meshnet.entry.routes import StaticRoutes
from meshnet.entry.spotcheck import (
    SpotChecker,
    copy_route,
    outliers,
    relative_error,
    tolerance,
)
from meshnet.errors import MissingLayersError
from meshnet.node.runner import EchoRunner
from meshnet.types import Hop, LayerSpan, ModelId, NodeId, Quant
from tests.conftest import run
from tests.entry.fakes import fake_mesh
from tests.entry.test_failover import PARAMS, PROMPT, failure_free
from tests.entry.test_generation import collect
from tests.entry.test_hostile_hops import Lying

BASE = torch.randn(1, 3, 16, generator=torch.Generator().manual_seed(0))


def off_by(fraction: float) -> torch.Tensor:
    """BASE plus a perturbation of `fraction` of its norm."""
    noise = torch.randn(BASE.shape, generator=torch.Generator().manual_seed(1))
    return BASE + fraction * noise * BASE.norm() / noise.norm()


@pytest.mark.parametrize(
    ("results", "guilty"),
    [
        ([("a", 0.0, "bf16"), ("b", 0.01, "int8")], []),  # honest copies differ a little
        ([("a", 0.0, "bf16"), ("b", 1.0, "bf16")], ["a", "b"]),  # two: both banned
        ([("a", 1.0, "bf16"), ("b", 0.0, "bf16"), ("c", 0.02, "fp32")], ["a"]),  # majority
        ([("a", 0.0, "bf16"), ("b", 1.0, "bf16"), ("c", 0.01, "int8")], ["b"]),
        ([("a", 0.0, "bf16"), ("b", 1.0, "bf16"), ("c", 2.0, "bf16")], ["a", "b", "c"]),
        ([("a", 0.0, "nf4"), ("b", 0.3, "bf16")], []),  # nf4 differs more, honestly
        ([("a", 0.0, "int8"), ("b", 0.3, "bf16")], ["a", "b"]),  # int8 does not
        ([("a", 0.0, None), ("b", 0.3, "bf16")], []),  # unknown: the loose bound
        # N8: a liar that declares nf4 (or q4) passed 30% noise against any copy; a copy of
        # the same quantization holds the same weights and catches it
        ([("a", 0.0, "nf4"), ("b", 0.3, "nf4")], ["a", "b"]),
        ([("a", 0.0, "q4"), ("b", 0.3, "q4")], ["a", "b"]),
        ([("a", 0.0, "nf4"), ("b", 0.05, "nf4")], []),  # honest: compute dtype, batching
    ],
)
def test_whoever_agrees_with_no_other_copy_is_guilty(
    results: list[tuple[str, float, Quant | None]], guilty: list[str]
) -> None:
    assert outliers([(k, off_by(f), q) for k, f, q in results]) == guilty


@pytest.mark.parametrize(
    ("results", "guilty"),
    [
        # N8 in a ggml mesh: ggml's copies declare gguf; a liar declaring another quantization
        # got the loose bound. gguf is the file's weights: no room against bf16...
        ([("a", 0.0, "gguf"), ("b", 0.3, "bf16")], ["a", "b"]),
        ([("a", 0.0, "gguf"), ("b", 0.04, "int8")], []),  # measured honest: <= 0.064
        # ...and a GGUF mesh (no loose bound) gives none to a declared nf4, q4 or nothing
        ([("a", 0.0, "gguf"), ("b", 0.3, "nf4")], ["a", "b"]),
        ([("a", 0.0, "gguf"), ("b", 0.3, "q4")], ["a", "b"]),
        ([("a", 0.0, "gguf"), ("b", 0.3, None)], ["a", "b"]),
        ([("a", 0.0, "gguf"), ("b", 0.1, "q4")], []),
    ],
)
def test_in_a_gguf_mesh_no_declared_quantization_buys_room(
    results: list[tuple[str, float, Quant | None]], guilty: list[str]
) -> None:
    assert outliers([(k, off_by(f), q) for k, f, q in results], loose=False) == guilty


def test_tolerances_and_errors() -> None:
    assert tolerance("bf16", "int8") < tolerance("nf4", "bf16") == tolerance("bf16", "q4")
    assert tolerance("gguf", "bf16") == tolerance("bf16", "int8") == tolerance("nf4", "bf16", False)
    assert relative_error(BASE, BASE) == 0.0
    assert relative_error(BASE[:, :2], BASE) == float("inf")  # another shape never agrees
    assert abs(relative_error(off_by(0.1), BASE) - 0.1) < 1e-5


def test_bans_expire() -> None:
    now = [0.0]
    bans = Bans(ban_s=10.0, clock=lambda: now[0])
    bans.ban("node-x")  # type: ignore[arg-type]
    assert bans.active() == {"node-x"}
    now[0] = 10.5
    assert bans.active() == frozenset()


def test_rates_outside_zero_to_one_are_refused() -> None:
    with pytest.raises(ValueError, match="fraction"):
        SpotChecker(1.5, random.Random(0), Bans(60.0))


def Liar(runner: EchoRunner, position: int, scale: float = 0.5) -> Lying:  # noqa: N802
    """An echo runner whose answers are off by a bias the next hop cannot see, from
    `position` on."""
    return Lying(runner, position, lambda m, h: (m, h + scale * h.abs().max()))


def checked_mesh(rate: float, copies: tuple[str, ...] = ("b3",), context: bool = False):  # type: ignore[no-untyped-def]
    checker = SpotChecker(rate, random.Random(0), Bans(ban_s=600.0))
    generator, transport, runners = fake_mesh(
        chunk_tokens=16, replicas=True, copies=copies, spot_checker=checker, context=context
    )
    return generator, transport, runners, checker


def checked_run(generator, checker):  # type: ignore[no-untyped-def]
    """One generation, then the check still in flight, in one event loop."""

    async def both():  # type: ignore[no-untyped-def]
        result = await collect(generator, PROMPT, PARAMS)
        await checker.drain()
        return result

    return run(both())


def test_honest_copies_pass_every_check_and_leave_no_sessions() -> None:
    """Context runners: an answer is never its input, so a check that compared an answer
    with the input it re-ran (not with the re-run's output) would ban honest copies."""
    generator, transport, runners, checker = checked_mesh(rate=1.0, context=True)
    text, _ = checked_run(generator, checker)
    assert text == failure_free()
    metrics = generator.pipeline.metrics
    assert metrics.spot_checks.labels("match")._value.get() >= 1
    assert metrics.spot_checks.labels("mismatch")._value.get() == 0
    assert not checker.bans.active() and checker.tokens_rerun > 0
    assert all(r.session_count() == 0 for r in runners.values())  # check sessions closed too


def test_a_lying_copy_is_banned_reported_and_routed_around() -> None:
    """b answers wrong from position 55 on; checks against b2 and b3 find it, the entry
    bans it (and only it), tells the tracker, and the session moves to another copy."""
    generator, transport, runners, checker = checked_mesh(rate=1.0)
    runners["b"] = Liar(runners["b"], 55)  # type: ignore[assignment]
    transport.runners = runners
    checked_run(generator, checker)
    assert checker.bans.active() == {"node-b"}
    routes = generator.pipeline.hops.routes
    assert isinstance(routes, StaticRoutes) and routes.reported == ["node-b"]
    assert generator.pipeline.metrics.spot_checks.labels("mismatch")._value.get() >= 1
    _, end = run(collect(generator, PROMPT, PARAMS))  # the next request avoids it
    assert "node-b" not in [h.node_id for h in end.route]


def test_without_a_third_copy_both_parties_are_banned() -> None:
    """Nobody can tell which of two copies lied: both go, and with them the layers 4:6; the
    generation ends with 503 naming them rather than go on with an answer in doubt."""
    generator, transport, runners, checker = checked_mesh(rate=1.0, copies=())
    runners["b"] = Liar(runners["b"], 55)  # type: ignore[assignment]
    transport.runners = runners
    with pytest.raises(MissingLayersError, match="4:6"):
        checked_run(generator, checker)
    assert checker.bans.active() == {"node-b", "node-b2"}


def test_rate_zero_checks_nothing() -> None:
    generator, transport, runners, checker = checked_mesh(rate=0.0)
    run(collect(generator, PROMPT, PARAMS))
    assert checker.tokens_rerun == 0 and not [f for f in transport.frames if f[0] == "b3"]


def test_a_copy_is_drawn_from_another_host_when_there_is_one() -> None:
    """Review N8: two lying copies on one host agreed and the honest one was banned. The
    copies that check (and judge) come from hosts not yet asked, when the mesh has one."""
    span = LayerSpan(4, 6)
    same = [Hop(NodeId(f"x{i}"), f"http://10.0.0.1:{i}", span) for i in (1, 2)]
    other = Hop(NodeId("y"), "http://10.0.0.2:1", span)
    hops = Hops(ModelId("m"), 0, StaticRoutes([*same, other]), None)  # type: ignore[arg-type]
    found = run(copy_route(hops, span, frozenset({NodeId("x1")}), frozenset({"10.0.0.1"})))  # type: ignore[arg-type]
    assert found == [other]
    alone = Hops(ModelId("m"), 0, StaticRoutes(same), None)  # type: ignore[arg-type]  # any copy
    fallback = run(copy_route(alone, span, frozenset({NodeId("x1")}), frozenset({"10.0.0.1"})))  # type: ignore[arg-type]
    assert fallback == [same[1]]

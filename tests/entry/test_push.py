"""Pushed steps with fake hops (ADR-0034): same output as relayed ones, and a hop that fails
mid-push moves the session to a new route replayed from the first hop's inputs."""

from __future__ import annotations

import random
from types import SimpleNamespace
from typing import Any, cast

import pytest

from meshnet.assemble.entry import make_generator
from meshnet.config import EntryConfig, WireConfig, WireLimits
from meshnet.entry.bans import Bans
from meshnet.entry.routes import StaticRoutes
from meshnet.entry.spotcheck import SpotChecker
from meshnet.entry.transport import InProcessTransport
from meshnet.node.app import NodeService
from tests.conftest import run
from tests.entry.fakes import fake_mesh, scored
from tests.entry.test_failover import PARAMS, PROMPT, failure_free, failure_free_scores, kill_at
from tests.entry.test_generation import collect


@pytest.mark.parametrize("pipelined", [False, True])
def test_pushed_steps_give_the_relayed_output(pipelined: bool) -> None:
    generator, transport, runners = fake_mesh(
        chunk_tokens=16, push=True, pipelined=pipelined, context=True
    )
    text, end, scores = run(scored(generator, PROMPT, PARAMS))
    assert text == failure_free() and scores == failure_free_scores()
    # 50 prompt tokens in 4 chunks, then 19 decode steps: each one push through both hops;
    # a pipelined prompt's chunks go hop by hop (ADR-0036), its decode steps pushed
    assert transport.pushes == (0 if pipelined else 4) + 19
    assert all(r.session_count() == 0 for r in runners.values())


@pytest.mark.parametrize(
    ("address", "position"),
    [("a", 55), ("b", 50), ("b", 68), ("a", 16), ("b", 32), ("a", 0)],
)
def test_a_hop_failing_mid_push_costs_a_pause_and_nothing_else(address: str, position: int) -> None:
    generator, transport, runners = fake_mesh(
        chunk_tokens=16, replicas=True, push=True, context=True
    )
    kill_at(transport, address, position)
    text, end, scores = run(scored(generator, PROMPT, PARAMS))
    assert text == failure_free() and scores == failure_free_scores()
    moved_off(generator, end, runners, address)


def moved_off(generator: Any, end: Any, runners: dict[str, Any], address: str) -> None:
    """The session left `address` once, for a whole route without it, which was reported;
    every cache but the dead hop's is gone."""
    assert len(end.failover_pauses_s) == 1
    hops = [h.node_id for h in end.route][1:]
    assert f"node-{address}" not in hops and len(hops) == 2
    routes = generator.pipeline.hops.routes
    assert isinstance(routes, StaticRoutes) and routes.reported == [f"node-{address}"]
    assert all(r.session_count() == 0 for name, r in runners.items() if name != address)


def test_an_entry_that_spot_checks_relays() -> None:
    checker = SpotChecker(0.5, random.Random(0), Bans(ban_s=60.0))
    generator, transport, _ = fake_mesh(chunk_tokens=16, push=True, spot_checker=checker)
    run(collect(generator, PROMPT, PARAMS))
    assert transport.pushes == 0 and not generator.pipeline.hops.push


def test_an_entry_without_the_swarm_key_relays() -> None:
    service = NodeService([], WireLimits(), WireConfig())
    assert service.forwarder.signer.key is None
    generator, _, _ = fake_mesh(push=True)
    model = SimpleNamespace(
        runner=generator.pipeline.local,
        num_layers=6,
        head=generator.pipeline.head,
        codec=generator.codec,
        max_context=4096,
        file_weights=True,
    )
    config = EntryConfig(push=True, spot_check_rate=0.0)
    built = make_generator(
        cast(Any, model), service, StaticRoutes([]), InProcessTransport({}), config
    )
    assert not built.pipeline.hops.push
    checker = built.pipeline.hops.checker
    assert isinstance(checker, SpotChecker) and not checker.loose  # a GGUF mesh: one tolerance

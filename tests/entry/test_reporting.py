"""What an entry node reports of each request: a summary for the dashboard and its metrics."""

from __future__ import annotations

import pytest

from meshnet.errors import RouteError
from meshnet.text.params import GenerationParams, SamplingParams
from meshnet.tracker import messages as msg
from tests.conftest import run
from tests.entry.fakes import fake_mesh
from tests.entry.test_generation import collect

GREEDY = SamplingParams(temperature=0.0)


def sample_value(generator: object, name: str, **labels: str) -> float:
    value = generator.metrics.registry.get_sample_value(name, labels)  # type: ignore[attr-defined]
    return float(value or 0.0)


def test_a_finished_request_is_summarised_and_counted() -> None:
    generator, _, _ = fake_mesh()
    ended: list[msg.RequestSummary] = []
    generator.on_end = ended.append
    text, end = run(collect(generator, "abc", GenerationParams(5, (), GREEDY)))
    (summary,) = ended
    assert summary.outcome == "length" and summary.session.startswith("s-")
    assert (summary.prompt_tokens, summary.completion_tokens) == (3, 5)
    assert summary.decode_tokens_per_s == round(end.decode_tokens_per_s, 2)
    assert summary.time_to_first_token_s <= summary.duration_s
    assert sample_value(generator, "meshnet_tokens_generated_total", model="fake") == 5
    assert sample_value(generator, "meshnet_requests_total", model="fake", outcome="length") == 1


def test_end_of_sequence_is_not_counted_as_a_generated_token() -> None:
    generator, _, _ = fake_mesh()
    run(collect(generator, "|", GenerationParams(50, (), GREEDY)))  # 3 tokens, then EOS
    assert sample_value(generator, "meshnet_tokens_generated_total", model="fake") == 3


def test_a_request_that_fails_is_summarised_with_the_error() -> None:
    generator, _, _ = fake_mesh()
    ended: list[msg.RequestSummary] = []
    generator.on_end = ended.append

    async def no_route(
        model: str, start: int, end: int | None = None, exclude: object = None
    ) -> list[object]:
        raise RouteError("no node serves layers 4:6 of m")

    generator.pipeline.hops.routes.route = no_route  # type: ignore[method-assign,assignment]
    with pytest.raises(RouteError):
        run(collect(generator, "abc", GenerationParams(5, (), GREEDY)))
    (summary,) = ended
    assert summary.outcome == "error" and summary.error == "no node serves layers 4:6 of m"
    assert sample_value(generator, "meshnet_requests_total", model="fake", outcome="error") == 1


def test_failovers_are_counted() -> None:
    generator, transport, _ = fake_mesh(replicas=True)
    ended: list[msg.RequestSummary] = []
    generator.on_end = ended.append
    transport.dead.add("a")
    run(collect(generator, "abc", GenerationParams(3, (), GREEDY)))
    assert ended[0].failovers == 1
    assert generator.pipeline.metrics.registry.get_sample_value("meshnet_failovers_total") == 1

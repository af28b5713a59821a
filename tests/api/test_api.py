"""The OpenAI-compatible API over a fake mesh, in-process: shapes, streaming, errors.

The official `openai` package is the client (over an ASGI transport); raw HTTP checks the
server-sent event format and error bodies byte for byte where the client would hide them.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
import torch
from fastapi import FastAPI

from meshnet.api.app import create_app
from meshnet.errors import MissingLayersError, SessionError
from meshnet.node.runner import EchoRunner
from meshnet.types import LayerSpan
from meshnet.wire import FrameMeta
from tests.conftest import run
from tests.entry.fakes import MODEL, fake_mesh


@pytest.fixture
def app() -> Iterator[FastAPI]:
    generator, _, runners = fake_mesh()
    application = create_app({"fake": generator}, default_max_tokens=8)
    application.state.runners = runners
    yield application
    assert all(r.session_count() == 0 for r in runners.values()), "a session was left open"


def client(app: FastAPI) -> openai.AsyncOpenAI:
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://localhost")
    return openai.AsyncOpenAI(api_key="unused", base_url="http://localhost/v1", http_client=http)


def post(app: FastAPI, path: str, body: dict[str, object]) -> httpx.Response:
    async def go() -> httpx.Response:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://localhost") as http:
            return await http.post(path, json=body)

    return run(go())


COMPLETION = {"model": "fake", "prompt": "abc", "temperature": 0, "max_tokens": 4}
CHAT = {"model": "fake", "messages": [{"role": "user", "content": "hi"}], "temperature": 0}


def test_models_lists_what_the_entry_serves(app: FastAPI) -> None:
    models = run(client(app).models.list())
    assert [m.id for m in models.data] == ["fake"]


def test_chat_completion_with_the_openai_client(app: FastAPI) -> None:
    answer = run(
        client(app).chat.completions.create(
            model="fake", messages=[{"role": "user", "content": "hi"}], temperature=0, max_tokens=4
        )
    )
    # the char codec's chat prompt ends "assistant: ", so the fake continues with "!", '"', ...
    assert answer.choices[0].message.content == '!"#$'
    assert answer.choices[0].finish_reason == "length"
    assert answer.usage is not None and answer.usage.completion_tokens == 4
    assert answer.usage.total_tokens == answer.usage.prompt_tokens + 4


def test_chat_streaming_with_the_openai_client(app: FastAPI) -> None:
    async def go() -> list[openai.types.chat.ChatCompletionChunk]:
        stream = await client(app).chat.completions.create(
            model="fake",
            messages=[{"role": "user", "content": "hi"}],
            temperature=0,
            max_tokens=5,
            stop=["$"],
            stream=True,
            stream_options={"include_usage": True},
        )
        return [chunk async for chunk in stream]

    chunks = run(go())
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == '!"#'
    assert chunks[0].choices[0].delta.role == "assistant"
    finals = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finals[-1] == "stop" and not any(finals[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 4  # "!", '"', "#", "$" (the stop)


def test_completions_streaming_and_not(app: FastAPI) -> None:
    answer = run(client(app).completions.create(model="fake", prompt="abc", temperature=0))
    assert answer.choices[0].text == "defghijklmnopqrs"  # default max_tokens of completions is 16
    assert answer.object == "text_completion"

    async def go() -> str:
        stream = await client(app).completions.create(
            model="fake", prompt="abc", temperature=0, max_tokens=3, stream=True
        )
        return "".join([c.choices[0].text async for c in stream if c.choices])

    assert run(go()) == "def"


def test_sse_wire_format(app: FastAPI) -> None:
    response = post(app, "/v1/chat/completions", CHAT | {"stream": True, "max_tokens": 2})
    assert response.headers["content-type"].startswith("text/event-stream")
    events = [line for line in response.text.split("\n\n") if line]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"
    bodies = [json.loads(e[len("data: ") :]) for e in events[:-1]]
    assert {b["object"] for b in bodies} == {"chat.completion.chunk"}
    assert len({b["id"] for b in bodies}) == 1
    assert bodies[-1]["usage"]["completion_tokens"] == 2
    assert [h["span"] for h in bodies[-1]["meshnet"]["route"]] == ["0:2", "2:4", "4:6"]


def test_chat_answer_carries_the_route(app: FastAPI) -> None:
    body = post(app, "/v1/chat/completions", CHAT | {"max_tokens": 2}).json()
    assert body["object"] == "chat.completion"
    assert body["choices"][0]["message"] == {"role": "assistant", "content": '!"'}
    assert [h["node_id"] for h in body["meshnet"]["route"]] == ["entry", "node-a", "node-b"]


@pytest.mark.parametrize(
    ("path", "body", "status", "param"),
    [
        ("/v1/chat/completions", CHAT | {"model": "nope"}, 404, "model"),
        ("/v1/chat/completions", CHAT | {"messages": []}, 400, "messages"),
        ("/v1/chat/completions", CHAT | {"temperature": 9}, 400, "temperature"),
        ("/v1/chat/completions", CHAT | {"n": 17}, 400, "n"),
        ("/v1/completions", COMPLETION | {"n": 0}, 400, "n"),
        ("/v1/chat/completions", CHAT | {"max_tokens": 0}, 400, "max_tokens"),
        ("/v1/chat/completions", CHAT | {"max_tokens": 10**6}, 400, "max_tokens"),
        ("/v1/chat/completions", CHAT | {"presence_penalty": 2.5}, 400, "presence_penalty"),
        ("/v1/chat/completions", CHAT | {"frequency_penalty": -3}, 400, "frequency_penalty"),
        ("/v1/completions", COMPLETION | {"repetition_penalty": 0}, 400, "repetition_penalty"),
        ("/v1/chat/completions", CHAT | {"bogus": 1}, 400, "bogus"),
        ("/v1/chat/completions", CHAT | {"stop": ["a"] * 5}, 400, "stop"),
        ("/v1/completions", {"model": "fake", "prompt": ""}, 400, "prompt"),
        ("/v1/completions", {"model": "fake", "prompt": ["a", "b"]}, 400, "prompt"),
    ],
)
def test_errors_in_openai_shape(
    app: FastAPI, path: str, body: dict[str, object], status: int, param: str
) -> None:
    response = post(app, path, body)
    assert response.status_code == status
    error = response.json()["error"]
    assert error["message"] and error["type"] and error["param"] == param


def test_openai_client_sees_errors_as_exceptions(app: FastAPI) -> None:
    with pytest.raises(openai.NotFoundError, match="not served"):
        run(
            client(app).chat.completions.create(
                model="nope", messages=[{"role": "user", "content": "x"}]
            )
        )
    with pytest.raises(openai.BadRequestError):
        run(client(app).completions.create(model="fake", prompt="a", temperature=7))


class NoRoute:
    degraded = False

    async def route(self, model: str, start: int, **_: object) -> list[object]:
        raise MissingLayersError("no node serves layers 4:6 of fake", missing=[(4, 6)])


class FailingRunner(EchoRunner):
    def forward(self, meta: FrameMeta, hidden: torch.Tensor) -> torch.Tensor:
        if meta.position > 3:  # fail a few tokens into the answer
            raise SessionError("cache lost", field="position")
        return super().forward(meta, hidden)


def test_missing_layers_is_503_naming_them() -> None:
    generator, _, runners = fake_mesh()
    generator.pipeline.hops.routes = NoRoute()  # type: ignore[assignment]
    response = post(create_app({"fake": generator}), "/v1/completions", COMPLETION)
    assert response.status_code == 503
    assert "4:6" in response.json()["error"]["message"]
    assert all(r.session_count() == 0 for r in runners.values())


def test_a_failing_hop_without_replacement_is_503_naming_the_layers() -> None:
    generator, transport, runners = fake_mesh()
    transport.runners["b"] = FailingRunner(MODEL, LayerSpan(4, 6))  # type: ignore[index]
    response = post(
        create_app({"fake": generator}), "/v1/completions", COMPLETION | {"prompt": "abcde"}
    )
    assert response.status_code == 503
    assert "4:6" in response.json()["error"]["message"]
    assert all(r.session_count() == 0 for r in runners.values())


def test_a_failing_hop_mid_stream_ends_the_stream_with_an_error_event() -> None:
    generator, transport, runners = fake_mesh()
    transport.runners["b"] = FailingRunner(MODEL, LayerSpan(4, 6))  # type: ignore[index]
    body = COMPLETION | {"prompt": "ab", "stream": True, "max_tokens": 10}
    response = post(create_app({"fake": generator}), "/v1/completions", body)
    events = [e for e in response.text.split("\n\n") if e]
    assert events[-1] == "data: [DONE]"
    assert json.loads(events[-2][len("data: ") :])["error"]["type"] == "MissingLayersError"
    assert all(r.session_count() == 0 for r in runners.values())


DOCS_API = Path(__file__).resolve().parents[2] / "docs" / "api.md"


def refused_fields(section: str) -> list[str]:
    """The fields `docs/api.md` lists as refused in `section` (its table rows)."""
    text = DOCS_API.read_text().split(f"## `POST {section}`")[1].split("\n## ")[0]
    rows = [line for line in text.splitlines() if line.startswith("| `") and "refused" in line]
    return [f for row in rows for f in re.findall(r"`([a-z_]+)`", row.split(" | ")[0])]


@pytest.mark.parametrize(
    ("path", "base"),
    [("/v1/chat/completions", CHAT), ("/v1/completions", COMPLETION)],
)
def test_every_field_the_api_doc_lists_as_refused_is_refused_by_name(
    app: FastAPI, path: str, base: dict[str, object]
) -> None:
    fields = refused_fields(path)
    assert len(fields) >= (14 if "chat" in path else 4)
    for field in fields:
        value: object = {"x": 1} if field != "logprobs" else True
        response = post(app, path, base | {field: value})
        assert response.status_code == 400, field
        assert response.json()["error"]["param"].split(".")[0] == field


def test_penalties_are_accepted_in_openai_ranges(app: FastAPI) -> None:
    body = CHAT | {"presence_penalty": 2, "frequency_penalty": -2, "repetition_penalty": 1.3}
    response = post(app, "/v1/chat/completions", body)
    assert response.status_code == 200, response.text
    completion = run(
        client(app).completions.create(
            model="fake", prompt="abc", max_tokens=3, temperature=0, frequency_penalty=0.5
        )
    )
    assert completion.choices[0].text == "def"  # the counting model's margin outweighs it


def test_logprobs_are_the_log_softmax_of_the_entry_logits(app: FastAPI) -> None:
    """The fake head gives the next letter logit 20 and the 127 other ids 0."""
    chosen, other = 20 - math.log(math.exp(20) + 127), -math.log(math.exp(20) + 127)
    body = CHAT | {"max_tokens": 3, "logprobs": True, "top_logprobs": 2}
    answer = post(app, "/v1/chat/completions", body).json()
    content = answer["choices"][0]["logprobs"]["content"]
    text = answer["choices"][0]["message"]["content"]
    assert "".join(e["token"] for e in content) == text and len(content) == 3
    for entry in content:
        assert entry["logprob"] == pytest.approx(chosen, abs=1e-5)
        assert entry["bytes"] == list(entry["token"].encode())
        top = entry["top_logprobs"]
        assert top[0]["token"] == entry["token"] and top[1]["logprob"] == pytest.approx(other)
    chunks = [
        json.loads(line[6:])
        for line in post(app, "/v1/chat/completions", body | {"stream": True}).text.splitlines()
        if line.startswith("data: {")
    ]
    streamed = [
        entry
        for chunk in chunks
        for entry in (chunk["choices"][0].get("logprobs") or {}).get("content") or []
    ]
    assert streamed == content
    plain = post(app, "/v1/chat/completions", CHAT | {"max_tokens": 3}).json()
    assert plain["choices"][0]["logprobs"] is None


def test_completions_logprobs_come_in_the_legacy_lists(app: FastAPI) -> None:
    answer = post(app, "/v1/completions", COMPLETION | {"max_tokens": 3, "logprobs": 2}).json()
    lists = answer["choices"][0]["logprobs"]
    assert lists["tokens"] == ["d", "e", "f"] and lists["text_offset"] == [0, 1, 2]
    assert [len(t) for t in lists["top_logprobs"]] == [2, 2, 2]
    assert lists["token_logprobs"][0] == pytest.approx(20 - math.log(math.exp(20) + 127), abs=1e-5)
    refused = post(app, "/v1/chat/completions", CHAT | {"top_logprobs": 2})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "top_logprobs"
    too_many = post(app, "/v1/completions", COMPLETION | {"logprobs": 6})
    assert too_many.status_code == 400 and too_many.json()["error"]["param"] == "logprobs"


PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 6}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}


def test_response_format_json_schema_output_always_matches(app: FastAPI) -> None:
    """The counting model alone would write "def..."; the schema's mask makes it JSON."""
    body = CHAT | {
        "max_tokens": 40,
        "response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}},
    }
    answer = post(app, "/v1/chat/completions", body | {"n": 2, "temperature": 1}).json()
    assert len(answer["choices"]) == 2  # each answer held to the schema by its own matcher
    for choice in answer["choices"]:
        person = json.loads(choice["message"]["content"])
        assert set(person) == {"name", "age"} and isinstance(person["age"], int)
        assert len(person["name"]) <= 6 and choice["finish_reason"] == "stop"
    # json_object: any object; the counting model opens a key and writes it to the length
    anything = CHAT | {"max_tokens": 8, "response_format": {"type": "json_object"}}
    choice = post(app, "/v1/chat/completions", anything).json()["choices"][0]
    assert choice["message"]["content"].startswith('{"') and choice["finish_reason"] == "length"


@pytest.mark.parametrize(
    "response_format",
    [
        {"type": "json_schema", "json_schema": {"name": "p", "schema": {"type": "nonsense"}}},
        {
            "type": "json_schema",
            "json_schema": {"name": "deep", "schema": {"a": [[[[[[[[[[[[[[[[[[1]]]]]]]]]]]]]]]]]]}},
        },
        {"type": "json_schema"},
        {"type": "json_object", "json_schema": {"name": "p", "schema": PERSON}},
        {"type": "xml"},
    ],
    ids=["not a schema", "too deep", "no schema", "schema without its type", "unknown type"],
)
@pytest.mark.parametrize("n", [1, 3])
def test_a_bad_response_format_is_refused_before_any_token(
    app: FastAPI, response_format: dict[str, object], n: int
) -> None:
    body = CHAT | {"response_format": response_format, "n": n}
    response = post(app, "/v1/chat/completions", body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"].startswith("response_format")


def test_several_answers_with_the_openai_client(app: FastAPI) -> None:
    """`n` (ADR-0045): every choice answered, usage counting the prompt once."""
    answer = run(
        client(app).chat.completions.create(
            model="fake",
            messages=[{"role": "user", "content": "hi"}],
            temperature=0,
            n=3,
            max_tokens=4,
        )
    )
    assert [c.index for c in answer.choices] == [0, 1, 2]
    assert {c.message.content for c in answer.choices} == {'!"#$'}
    assert answer.usage is not None and answer.usage.completion_tokens == 12
    assert answer.usage.total_tokens == answer.usage.prompt_tokens + 12
    sampled = run(
        client(app).completions.create(
            model="fake", prompt="abc", n=2, max_tokens=3, seed=3, logprobs=1
        )
    )
    assert [c.index for c in sampled.choices] == [0, 1]
    for choice in sampled.choices:
        assert choice.logprobs is not None and choice.logprobs.text_offset[0] == 0
        assert len(choice.logprobs.tokens or []) == 3


def test_several_answers_stream_as_chunks_of_one_choice_each(app: FastAPI) -> None:
    async def go() -> list[openai.types.chat.ChatCompletionChunk]:
        stream = await client(app).chat.completions.create(
            model="fake",
            messages=[{"role": "user", "content": "hi"}],
            temperature=0,
            max_tokens=3,
            n=2,
            stream=True,
            stream_options={"include_usage": True},
        )
        return [chunk async for chunk in stream]

    chunks = run(go())
    per_choice: dict[int, str] = {}
    finished: list[int] = []
    for chunk in chunks[:-1]:
        [choice] = chunk.choices
        per_choice[choice.index] = per_choice.get(choice.index, "") + (choice.delta.content or "")
        if choice.finish_reason:
            finished.append(choice.index)
    assert per_choice == {0: '!"#', 1: '!"#'}
    assert sorted(finished) == [0, 1]
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 6

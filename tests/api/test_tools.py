"""Tools (function calling) with the fake model, for shape: a required call is always a call
of a declared function with arguments matching its parameters, in OpenAI's `tool_calls`
shape, streamed or not; `auto` lets words through; bad choices get a 400."""

from __future__ import annotations

import json

import pytest
from fastapi import FastAPI

from meshnet.api.app import create_app
from meshnet.api.tools import CallStream, Tool, ToolPlan, plan
from tests.api.test_api import CHAT, client, post
from tests.conftest import run
from tests.entry.fakes import fake_mesh

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 5}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
# no parameters: its arguments are any object, which the counting model would never close
CLOCK = {"type": "function", "function": {"name": "get_time"}}


@pytest.fixture
def app() -> FastAPI:
    generator, _, _ = fake_mesh()
    return create_app({"fake": generator}, default_max_tokens=8)


def test_a_required_call_is_a_declared_function_with_matching_arguments(app: FastAPI) -> None:
    body = CHAT | {"max_tokens": 80, "tools": [WEATHER], "tool_choice": "required"}
    answer = post(app, "/v1/chat/completions", body).json()
    choice = answer["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    (call,) = choice["message"]["tool_calls"]
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"]["name"] == "get_weather"
    arguments = json.loads(call["function"]["arguments"])
    assert set(arguments) == {"city"} and len(arguments["city"]) <= 5


def test_a_named_choice_calls_that_function_streamed_through_the_openai_client(
    app: FastAPI,
) -> None:
    named = {"type": "function", "function": {"name": "get_weather"}}
    stream = run(
        client(app).chat.completions.create(
            model="fake",
            messages=[{"role": "user", "content": "hi"}],
            temperature=0,
            max_tokens=80,
            tools=[WEATHER, CLOCK],  # type: ignore[list-item]
            tool_choice=named,  # type: ignore[arg-type]
            stream=True,
        )
    )

    async def deltas() -> list[object]:
        return [chunk async for chunk in stream]

    chunks = run(deltas())
    calls = [
        c for chunk in chunks if chunk.choices for c in chunk.choices[0].delta.tool_calls or []
    ]
    # the call opens with its id and name, then its arguments stream as they are written
    assert len(calls) > 2 and all(c.index == 0 and c.function is not None for c in calls)
    assert calls[0].id and calls[0].function.name == "get_weather"  # type: ignore[union-attr]
    assert all(c.id is None and c.function.name is None for c in calls[1:])  # type: ignore[union-attr]
    arguments = "".join(c.function.arguments or "" for c in calls)  # type: ignore[union-attr]
    assert set(json.loads(arguments)) == {"city"}
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_auto_lets_an_answer_in_words_through(app: FastAPI) -> None:
    """The counting model answers "!\\"#..." after "assistant: ": words, not a call."""
    body = CHAT | {"max_tokens": 4, "tools": [WEATHER]}
    choice = post(app, "/v1/chat/completions", body).json()["choices"][0]
    assert choice["message"]["content"] == '!"#$' and "tool_calls" not in choice["message"]
    assert choice["finish_reason"] == "length"


def test_a_tool_conversation_round_trip_is_accepted(app: FastAPI) -> None:
    call = {"id": "call_1", "type": "function"}
    call |= {"function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"},
    ]
    body = CHAT | {"messages": messages, "tools": [WEATHER], "max_tokens": 3}
    response = post(app, "/v1/chat/completions", body)
    assert response.status_code == 200, response.text
    answer = response.json()
    assert answer["choices"][0]["message"] == {"role": "assistant", "content": '!"#'}
    alone = post(app, "/v1/chat/completions", body | {"messages": messages[:1]}).json()
    grew = answer["usage"]["prompt_tokens"] - alone["usage"]["prompt_tokens"]
    assert grew > len('{"city": "Paris"}sunny, 21 C')  # the call and its result were read


@pytest.mark.parametrize(
    ("change", "param"),
    [
        ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tools": None, "tool_choice": "required"}, "tool_choice"),
        ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools"),
        ({"response_format": {"type": "json_object"}}, "tools"),
        ({"messages": [{"role": "assistant", "content": None}]}, "messages"),
    ],
)
def test_bad_tool_requests_are_refused_by_name(
    app: FastAPI, change: dict[str, object], param: str
) -> None:
    body = CHAT | {"tools": [WEATHER]} | change
    response = post(app, "/v1/chat/completions", body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"].startswith(param)


def test_several_answers_may_each_be_a_call(app: FastAPI) -> None:
    body = CHAT | {"max_tokens": 80, "tools": [WEATHER], "tool_choice": "required", "n": 2}
    answer = post(app, "/v1/chat/completions", body).json()
    assert [c["finish_reason"] for c in answer["choices"]] == ["tool_calls"] * 2
    for choice in answer["choices"]:
        [call] = choice["message"]["tool_calls"]
        assert set(json.loads(call["function"]["arguments"])) == {"city"}
    streamed = post(app, "/v1/chat/completions", body | {"stream": True}).text
    chunks = [json.loads(e[6:]) for e in streamed.split("\n\n") if e.startswith("data: {")]
    arguments: dict[int, str] = {}
    for chunk in chunks:
        for choice in chunk["choices"]:
            for call in choice["delta"].get("tool_calls", []):
                arguments[choice["index"]] = arguments.get(choice["index"], "")
                arguments[choice["index"]] += call["function"]["arguments"]
    assert {i: set(json.loads(a)) for i, a in arguments.items()} == {0: {"city"}, 1: {"city"}}


def plan_of(choice: str) -> ToolPlan:
    found = plan([Tool.model_validate(WEATHER)], choice)  # type: ignore[arg-type]
    assert found is not None
    return found


CALL = '{"name":"get_weather","arguments":{"city":"Paris"}}'


@pytest.mark.parametrize(
    ("choice", "pieces", "words", "arguments", "called"),
    [
        ("auto", ["Hel", "lo"], ["Hel", "lo"], None, False),
        (
            "required",
            ['{"name":"get_', 'weather","argu', 'ments":{"ci', 'ty":"Pa', 'ris"}', "}"],
            [],
            ['{"c', 'ity":"P', 'aris"', "}"],  # one character held back until the next piece
            True,
        ),
        # cut by max_tokens: the arguments so far, all of them, and no call
        ("required", [CALL[:38], CALL[38:43]], [], ['{"c', 'ity":', '"'], False),
    ],
    ids=["words", "a call, piece by piece", "a call cut short"],
)
def test_a_call_streams_its_name_then_its_arguments(
    choice: str, pieces: list[str], words: list[str], arguments: list[str] | None, called: bool
) -> None:
    stream = CallStream(plan_of(choice))
    deltas = [d for piece in pieces for d in stream.feed(piece)]
    rest, was_call = stream.finish()
    deltas += rest
    assert [d["content"] for d in deltas if "content" in d] == words
    calls = [d["tool_calls"][0] for d in deltas if "tool_calls" in d]
    if arguments is not None:
        assert calls[0]["id"] == stream.call_id and calls[0]["function"]["name"] == "get_weather"
        assert [c["function"]["arguments"] for c in calls[1:]] == arguments
    assert was_call is called


def test_a_call_whose_head_is_not_recognized_comes_whole_at_the_end() -> None:
    stream = CallStream(plan_of("required"))
    reordered = '{"arguments":{"city":"Paris"},"name":"get_weather"}'
    assert stream.feed(reordered) == []
    [delta], called = stream.finish()
    [call] = delta["tool_calls"]
    assert called and call["function"]["name"] == "get_weather" and call["id"] == stream.call_id

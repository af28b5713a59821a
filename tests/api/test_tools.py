"""Tools (function calling) with the fake model, for shape: a required call is always a call
of a declared function with arguments matching its parameters, in OpenAI's `tool_calls`
shape, streamed or not; `auto` lets words through; bad choices get a 400."""

from __future__ import annotations

import json

import pytest
from fastapi import FastAPI

from meshnet.api.app import create_app
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
    assert len(calls) == 1 and calls[0].index == 0 and calls[0].function is not None
    assert calls[0].function.name == "get_weather"
    assert set(json.loads(calls[0].function.arguments or "")) == {"city"}
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


@pytest.mark.parametrize(
    ("change", "param"),
    [
        ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tools": None, "tool_choice": "required"}, "tool_choice"),
        ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools"),
        ({"response_format": {"type": "json_object"}}, "tools"),
        ({"n": 2}, "n"),
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

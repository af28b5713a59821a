"""Tools (function calling): the declared functions go into the prompt as a system message,
the answer is constrained to one call of a declared function (or, with `auto`, to either a
call or text that does not start with `{`), and a call comes back in OpenAI's `tool_calls`
shape (ADR-0044)."""

from __future__ import annotations

import json
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from meshnet.errors import RequestError
from meshnet.text.json_limits import COMPACT, check_schema
from meshnet.text.params import GenerationParams

NAME = r"^[A-Za-z0-9_-]{1,64}$"
PREAMBLE = (
    "You can call these functions. To call one, answer with only a JSON object "
    '{"name": <function name>, "arguments": <an object of its parameters>}; otherwise '
    "answer in words.\nFunctions: "
)


class _Schema(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class FunctionDef(_Schema):
    name: str = Field(pattern=NAME)
    description: str | None = Field(default=None, max_length=4000)
    parameters: dict[str, Any] = Field(default_factory=lambda: {"type": "object"})
    strict: bool | None = None  # always strict here: a call matches its parameters


class Tool(_Schema):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(_Schema):
    name: str = Field(pattern=NAME)


class NamedChoice(_Schema):
    type: Literal["function"]
    function: NamedFunction


class CallFunction(_Schema):
    name: str = Field(pattern=NAME)
    arguments: str = Field(max_length=100_000)  # JSON text, as OpenAI sends it


class ToolCall(_Schema):
    id: str = Field(max_length=64)
    type: Literal["function"]
    function: CallFunction


ToolChoice = Literal["none", "auto", "required"] | NamedChoice


@dataclass(frozen=True)
class ToolPlan:
    """What one request's tools change: the prompt's messages and the grammar."""

    tools: tuple[Tool, ...]
    allowed: tuple[Tool, ...]  # those the answer may call
    optional: bool  # `auto`: words are an answer too

    def grammar(self) -> tuple[str | None, str | None]:
        """(JSON schema text, lark grammar text): the one the answer is held to."""
        call = {"anyOf": [_call_schema(t) for t in self.allowed], **COMPACT}
        check_schema(call, "tools")
        if not self.optional:
            return json.dumps(call), None
        # words must not open with `{` (or blanks): so the first character tells them apart
        lark = f"start: call | text\ncall: %json {json.dumps(call)}\ntext: /[^{{\\s](.|\\n)*/\n"
        return None, lark

    def messages(self, messages: list[dict[str, str]]) -> list[dict[str, str]]:
        """The conversation with the functions described in a system message (merged into
        the conversation's own first system message, where it has one)."""
        described = PREAMBLE + json.dumps([t.function.model_dump() for t in self.tools])
        if messages and messages[0]["role"] in ("system", "developer"):
            first = messages[0]
            return [{**first, "content": f"{first['content']}\n\n{described}"}, *messages[1:]]
        return [{"role": "system", "content": described}, *messages]

    def call(self, text: str) -> dict[str, Any] | None:
        """`text` as an OpenAI tool call when it is a call of an allowed function."""
        try:
            found = json.loads(text)
        except ValueError:
            return None
        names = {t.function.name for t in self.allowed}
        if not isinstance(found, dict) or found.get("name") not in names:
            return None
        arguments = found.get("arguments")
        if not isinstance(arguments, dict):
            return None
        function = {"name": found["name"], "arguments": json.dumps(arguments)}
        return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function", "function": function}


def _call_schema(tool: Tool) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {
            "name": {"const": tool.function.name},
            "arguments": tool.function.parameters or {"type": "object"},
        },
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


def plan(tools: Sequence[Tool] | None, choice: ToolChoice | None) -> ToolPlan | None:
    """The request's tool plan; None without tools or with `tool_choice: "none"`."""
    if not tools:
        if choice not in (None, "none"):
            raise RequestError("tool_choice needs tools", field="tool_choice")
        return None
    if choice == "none":
        return None
    allowed = tuple(tools)
    if isinstance(choice, NamedChoice):
        allowed = tuple(t for t in tools if t.function.name == choice.function.name)
        if not allowed:
            raise RequestError(
                f"tool_choice names {choice.function.name!r}, which is not among the tools",
                field="tool_choice",
            )
    return ToolPlan(tuple(tools), allowed, choice in (None, "auto"))


def message_text(role: str, content: str, calls: Sequence[ToolCall], call_id: str | None) -> str:
    """A message of a tool conversation as plain text for any chat template: an assistant's
    calls as the JSON it would have answered, a tool's result with the call it answers."""
    if calls:
        try:
            done = [
                {"name": c.function.name, "arguments": json.loads(c.function.arguments)}
                for c in calls
            ]
        except ValueError:
            raise RequestError("a tool call's arguments are not JSON", field="messages") from None
        return json.dumps(done[0] if len(done) == 1 else done)
    if role == "tool":
        return f"Result of call {call_id}: {content}"
    return content


def constrain(params: GenerationParams, plan: ToolPlan, formatted: bool) -> GenerationParams:
    """`params` held to the plan's grammar; a 400 when `response_format` also asks for one."""
    if formatted and params.schema is not None:
        raise RequestError("tools and a JSON response_format cannot be combined", field="tools")
    if params.n > 1:  # an answer that may be a call is collected whole, one per request
        raise RequestError("n > 1 cannot be combined with tools: ask for one answer", field="n")
    schema, lark = plan.grammar()
    return replace(params, schema=schema, lark=lark)


def as_chunks(
    body: dict[str, Any], opening: dict[str, Any], include_usage: bool
) -> list[dict[str, Any]]:
    """A whole chat answer (`body`) as OpenAI's stream: the role chunk, the content or the
    call (with its index), the finish with usage, and the usage-only chunk when asked."""
    choice = body["choices"][0]
    message = choice["message"]
    delta: dict[str, Any] = {"content": message["content"]}
    if message.get("tool_calls"):
        delta = {"tool_calls": [{"index": 0, **c} for c in message["tool_calls"]]}
    kind = {"object": "chat.completion.chunk"}
    middle = {**opening, **kind, "choices": [{**opening["choices"][0], "delta": delta}]}
    final_choice = {
        "index": 0,
        "delta": {},
        "logprobs": None,
        "finish_reason": choice["finish_reason"],
    }
    final = {**body, **kind, "choices": [final_choice]}
    chunks = [opening, middle, final]
    if include_usage:
        usage = {k: v for k, v in final.items() if k != "meshnet"}
        chunks.append(usage | {"choices": []})
    return chunks

"""Tools (function calling): the declared functions go into the prompt as a system message,
the answer is constrained to one call of a declared function (or, with `auto`, to either a
call or text that does not start with `{`), and a call comes back in OpenAI's `tool_calls`
shape (ADR-0044)."""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
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
    schema, lark = plan.grammar()
    return replace(params, schema=schema, lark=lark)


# how a call starts: the grammar's JSON is compact, its properties in the schema's order
CALL_HEAD = re.compile(r'\{"name":"([A-Za-z0-9_-]{1,64})","arguments":')


@dataclass
class CallStream:
    """One answer of a request with tools, as OpenAI's stream deltas while it is written:
    words stream as `content`; a call opens with its id and name as soon as its head is
    written, then streams its arguments as they grow (the closing brace of the call held
    back). A call whose head was never recognized comes whole at the end."""

    plan: ToolPlan
    text: str = ""
    sent: int = 0  # characters streamed: of the words, or of the call's arguments
    head: int | None = None  # where the arguments start, once the head is written
    call_id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    @property
    def calling(self) -> bool | None:
        """Whether the answer is a call (None: nothing written yet)."""
        if not self.text:
            return None
        return not self.plan.optional or self.text.startswith("{")

    def feed(self, piece: str) -> list[dict[str, Any]]:
        """The deltas `piece` (the answer's next text) gives."""
        self.text += piece
        if not self.calling:
            return self._words() if self.calling is False else []
        if self.head is None:
            match = CALL_HEAD.match(self.text)
            if match is None:
                return []
            self.head = match.end()
            function = {"name": match.group(1), "arguments": ""}
            opened = {"index": 0, "id": self.call_id, "type": "function", "function": function}
            return [{"tool_calls": [opened]}, *self._arguments(self.head, hold=1)]
        return self._arguments(self.head, hold=1)

    def finish(self) -> tuple[list[dict[str, Any]], bool]:
        """The last deltas, and whether the answer was a call of an allowed function."""
        call = self.plan.call(self.text) if self.calling else None
        if self.head is not None:  # the call streamed: its rest, without the closing brace
            return self._arguments(self.head, hold=1 if call else 0), call is not None
        if call is not None:
            return [{"tool_calls": [{"index": 0, **call, "id": self.call_id}]}], True
        return self._words(), False

    def _words(self) -> list[dict[str, Any]]:
        piece, self.sent = self.text[self.sent :], len(self.text)
        return [{"content": piece}] if piece else []

    def _arguments(self, head: int, hold: int) -> list[dict[str, Any]]:
        """The call's arguments written since the last delta, but the last `hold` characters."""
        arguments = self.text[head : len(self.text) - hold]
        piece, self.sent = arguments[self.sent :], max(self.sent, len(arguments))
        return [{"tool_calls": [{"index": 0, "function": {"arguments": piece}}]}] if piece else []

"""Request bodies of the OpenAI-compatible API, as declared pydantic models.

Fields follow OpenAI's API reference; `top_k`, `repetition_penalty` and `cache_prompt`
(llama-server's name) are extensions.
Fields meshnet does not implement are refused with a clear 400: declared ones by their
bounds, unknown ones by `extra="forbid"` (`docs/api.md` lists them).
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationInfo,
    field_validator,
    model_validator,
)

from meshnet.api.tools import Tool, ToolCall, ToolChoice, message_text
from meshnet.text.json_limits import COMPACT
from meshnet.text.params import GenerationParams, SamplingParams

MAX_STOPS = 4
MAX_CHOICES = 16  # `n` at most: each answer holds a session (a KV cache) on every hop
MAX_TEXT_CHARS = 1_000_000


class Schema(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class TextPart(Schema):
    type: Literal["text"]
    text: str = Field(max_length=MAX_TEXT_CHARS)


class ChatMessage(Schema):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = Field(default=None, max_length=MAX_TEXT_CHARS)
    name: str | None = Field(default=None, max_length=64)
    tool_calls: list[ToolCall] | None = Field(default=None, max_length=16)  # an assistant's
    tool_call_id: str | None = Field(default=None, max_length=64)  # a tool's answer

    @model_validator(mode="after")
    def _content_or_calls(self) -> ChatMessage:
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError("a message needs content (an assistant's may be tool_calls)")
        return self

    def text(self) -> str:
        """The content as plain text; a tool conversation's turns as `tools` writes them."""
        content = self.content or ""
        if not isinstance(content, str):
            content = "".join(part.text for part in content)
        return message_text(self.role, content, self.tool_calls or [], self.tool_call_id)


class StreamOptions(Schema):
    include_usage: bool = False


class JsonSchemaFormat(Schema):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")
    description: str | None = Field(default=None, max_length=1000)
    schema_: dict[str, Any] = Field(default_factory=dict, alias="schema")
    strict: bool | None = None  # always strict here: the output matches the schema


class ResponseFormat(Schema):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_goes_with_its_type(self) -> ResponseFormat:
        if (self.json_schema is not None) != (self.type == "json_schema"):
            raise ValueError("json_schema comes with type json_schema, and only with it")
        return self

    def schema_text(self) -> str | None:
        """The JSON schema the output must match (JSON text), or None for plain text."""
        if self.type == "json_object":
            return json.dumps({"type": "object", **COMPACT})
        if self.type == "json_schema":
            assert self.json_schema is not None  # validated above
            return json.dumps({**(self.json_schema.schema_ or {"type": "object"}), **COMPACT})
        return None


class Sampling(Schema):
    """Fields both endpoints share."""

    model: str = Field(min_length=1, max_length=200)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=0)
    seed: int | None = Field(default=None, ge=-(2**63), le=2**64 - 1)  # torch's seed range
    stop: (
        str
        | Annotated[list[Annotated[str, Field(max_length=200)]], Field(max_length=MAX_STOPS)]
        | None
    ) = Field(default=None, max_length=200)
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(default=1, ge=1, le=MAX_CHOICES)  # answers sharing one prefill (ADR-0045)
    user: str | None = Field(default=None, max_length=256)
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(default=1.0, gt=0.0, le=10.0)  # an extension
    # an extension (llama-server's): false neither reuses a kept prompt prefix nor keeps one
    cache_prompt: bool = True

    def stops(self) -> tuple[str, ...]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return tuple(s for s in stops if s)

    def sampling(self) -> SamplingParams:
        return SamplingParams(
            temperature=self.temperature,
            top_k=self.top_k,
            top_p=self.top_p,
            seed=self.seed,
            frequency_penalty=self.frequency_penalty,
            presence_penalty=self.presence_penalty,
            repetition_penalty=self.repetition_penalty,
        )

    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class ChatCompletionRequest(Sampling):
    messages: list[ChatMessage] = Field(min_length=1, max_length=10_000)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    response_format: ResponseFormat | None = None
    tools: list[Tool] | None = Field(default=None, max_length=64)
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None  # accepted; an answer makes at most one call

    @field_validator("top_logprobs")
    @classmethod
    def _top_needs_logprobs(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value is not None and not info.data.get("logprobs"):
            raise ValueError("top_logprobs needs logprobs: true")
        return value

    def max_tokens_field(self) -> str:
        return "max_completion_tokens" if self.max_completion_tokens else "max_tokens"

    def params(self, default_max_tokens: int) -> GenerationParams:
        limit = self.max_completion_tokens or self.max_tokens or default_max_tokens
        scored = (self.top_logprobs or 0) if self.logprobs else None
        schema = self.response_format.schema_text() if self.response_format else None
        return GenerationParams(
            limit, self.stops(), self.sampling(), scored, schema, n=self.n,
            cache_prompt=self.cache_prompt,
        )  # fmt: skip


class CompletionRequest(Sampling):
    prompt: str | Annotated[list[str], Field(min_length=1, max_length=1)] = Field(
        max_length=MAX_TEXT_CHARS
    )
    max_tokens: int = Field(default=16, ge=1)  # OpenAI's default for completions
    logprobs: int | None = Field(default=None, ge=0, le=5)  # alternatives per token

    def text(self) -> str:
        return self.prompt if isinstance(self.prompt, str) else self.prompt[0]

    def params(self) -> GenerationParams:
        return GenerationParams(
            self.max_tokens, self.stops(), self.sampling(), self.logprobs, n=self.n,
            cache_prompt=self.cache_prompt,
        )  # fmt: skip

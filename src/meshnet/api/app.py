"""The OpenAI-compatible endpoints: `/v1/chat/completions`, `/v1/completions`, `/v1/models`.

Handlers parse a declared request, turn it into token ids and generation settings, and
render the generator's events as one JSON answer or as server-sent events in OpenAI's chunk
format. Errors that happen before the first token (bad input, no route, a failed hop) are
HTTP errors in OpenAI's shape; an error after streaming began is sent as a final `error` event.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Mapping, Sequence
from typing import Any, Protocol

from fastapi import APIRouter, FastAPI, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.types import Message, Send

from meshnet import __version__
from meshnet.api import schemas, tools
from meshnet.api.logprobs import CompletionLogprobs, TokenText, chat_logprobs
from meshnet.config import AccessConfig, ApiLimits
from meshnet.errors import MeshError, RequestError, UnknownModelError
from meshnet.http_errors import install_error_handlers
from meshnet.security.access import Credentials, Guard, Rule, client_of, rule
from meshnet.security.limits import ClientLimiter
from meshnet.text.codec import TextCodec
from meshnet.text.events import Delta, Event, Finished, TokenLogprob
from meshnet.text.params import GenerationParams

log = logging.getLogger(__name__)
Scores = tuple[TokenLogprob, ...]
# (text, end, first chunk, the tokens' scores) -> the answer or chunk
Render = Callable[[str | None, Finished | None, bool, Scores], dict[str, Any]]
Elsewhere = Callable[[Request], Awaitable[Response]]  # answers a call for a model not served here


class Generator(Protocol):
    """What the API needs of a served model (`meshnet.entry.generation.Generator` is one)."""

    codec: TextCodec
    max_context: int  # prompt + generated tokens, at most

    def stream(self, prompt: list[int], params: GenerationParams) -> AsyncGenerator[Event]:
        """Text deltas, then one `Finished`."""
        ...


def access_rules(limits: ApiLimits) -> list[Rule]:
    """The API answers clients: an API key, or a loopback caller when no key is configured."""
    body = limits.max_body_bytes
    return [
        rule("/v1/chat/completions", "client", max_body_bytes=body),
        rule("/v1/completions", "client", max_body_bytes=body),
        rule("/v1/models", "client"),
    ]


def create_app(
    generators: Mapping[str, Generator],
    default_max_tokens: int = 256,
    *,
    limits: ApiLimits = ApiLimits(),
    access: AccessConfig = AccessConfig(),
    limiter: ClientLimiter | None = None,
    extra_rules: Sequence[Rule] = (),
    guarded: bool = True,
) -> FastAPI:
    """A FastAPI app serving the API, behind its access guard unless not `guarded` (a node
    mounting it checks access itself, with `access_rules` among its own)."""
    app = FastAPI(title="meshnet API", version=__version__)
    install_error_handlers(app)
    if guarded:
        rules = [*access_rules(limits), *extra_rules]
        app.add_middleware(Guard, rules=rules, credentials=Credentials(access))
    app.include_router(api_router(generators, default_max_tokens, limits, limiter))
    return app


def api_router(
    generators: Mapping[str, Generator],
    default_max_tokens: int = 256,
    limits: ApiLimits = ApiLimits(),
    limiter: ClientLimiter | None = None,
    elsewhere: Elsewhere | None = None,
    more_models: Callable[[], list[str]] | None = None,
) -> APIRouter:
    """The API over `generators` (model id -> generator); `limits` apply per client.

    `elsewhere` (a tracker-as-node's forwarder) answers calls naming another model, and
    `more_models` lists the models it can answer for `/v1/models`.
    """
    router = APIRouter()
    limiter = limiter or ClientLimiter(limits)

    def generator_for(model: str) -> Generator:
        found = generators.get(model)
        if found is None:
            raise UnknownModelError(
                f"model {model!r} is not served here (served: {sorted(generators)})", field="model"
            )
        return found

    @router.get("/v1/models")
    def models() -> dict[str, object]:
        ids = [
            *generators,
            *(m for m in (more_models() if more_models else []) if m not in generators),
        ]
        data = [{"id": m, "object": "model", "created": 0, "owned_by": "meshnet"} for m in ids]
        return {"object": "list", "data": data}

    @router.post("/v1/chat/completions")
    async def chat(request: schemas.ChatCompletionRequest, http: Request) -> Response:
        if elsewhere is not None and request.model not in generators:
            return await elsewhere(http)
        client = client_of(http.scope)
        limiter.admit(client)
        generator = generator_for(request.model)
        plan = tools.plan(request.tools, request.tool_choice)
        # a tool's answer is the user's turn for templates that know no `tool` role
        messages = [
            {"role": "user" if m.role == "tool" else m.role, "content": m.text()}
            for m in request.messages
        ]
        messages = plan.messages(messages) if plan else messages
        check_chars(sum(len(m["content"]) for m in messages), limits, "messages")
        prompt = await asyncio.to_thread(generator.codec.chat, messages)  # off the loop
        check_prompt(prompt, limits, "messages")
        room = check_room(prompt, generator.max_context, "messages")
        # a request that names no length gets the default, never more than the limit allows
        params = request.params(min(default_max_tokens, limits.max_tokens, room))
        check_max_tokens(params, limits, request.max_tokens_field())
        if plan is not None:
            params = tools.constrain(params, plan, request.response_format is not None)
        events = _limited(generator.stream(prompt, params), limiter, client)
        render = _chat_renderer(request.model, _token_text(generator, params))
        if plan is not None:
            return await _respond_calls(events, request, render, plan)
        return await _respond(events, request, render, "chat.completion", limits.write_timeout_s)

    @router.post("/v1/completions")
    async def completions(request: schemas.CompletionRequest, http: Request) -> Response:
        if elsewhere is not None and request.model not in generators:
            return await elsewhere(http)
        client = client_of(http.scope)
        limiter.admit(client)
        generator = generator_for(request.model)
        check_chars(len(request.text()), limits, "prompt")
        prompt = await asyncio.to_thread(generator.codec.encode, request.text())
        check_prompt(prompt, limits, "prompt")
        check_room(prompt, generator.max_context, "prompt")
        check_max_tokens(request.params(), limits, "max_tokens")
        params = request.params()
        events = _limited(generator.stream(prompt, params), limiter, client)
        render = _text_renderer(request.model, _token_text(generator, params))
        return await _respond(events, request, render, "text_completion", limits.write_timeout_s)

    return router


def _token_text(generator: Generator, params: GenerationParams) -> TokenText | None:
    """A token's own text, for answers that report logprobs; None when none were asked."""
    if params.logprobs is None:
        return None
    return lambda token: generator.codec.decode([token])


CHARS_PER_TOKEN = 16  # a prompt over this many characters a token is refused untokenized


def check_chars(chars: int, limits: ApiLimits, field: str) -> None:
    """Refuse (400) a prompt too long to fit however it tokenizes, before tokenizing it:
    the tokenizer's time grows with the text, whatever the token limit."""
    if chars > limits.max_prompt_tokens * CHARS_PER_TOKEN:
        raise RequestError(
            f"the prompt has {chars} characters; this server takes at most "
            f"{limits.max_prompt_tokens} tokens ({limits.max_prompt_tokens * CHARS_PER_TOKEN} "
            "characters)",
            field=field,
        )


def check_prompt(prompt: list[int], limits: ApiLimits, field: str) -> None:
    if len(prompt) > limits.max_prompt_tokens:
        raise RequestError(
            f"the prompt has {len(prompt)} tokens; this server takes at most "
            f"{limits.max_prompt_tokens}",
            field=field,
        )


def check_room(prompt: list[int], max_context: int, field: str) -> int:
    """Tokens left after the prompt in the model's context; 400 naming `field` when none are
    (review finding 10: the default length went to 0 or below, and the refusal came from a
    hop, naming X-Meshnet-Position)."""
    room = max_context - len(prompt)
    if room < 1:
        raise RequestError(
            f"the prompt is {len(prompt)} tokens; the model's context of {max_context} "
            "leaves no room for an answer",
            field=field,
        )
    return room


def check_max_tokens(params: GenerationParams, limits: ApiLimits, field: str) -> None:
    if params.max_tokens > limits.max_tokens:
        raise RequestError(
            f"{field} is {params.max_tokens}; this server allows at most {limits.max_tokens}",
            field=field,
        )


async def _limited(
    events: AsyncGenerator[Event], limiter: ClientLimiter, client: str
) -> AsyncGenerator[Event]:
    """`events`, counted as one of `client`'s generations in flight while it runs."""
    limiter.acquire(client)
    try:
        async for event in events:
            yield event
    finally:
        await events.aclose()
        limiter.release(client)


class DeadlineStream(StreamingResponse):
    """A streamed answer whose every write must go out within `write_timeout_s`: a client
    that stops reading (its socket buffers full) is cut off, and closing the stream closes
    the session on every hop (review finding 9)."""

    def __init__(self, content: AsyncIterator[str], write_timeout_s: float, **kwargs: Any) -> None:
        super().__init__(content, **kwargs)
        self.write_timeout_s = write_timeout_s

    async def stream_response(self, send: Send) -> None:
        async def timed(message: Message) -> None:
            async with asyncio.timeout(self.write_timeout_s):
                await send(message)

        try:
            await super().stream_response(timed)
        except TimeoutError:
            log.warning(
                "a client read nothing for %.0f s: its stream is ended", self.write_timeout_s
            )
            await self.body_iterator.aclose()  # type: ignore[attr-defined]


async def _respond(
    events: AsyncGenerator[Event],
    request: schemas.Sampling,
    render: Render,
    kind: str,
    write_timeout_s: float,
) -> Response:
    try:
        first = await anext(events)  # errors before the first token become HTTP errors
    except BaseException:
        await events.aclose()
        raise
    if request.stream:
        sse = _sse(first, events, render, request.include_usage())
        return DeadlineStream(sse, write_timeout_s, media_type="text/event-stream")
    text, end, scores = await _collect(first, events)
    body = render(text, end, False, scores) | {"object": kind}
    choice = body["choices"][0]
    if choice.pop("delta", None) is not None:
        choice["message"] = {"role": "assistant", "content": text}
    return JSONResponse(body)


async def _respond_calls(
    events: AsyncGenerator[Event], request: schemas.Sampling, render: Render, plan: tools.ToolPlan
) -> Response:
    """An answer that may be a tool call: collected whole, then sent as one message or, when
    streamed, as OpenAI's chunks (the call in one `tool_calls` delta)."""
    text, end, scores = await _collect(await anext(events), events)
    body = render(None, end, False, scores) | {"object": "chat.completion"}
    choice, call = body["choices"][0], plan.call(text)
    choice.pop("delta")
    choice["message"] = {"role": "assistant", "content": None if call else text}
    if call is not None:
        choice["message"]["tool_calls"] = [call]
        choice["finish_reason"] = "tool_calls"
    if not request.stream:
        return JSONResponse(body)
    chunks = tools.as_chunks(body, render("", None, True, ()), request.include_usage())
    return StreamingResponse(
        iter([*(_data(c) for c in chunks), "data: [DONE]\n\n"]), media_type="text/event-stream"
    )


async def _collect(first: Event, events: AsyncGenerator[Event]) -> tuple[str, Finished, Scores]:
    parts: list[str] = []
    scores: list[TokenLogprob] = []
    event = first
    try:
        while isinstance(event, Delta):
            parts.append(event.text)
            scores.extend(event.logprobs)
            event = await anext(events)
    finally:
        await events.aclose()
    return "".join(parts), event, tuple(scores)


async def _sse(
    first: Event, events: AsyncGenerator[Event], render: Render, include_usage: bool
) -> AsyncIterator[str]:
    try:
        yield _data(render("", None, True, ()))
        event = first
        while isinstance(event, Delta):
            yield _data(render(event.text, None, False, event.logprobs))
            event = await anext(events)
        yield _data(render(None, event, False, ()))
        if include_usage:
            usage = render(None, event, False, ())
            yield _data({k: v for k, v in usage.items() if k != "meshnet"} | {"choices": []})
    except MeshError as exc:
        log.warning("stream ended by an error: %s", exc.message)
        yield _data(exc.to_json())
    finally:
        await events.aclose()  # closes the session on every hop, also when the client left
    yield "data: [DONE]\n\n"


def _data(body: dict[str, Any]) -> str:
    return f"data: {json.dumps(body, separators=(',', ':'))}\n\n"


def _chat_renderer(model: str, token_text: TokenText | None) -> Render:
    base = _base(model, "chatcmpl", "chat.completion.chunk")

    def render(
        text: str | None, end: Finished | None, first: bool, scores: Scores
    ) -> dict[str, Any]:
        delta: dict[str, str] = {"role": "assistant", "content": ""} if first else {}
        if text:
            delta["content"] = text
        choice: dict[str, Any] = {"index": 0, "delta": delta, "finish_reason": None}
        choice["logprobs"] = None  # OpenAI's when none were asked, or none in this chunk
        if token_text is not None and scores:
            choice["logprobs"] = chat_logprobs(scores, token_text)
        return _finish(base(), choice, end)

    return render


def _text_renderer(model: str, token_text: TokenText | None) -> Render:
    base = _base(model, "cmpl", "text_completion")
    lists = CompletionLogprobs(token_text) if token_text is not None else None

    def render(
        text: str | None, end: Finished | None, first: bool, scores: Scores
    ) -> dict[str, Any]:
        logprobs = lists.block(scores) if lists is not None and scores else None
        choice: dict[str, Any] = {"index": 0, "text": text or "", "logprobs": logprobs}
        return _finish(base(), choice | {"finish_reason": None}, end)

    return render


def _base(model: str, prefix: str, kind: str) -> Callable[[], dict[str, Any]]:
    request_id, created = f"{prefix}-{uuid.uuid4().hex}", int(time.time())
    return lambda: {"id": request_id, "object": kind, "created": created, "model": model}


def _finish(body: dict[str, Any], choice: dict[str, Any], end: Finished | None) -> dict[str, Any]:
    body["choices"] = [choice]
    if end is not None:
        choice["finish_reason"] = end.reason
        body["usage"] = {
            "prompt_tokens": end.prompt_tokens,
            "completion_tokens": end.completion_tokens,
            "total_tokens": end.prompt_tokens + end.completion_tokens,
        }
        body["meshnet"] = {
            "route": [
                {"node_id": h.node_id, "address": h.address, "span": str(h.span)} for h in end.route
            ],
            "time_to_first_token_s": round(end.first_token_s, 4),
            "decode_tokens_per_s": round(end.decode_tokens_per_s, 2),
            "failover_pauses_s": [round(p, 4) for p in end.failover_pauses_s],
            "draft_tokens": end.drafted_tokens,
            "accepted_draft_tokens": end.accepted_tokens,
            "decode_rounds": end.decode_rounds,
        }
    return body

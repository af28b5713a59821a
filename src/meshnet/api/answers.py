"""A generation's events as OpenAI answers: one JSON body, or server-sent chunks.

A request may ask for several answers (`n`, ADR-0045): their events interleave, each naming
its choice `index`. A JSON answer lists every choice in index order; a stream sends each
choice's chunks as they come (OpenAI's shape: one choice per chunk), and the usage counts the
prompt once and every answer's tokens.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from typing import Any

from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.types import Message, Send

from meshnet.api import schemas, tools
from meshnet.api.logprobs import CompletionLogprobs, TokenText, chat_logprobs
from meshnet.errors import MeshError
from meshnet.text.events import Delta, Event, Finished, TokenLogprob

log = logging.getLogger(__name__)
Scores = tuple[TokenLogprob, ...]
# (choice index, text, end, first chunk, the tokens' scores) -> the answer or chunk
Render = Callable[[int, str | None, Finished | None, bool, Scores], dict[str, Any]]


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


async def respond(
    events: AsyncGenerator[Event],
    request: schemas.Sampling,
    render: Render,
    kind: str,
    write_timeout_s: float,
) -> Response:
    """`events` (of `request.n` answers) as one JSON answer or, when asked, a stream."""
    try:
        first = await anext(events)  # errors before the first token become HTTP errors
    except BaseException:
        await events.aclose()
        raise
    if request.stream:
        sse = _sse(first, events, render, request.n, request.include_usage())
        return DeadlineStream(sse, write_timeout_s, media_type="text/event-stream")
    answers = await collect(first, events)
    choices = []
    for index, (text, end, scores) in enumerate(answers):
        choice = render(index, text, end, False, scores)["choices"][0]
        if choice.pop("delta", None) is not None:
            choice["message"] = {"role": "assistant", "content": text}
        choices.append(choice)
    body = render(0, None, answers[0][1], False, ()) | {"object": kind}
    return JSONResponse(body | {"choices": choices, "usage": usage([e for _, e, _ in answers])})


async def respond_calls(
    events: AsyncGenerator[Event],
    request: schemas.Sampling,
    render: Render,
    plan: tools.ToolPlan,
    write_timeout_s: float,
) -> Response:
    """Answers that may be tool calls (ADR-0044): a call in OpenAI's `tool_calls` shape with
    `finish_reason: "tool_calls"`; streamed, a call's arguments as they are written."""
    try:
        first = await anext(events)
    except BaseException:
        await events.aclose()
        raise
    if request.stream:
        calls = [tools.CallStream(plan) for _ in range(request.n)]
        sse = _sse(first, events, render, request.n, request.include_usage(), calls)
        return DeadlineStream(sse, write_timeout_s, media_type="text/event-stream")
    answers = await collect(first, events)
    choices = []
    for index, (text, end, scores) in enumerate(answers):
        choice, call = render(index, None, end, False, scores)["choices"][0], plan.call(text)
        choice.pop("delta")
        choice["message"] = {"role": "assistant", "content": None if call else text}
        if call is not None:
            choice["message"]["tool_calls"] = [call]
            choice["finish_reason"] = "tool_calls"
        choices.append(choice)
    body = render(0, None, answers[0][1], False, ()) | {"object": "chat.completion"}
    return JSONResponse(body | {"choices": choices, "usage": usage([e for _, e, _ in answers])})


Answer = tuple[str, Finished, Scores]  # an answer's text, its end and its tokens' scores


async def collect(first: Event, events: AsyncGenerator[Event]) -> list[Answer]:
    """Every answer of `events` whole, in index order."""
    parts: dict[int, list[str]] = {}
    scores: dict[int, list[TokenLogprob]] = {}
    ends: dict[int, Finished] = {}
    event: Event | None = first
    try:
        while event is not None:
            if isinstance(event, Delta):
                parts.setdefault(event.index, []).append(event.text)
                scores.setdefault(event.index, []).extend(event.logprobs)
            else:
                ends[event.index] = event
            event = await anext(events, None)
    finally:
        await events.aclose()
    return [("".join(parts.get(i, [])), ends[i], tuple(scores.get(i, []))) for i in sorted(ends)]


def usage(ends: list[Finished]) -> dict[str, object]:
    """OpenAI's usage of a request: its prompt once (of which a kept prefix held
    `cached_tokens`), the tokens of every answer."""
    prompt, completion = ends[0].prompt_tokens, sum(e.completion_tokens for e in ends)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": ends[0].cached_tokens},
    }


async def _sse(
    first: Event,
    events: AsyncGenerator[Event],
    render: Render,
    n: int,
    include_usage: bool,
    calls: list[tools.CallStream] | None = None,
) -> AsyncIterator[str]:
    """OpenAI's chunks: each answer's role, its text (with `calls`, what each answer's
    `CallStream` makes of it), its finish; then the usage, when asked, and `[DONE]`."""
    ends: list[Finished] = []
    try:
        for index in range(n):
            yield _data(render(index, "", None, True, ()))
        event: Event | None = first
        while event is not None:
            if isinstance(event, Delta) and calls is None:
                yield _data(render(event.index, event.text, None, False, event.logprobs))
            elif isinstance(event, Delta) and calls is not None:
                for delta in calls[event.index].feed(event.text):
                    yield _data(_with_delta(render, event.index, delta))
            elif isinstance(event, Finished):
                ends.append(event)
                deltas, called = calls[event.index].finish() if calls else ([], False)
                for delta in deltas:
                    yield _data(_with_delta(render, event.index, delta))
                final = render(event.index, None, event, False, ())
                if called:
                    final["choices"][0]["finish_reason"] = "tool_calls"
                yield _data(final)
            event = await anext(events, None)
        if include_usage:
            last = render(0, None, ends[0], False, ())
            body = {k: v for k, v in last.items() if k != "meshnet"} | {"choices": []}
            yield _data(body | {"usage": usage(ends)})
    except MeshError as exc:
        log.warning("stream ended by an error: %s", exc.message)
        yield _data(exc.to_json())
    finally:
        await events.aclose()  # closes the session on every hop, also when the client left
    yield "data: [DONE]\n\n"


def _with_delta(render: Render, index: int, delta: dict[str, Any]) -> dict[str, Any]:
    """A chunk of answer `index` carrying `delta` (a tool call's piece, or words)."""
    body = render(index, None, None, False, ())
    body["choices"][0]["delta"] = delta
    return body


def _data(body: dict[str, Any]) -> str:
    return f"data: {json.dumps(body, separators=(',', ':'))}\n\n"


def chat_renderer(model: str, token_text: TokenText | None) -> Render:
    base = _base(model, "chatcmpl", "chat.completion.chunk")

    def render(
        index: int, text: str | None, end: Finished | None, first: bool, scores: Scores
    ) -> dict[str, Any]:
        delta: dict[str, str] = {"role": "assistant", "content": ""} if first else {}
        if text:
            delta["content"] = text
        choice: dict[str, Any] = {"index": index, "delta": delta, "finish_reason": None}
        choice["logprobs"] = None  # OpenAI's when none were asked, or none in this chunk
        if token_text is not None and scores:
            choice["logprobs"] = chat_logprobs(scores, token_text)
        return _finish(base(), choice, end)

    return render


def text_renderer(model: str, token_text: TokenText | None) -> Render:
    base = _base(model, "cmpl", "text_completion")
    lists: dict[int, CompletionLogprobs] = {}  # each answer's offsets count its own text

    def render(
        index: int, text: str | None, end: Finished | None, first: bool, scores: Scores
    ) -> dict[str, Any]:
        logprobs = None
        if token_text is not None and scores:
            logprobs = lists.setdefault(index, CompletionLogprobs(token_text)).block(scores)
        choice: dict[str, Any] = {"index": index, "text": text or "", "logprobs": logprobs}
        return _finish(base(), choice | {"finish_reason": None}, end)

    return render


def _base(model: str, prefix: str, kind: str) -> Callable[[], dict[str, Any]]:
    request_id, created = f"{prefix}-{uuid.uuid4().hex}", int(time.time())
    return lambda: {"id": request_id, "object": kind, "created": created, "model": model}


def _finish(body: dict[str, Any], choice: dict[str, Any], end: Finished | None) -> dict[str, Any]:
    body["choices"] = [choice]
    if end is not None:
        choice["finish_reason"] = end.reason
        body["usage"] = usage([end])
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
            "degraded": end.degraded,
        }
    return body

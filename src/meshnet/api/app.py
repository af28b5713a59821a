"""The OpenAI-compatible endpoints: `/v1/chat/completions`, `/v1/completions`, `/v1/models`.

Handlers parse a declared request, turn it into token ids and generation settings, and
render the generator's events as one JSON answer or as server-sent events in OpenAI's chunk
format. Errors that happen before the first token (bad input, no route, a failed hop) are
HTTP errors in OpenAI's shape; an error after streaming began is sent as a final `error` event.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator, Awaitable, Callable, Mapping, Sequence
from typing import Protocol

from fastapi import APIRouter, FastAPI, Request
from starlette.responses import Response

from meshnet import __version__
from meshnet.api import schemas, tools
from meshnet.api.answers import chat_renderer, respond, respond_calls, text_renderer
from meshnet.api.logprobs import TokenText
from meshnet.config import AccessConfig, ApiLimits
from meshnet.errors import RequestError, UnknownModelError
from meshnet.http_errors import install_error_handlers
from meshnet.security.access import Credentials, Guard, Rule, client_of, rule
from meshnet.security.limits import ClientLimiter
from meshnet.security.vouch import TrackerKeys
from meshnet.text.codec import TextCodec
from meshnet.text.events import Event
from meshnet.text.params import GenerationParams

log = logging.getLogger(__name__)
Elsewhere = Callable[[Request], Awaitable[Response]]  # answers a call for a model not served here


class Generator(Protocol):
    """What the API needs of a served model (`meshnet.entry.generation.Generator` is one)."""

    codec: TextCodec
    max_context: int  # prompt + generated tokens, at most

    def stream(
        self, prompt: list[int], params: GenerationParams, client: str | None = None
    ) -> AsyncGenerator[Event]:
        """Text deltas, then one `Finished`."""
        ...


def access_rules(limits: ApiLimits, members: bool = False) -> list[Rule]:
    """The API answers clients: an API key, or a loopback caller when no key is configured;
    with `members` (a swarm key), also member-signed calls: a tracker forwarding a client it
    let in, named in `X-Meshnet-Client` (review N4: it no longer passes the client's key)."""
    body = limits.max_body_bytes
    needs = ("client", "swarm") if members else ("client",)
    return [
        rule("/v1/chat/completions", *needs, max_body_bytes=body),
        rule("/v1/completions", *needs, max_body_bytes=body),
        rule("/v1/models", *needs),
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
    names: frozenset[str] = frozenset(),
    trackers: TrackerKeys | None = None,
) -> FastAPI:
    """A FastAPI app serving the API, behind its access guard unless not `guarded` (a node
    mounting it checks access itself, with `access_rules` among its own); `names`: who it
    is to members (their proofs must be addressed to one); `trackers`: whose vouch makes a
    member's call a forwarded client's."""
    app = FastAPI(title="meshnet API", version=__version__)
    install_error_handlers(app)
    if guarded:
        rules = [*access_rules(limits, access.swarm_key is not None), *extra_rules]
        credentials = Credentials(access, names, trackers=trackers)
        app.add_middleware(Guard, rules=rules, credentials=credentials)
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
        events = _limited(generator.stream(prompt, params, client), limiter, client, params.n)
        render = chat_renderer(request.model, _token_text(generator, params))
        if plan is not None:
            return await respond_calls(events, request, render, plan, limits.write_timeout_s)
        return await respond(events, request, render, "chat.completion", limits.write_timeout_s)

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
        events = _limited(generator.stream(prompt, params, client), limiter, client, params.n)
        render = text_renderer(request.model, _token_text(generator, params))
        return await respond(events, request, render, "text_completion", limits.write_timeout_s)

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
    events: AsyncGenerator[Event], limiter: ClientLimiter, client: str, answers: int
) -> AsyncGenerator[Event]:
    """`events`, its `answers` counted among `client`'s in flight while it runs."""
    limiter.acquire(client, answers)
    try:
        async for event in events:
            yield event
    finally:
        await events.aclose()
        limiter.release(client, answers)

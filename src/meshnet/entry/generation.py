"""Generation at the entry node: a prompt's ids in, a stream of text deltas out.

One `Generator` per served model. Each request opens its own pipeline session (so concurrent
requests never share a cache), feeds the prompt as chunked prefill, then samples and feeds one
token at a time until end-of-sequence, a stop sequence or `max_tokens`. The session is closed
on every hop when the stream ends for any reason, the client going away included; one that
ended well is kept as a prompt prefix for the client's next requests (ADR-0058).
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import time
from collections.abc import AsyncGenerator, Callable
from contextlib import aclosing
from dataclasses import replace

import torch

from meshnet.entry.drafter import Drafter, LookupDrafter
from meshnet.entry.grammar import Grammar
from meshnet.entry.pipeline import Pipeline
from meshnet.entry.prefixes import BLOCK_TOKENS, scope_of
from meshnet.entry.session import PipelineSession
from meshnet.entry.speculation import Rounds
from meshnet.errors import RequestError
from meshnet.observe.logs import current_session
from meshnet.observe.metrics import Metrics
from meshnet.text.codec import TextCodec
from meshnet.text.decoding import Decoding
from meshnet.text.events import Delta, Event, Finished
from meshnet.text.params import GenerationParams
from meshnet.tracker import messages as msg

log = logging.getLogger(__name__)
MERGE_BACKLOG = 64  # events an answer may run ahead of a reader of several answers


class Generator:
    """Turns prompts into text through one model's pipeline."""

    def __init__(
        self,
        pipeline: Pipeline,
        codec: TextCodec,
        max_context: int,
        rng: random.Random,
        metrics: Metrics | None = None,
        on_end: Callable[[msg.RequestSummary], object] = lambda summary: None,
        max_drafts: int = 0,
        drafter: Drafter | None = None,
    ) -> None:
        self.pipeline = pipeline
        self.codec = codec
        self.max_context = max_context  # prompt + generated tokens, at most
        self.rng = rng  # seeds requests that give none
        self.metrics = metrics or Metrics()
        self.on_end = on_end  # gets a summary of every request, finished or failed
        self.max_drafts = max_drafts  # drafts verified a round at most; 0: no speculation
        self.drafter = drafter or LookupDrafter()  # where drafts come from (ADR-0038)

    @property
    def model(self) -> str:
        return self.pipeline.model

    def check(self, prompt: list[int], params: GenerationParams) -> None:
        """Refuse (400) what cannot fit before any work starts."""
        if not prompt:
            raise RequestError("the prompt is empty", field="prompt")
        if len(prompt) + params.max_tokens > self.max_context:
            raise RequestError(
                f"the prompt ({len(prompt)} tokens) plus max_tokens ({params.max_tokens}) "
                f"exceeds the model's context of {self.max_context} tokens",
                field="max_tokens",
            )

    async def stream(
        self, prompt: list[int], params: GenerationParams, client: str | None = None
    ) -> AsyncGenerator[Event]:
        """Text deltas, then one `Finished`, for each of the `params.n` answers (events of
        several answers interleave, each naming its `index`); every session is closed on
        every hop at the end. `client` (who asks: an API key's name) decides which kept
        prompt prefixes the request may reuse, and keeps its own for that client."""
        self.check(prompt, params)
        scope = scope_of(self.pipeline.prefix_sharing, client) if params.cache_prompt else None
        grammars: list[Grammar | None] = [None] * params.n
        if params.schema is not None or params.lark is not None:  # a bad one: 400, before work
            grammars = [await asyncio.to_thread(self._grammar, params) for _ in grammars]
        started = time.perf_counter()
        sessions: list[PipelineSession] = []  # the prompt's, then its forks
        ends: list[Finished] = []
        error = "the client went away"
        try:
            sessions.append(await self.pipeline.open(prompt, scope))
            current_session.set(sessions[0].id)  # every later line of this request names it
            route = ", ".join(str(h) for h in sessions[0].hops) or "no remote hops"
            reused = sessions[0].reused
            log.info("%d prompt tokens; route %s; %d reused", len(prompt), route, reused)
            # closed before the sessions are: no answer may still be feeding them
            generating = self._generate(sessions, prompt, params, started, grammars, scope)
            async with aclosing(generating) as events:
                async for event in events:
                    if isinstance(event, Finished):
                        ends.append(event)
                    yield event
        except Exception as exc:  # recorded for the dashboard, then raised on unchanged
            error = getattr(exc, "message", None) or repr(exc)
            raise
        finally:
            for session in sessions:
                self.drafter.forget(session.id)
            # Shielded: a client that went away cancels this task, and Starlette's
            # (anyio's) cancellation would otherwise hit every await of the clean-up too.
            # A request that ended well keeps its first session as a prompt prefix.
            keep = scope if len(ends) == params.n else None
            closing = [
                self.pipeline.close(s, keep if i == 0 else None) for i, s in enumerate(sessions)
            ]
            await asyncio.shield(asyncio.gather(*closing))
            if sessions:
                log.info("closed")
            end = together(ends) if len(ends) == params.n else None
            first = sessions[0] if sessions else None
            self._report(first, len(prompt), end, error, time.perf_counter() - started)

    def _grammar(self, params: GenerationParams) -> Grammar:
        """The request's structured-output constraint (its tokenizer is made once)."""
        tokenizer = self.codec.grammar_tokenizer()
        if params.lark is not None:
            return Grammar(tokenizer, None, "tools", lark=params.lark)
        assert params.schema is not None  # checked by the caller
        return Grammar(tokenizer, json.loads(params.schema), "response_format")

    async def _generate(
        self,
        sessions: list[PipelineSession],
        prompt: list[int],
        params: GenerationParams,
        started: float,
        grammars: list[Grammar | None],
        scope: str | None,
    ) -> AsyncGenerator[Event]:
        """The prompt once through the mesh; each answer's first token from its logits; then
        the answers decode side by side, each in its own session (a fork of the prompt's,
        appended to `sessions`)."""
        seed = params.sampling.seed
        generators = [
            seeded_rng(choice_seed(seed, i), self.rng.getrandbits(63)) for i in range(params.n)
        ]
        rounds = [
            self._rounds(params, grammar, len(prompt), generator)
            for grammar, generator in zip(grammars, generators, strict=True)
        ]

        def pick(logits: torch.Tensor) -> list[int]:  # compute thread: [V] -> a token each
            return [r.pick(logits, prompt, 0) for r in rounds]

        firsts = await self.pipeline.prefill(sessions[0], prompt, pick, scope)
        sessions.extend(self.pipeline.fork(sessions[0]) for _ in firsts[1:])
        # prompt tokens a kept prefix held (0 after a miss), said in whole blocks: the exact
        # count told a caller in the same scope where another's prompt diverged (review P1)
        cached = sessions[0].reused // BLOCK_TOKENS * BLOCK_TOKENS
        answers = [
            self._answer(session, r, first, (len(prompt), cached), params, started, index)
            for index, (session, r, first) in enumerate(zip(sessions, rounds, firsts, strict=True))
        ]
        async with aclosing(answers[0] if len(answers) == 1 else merged(answers)) as events:
            async for event in events:
                yield event

    def _rounds(
        self,
        params: GenerationParams,
        grammar: Grammar | None,
        prompt_tokens: int,
        generator: torch.Generator,
    ) -> Rounds:
        return Rounds(
            self.pipeline,
            params.sampling,
            generator,
            self.max_drafts,
            self.drafter,
            prompt_tokens,
            params.logprobs,
            grammar=grammar,
        )

    async def _answer(
        self,
        session: PipelineSession,
        rounds: Rounds,
        first: int,
        prompt: tuple[int, int],
        params: GenerationParams,
        started: float,
        index: int,
    ) -> AsyncGenerator[Event]:
        """One answer: its tokens from `first` (sampled, not yet fed) on, until it ends;
        `prompt`: the prompt's tokens, and how many of them a kept prefix held."""
        state = Decoding()
        fresh = [first]
        tokens = self.metrics.tokens_generated.labels(self.model)
        while state.reason is None:
            for token in fresh:  # a round gives one token, or several verified drafts
                state.first_s = state.first_s or time.perf_counter() - started
                delta = state.accept(token, self.codec, params)
                ending = token in self.codec.eos_token_ids
                tokens.inc(not ending)
                score = rounds.scores.pop(0) if rounds.scores else None
                scores = (score,) if score is not None and not ending else ()
                if delta or scores:
                    yield Delta(delta, scores, index)
                if state.reason is not None:
                    break
            else:
                fresh = await rounds.next(
                    session, fresh[-1], params.max_tokens - len(state.generated)
                )
        self.metrics.draft_tokens.labels(self.model).inc(rounds.drafted)
        self.metrics.accepted_tokens.labels(self.model).inc(rounds.accepted)
        yield Finished(
            state.reason,
            prompt[0],
            len(state.generated),
            [self.pipeline.entry_hop, *session.hops],
            state.first_s,
            time.perf_counter() - started - state.first_s,
            state.generated,
            session.failover_pauses_s,
            rounds.drafted,
            rounds.accepted,
            rounds.rounds,
            index,
            session.degraded,
            prompt[1],
        )

    def _report(
        self,
        session: PipelineSession | None,
        prompt_tokens: int,
        end: Finished | None,
        error: str,
        duration_s: float,
    ) -> None:
        """Count the request and hand its summary to `on_end` (the dashboard's feed)."""
        outcome = end.reason if end is not None else "error"
        self.metrics.requests.labels(self.model, outcome).inc()
        if session is None and end is None:
            log.warning("request failed before it had a session: %s", error)
        summary = msg.RequestSummary(
            session=session.id if session else "none",
            model=self.model,
            outcome=outcome,
            prompt_tokens=prompt_tokens,
            completion_tokens=end.completion_tokens if end else 0,
            duration_s=round(duration_s, 4),
            time_to_first_token_s=round(end.first_token_s, 4) if end else 0.0,
            decode_tokens_per_s=round(end.decode_tokens_per_s, 2) if end else 0.0,
            failovers=len(session.failover_pauses_s) if session else 0,
            error="" if end else error[:500],
        )
        self.on_end(summary)


def seeded_rng(seed: int | None, fallback: int) -> torch.Generator:
    """A CPU generator seeded with `seed`, or with `fallback` (drawn by the caller) when None."""
    generator = torch.Generator()
    generator.manual_seed(seed if seed is not None else fallback)
    return generator


def choice_seed(seed: int | None, index: int) -> int | None:
    """Answer `index`'s seed: the request's for the first, the next ones for the others (a
    seeded request with n > 1 gives the same n answers every time, and they differ)."""
    if seed is None or index == 0:
        return seed
    return (seed + index) % 2**63


def together(ends: list[Finished]) -> Finished:
    """The request's summary of its answers' ends: the first's, with every completion token."""
    total = sum(end.completion_tokens for end in ends)
    return replace(min(ends, key=lambda end: end.index), completion_tokens=total)


async def merged(streams: list[AsyncGenerator[Event]]) -> AsyncGenerator[Event]:
    """The events of `streams` as they come; the first error ends them all. Each stream runs
    in its own task, at most `MERGE_BACKLOG` events ahead of the reader."""
    queue: asyncio.Queue[Event | Exception | None] = asyncio.Queue(MERGE_BACKLOG)

    async def pump(stream: AsyncGenerator[Event]) -> None:
        try:
            async for event in stream:
                await queue.put(event)
        except Exception as exc:  # handed to the reader, which raises it
            await queue.put(exc)
        else:
            await queue.put(None)
        finally:
            await stream.aclose()

    tasks = [asyncio.ensure_future(pump(stream)) for stream in streams]
    try:
        running = len(tasks)
        while running:
            item = await queue.get()
            if isinstance(item, Exception):
                raise item
            if item is None:
                running -= 1
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

"""Generation at the entry node: a prompt's ids in, a stream of text deltas out.

One `Generator` per served model. Each request opens its own pipeline session (so concurrent
requests never share a cache), feeds the prompt as chunked prefill, then samples and feeds one
token at a time until end-of-sequence, a stop sequence or `max_tokens`. The session is closed
on every hop when the stream ends for any reason, the client going away included.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import time
from collections.abc import AsyncGenerator, Callable
from functools import partial

import torch

from meshnet.entry.drafter import Drafter, LookupDrafter
from meshnet.entry.grammar import Grammar
from meshnet.entry.pipeline import Pipeline
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

    async def stream(self, prompt: list[int], params: GenerationParams) -> AsyncGenerator[Event]:
        """Text deltas, then one `Finished`; the session is closed on every hop at the end."""
        self.check(prompt, params)
        grammar = None
        if params.schema is not None or params.lark is not None:  # a bad one: 400, before work
            grammar = await asyncio.to_thread(self._grammar, params)
        started = time.perf_counter()
        session: PipelineSession | None = None
        end: Finished | None = None
        error = "the client went away"
        try:
            session = await self.pipeline.open()
            current_session.set(session.id)  # every later line of this request names it
            route = ", ".join(str(h) for h in session.hops) or "no remote hops"
            log.info("%d prompt tokens; route %s", len(prompt), route)
            async for event in self._generate(session, prompt, params, started, grammar):
                end = event if isinstance(event, Finished) else None
                yield event
        except Exception as exc:  # recorded for the dashboard, then raised on unchanged
            error = getattr(exc, "message", None) or repr(exc)
            raise
        finally:
            if session is not None:
                self.drafter.forget(session.id)
                # Shielded: a client that went away cancels this task, and Starlette's
                # (anyio's) cancellation would otherwise hit every await of the clean-up too.
                await asyncio.shield(self.pipeline.close(session))
                log.info("closed")
            self._report(session, len(prompt), end, error, time.perf_counter() - started)

    def _grammar(self, params: GenerationParams) -> Grammar:
        """The request's structured-output constraint (its tokenizer is made once)."""
        tokenizer = self.codec.grammar_tokenizer()
        if params.lark is not None:
            return Grammar(tokenizer, None, "tools", lark=params.lark)
        assert params.schema is not None  # checked by the caller
        return Grammar(tokenizer, json.loads(params.schema), "response_format")

    async def _generate(
        self,
        session: PipelineSession,
        prompt: list[int],
        params: GenerationParams,
        started: float,
        grammar: Grammar | None = None,
    ) -> AsyncGenerator[Event]:
        state = Decoding()
        generator = seeded_rng(params.sampling.seed, self.rng.getrandbits(63))
        rounds = Rounds(
            self.pipeline,
            params.sampling,
            generator,
            self.max_drafts,
            self.drafter,
            len(prompt),
            params.logprobs,
            grammar=grammar,
        )
        pick = partial(rounds.pick, text=prompt, generated=0)
        fresh = [await self.pipeline.feed(session, prompt, pick)]  # sampled on the compute thread
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
                    yield Delta(delta, scores)
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
            len(prompt),
            len(state.generated),
            [self.pipeline.entry_hop, *session.hops],
            state.first_s,
            time.perf_counter() - started - state.first_s,
            state.generated,
            session.failover_pauses_s,
            rounds.drafted,
            rounds.accepted,
            rounds.rounds,
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

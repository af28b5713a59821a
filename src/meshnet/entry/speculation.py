"""Decode rounds at the entry: one token a trip, or drafts verified in one frame (ADR-0038).

A round feeds the last sampled token. With drafts (`entry/drafter.py`), it feeds the
last token and k drafts as one frame through every hop; the logits of all k + 1 positions
decide which drafts stand (`text/sampling.py: accept_drafts`), and the session forgets the
rest (`PipelineSession.rewind`): its next frames tell every cache to drop them too. The
output is the one plain decoding gives; only the number of trips changes.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from meshnet.entry.drafter import Drafter, LookupDrafter
from meshnet.entry.grammar import Grammar
from meshnet.entry.pipeline import Pipeline
from meshnet.entry.session import PipelineSession
from meshnet.text.drafts import DraftState, after_plain, after_verify
from meshnet.text.events import TokenLogprob
from meshnet.text.params import SamplingParams
from meshnet.text.sampling import accept_drafts, sample, scored

INITIAL_DRAFT_TOKENS = 4  # the first verify round's drafts, once a plain step was timed
PROBE_EVERY = 16  # plain steps after drafting stopped paying before it tries 1 draft again


@dataclass
class Rounds:
    """One generation's decode rounds through `pipeline`."""

    pipeline: Pipeline
    params: SamplingParams
    generator: torch.Generator
    max_drafts: int  # 0: never draft
    drafter: Drafter = field(default_factory=LookupDrafter)
    prompt_tokens: int = 0  # the history's first tokens that are the prompt (penalties)
    logprobs: int | None = None  # score each picked token, with this many alternatives
    scores: list[TokenLogprob] = field(default_factory=list)  # picked tokens' scores, in order
    grammar: Grammar | None = None  # structured output: tokens it forbids are never picked
    rounds: int = 0  # trips through the mesh after the prompt's
    drafted: int = 0  # draft tokens sent for verification
    accepted: int = 0  # of those, the ones that stood

    def __post_init__(self) -> None:
        self.state = DraftState(0)

    async def next(self, session: PipelineSession, last: int, left: int) -> list[int]:
        """Feed `last` (sampled, not yet fed); the tokens that follow it, at most `left`."""
        k = min(self.state.length, self.max_drafts, left - 1) if self.grammar is None else 0
        drafts = await self._drafts(session, last, k) if k > 0 else []
        started = time.perf_counter()
        self.rounds += 1
        text = [*session.history, last]  # what the logits follow (penalties look at it)
        generated = len(text) - self.prompt_tokens
        if not drafts:
            token = await self.pipeline.feed(
                session, [last], lambda logits: self.pick(logits, text, generated)
            )
            self.state = after_plain(
                self.state, time.perf_counter() - started, INITIAL_DRAFT_TOKENS, PROBE_EVERY
            )
            return [token]
        taken, after = await self.pipeline.feed(
            session,
            [last, *drafts],
            lambda logits: self._verify(logits, drafts, text, generated),
            rows=len(drafts) + 1,
        )
        session.rewind(len(drafts) - taken)
        took_s = time.perf_counter() - started
        self.state = after_verify(self.state, len(drafts), taken, took_s, self.max_drafts)
        self.drafted += len(drafts)
        self.accepted += taken
        return [*drafts[:taken], after]

    async def _drafts(self, session: PipelineSession, last: int, k: int) -> list[int]:
        text = [*session.history, last]
        if self.drafter.runs_model:  # a model's steps wait their turn on the compute thread
            return await self.pipeline.executor.call(self.drafter.propose, session.id, text, k)
        return self.drafter.propose(session.id, text, k)

    def pick(self, logits: torch.Tensor, text: list[int], generated: int) -> int:
        """The token after `text` (`generated` of it the completion's), scored if asked."""
        allowed = logits if self.grammar is None else self.grammar.mask(logits)
        token = sample(allowed, self.params, self.generator, text, generated)
        self._score(logits.reshape(1, -1), [token])  # the model's own distribution
        if self.grammar is not None:
            self.grammar.advance(token)
        return token

    def _verify(
        self, logits: torch.Tensor, drafts: list[int], text: list[int], generated: int
    ) -> tuple[int, int]:
        taken, after = accept_drafts(logits, drafts, self.params, self.generator, text, generated)
        self._score(logits, [*drafts[:taken], after])
        return taken, after

    def _score(self, rows: torch.Tensor, tokens: list[int]) -> None:
        """Record `tokens[i]`'s score under `rows[i]` [V] (when logprobs were asked)."""
        if self.logprobs is not None:
            used = zip(rows[: len(tokens)], tokens, strict=True)  # drafts after a miss: unused
            self.scores.extend(scored(row, token, self.logprobs) for row, token in used)

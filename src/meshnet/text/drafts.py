"""Draft tokens for speculative decoding, and how many to draft (ADR-0038). Pure functions.

`lookup` is prompt-lookup drafting: the last few tokens of the text so far very often
occurred before (a quoted passage, code being edited, a name, a repeated structure), and
what followed them then is a good guess for what follows now. No second model; a verify
round through the mesh costs about one decode step, so every accepted draft saves a trip.

`next_length` adapts the draft length per session from what the last verify round gave
against a plain step's time: it grows while drafts are accepted and pay, halves when they
do not, and reaches 0 (no drafting) where a verify round costs more than it saves; from 0
it probes with 1 draft every `probe_every` plain steps.
"""

from __future__ import annotations

from dataclasses import dataclass


def lookup(tokens: list[int], k: int, max_ngram: int = 3, min_ngram: int = 2) -> list[int]:
    """Up to `k` tokens that followed the latest earlier occurrence of the longest suffix
    of `tokens` (from `max_ngram` down to `min_ngram` tokens); [] when none recurs."""
    if k <= 0:
        return []
    for n in range(min(max_ngram, len(tokens) - 1), min_ngram - 1, -1):
        suffix = tokens[-n:]
        for start in range(len(tokens) - n - 1, -1, -1):  # latest first, never the suffix
            if tokens[start : start + n] == suffix:
                return tokens[start + n : start + n + k]
    return []


@dataclass(frozen=True)
class DraftState:
    """One session's draft length and what it knows of its rounds' costs."""

    length: int  # drafts to propose in the next round (0: decode plainly)
    plain_s: float | None = None  # a plain decode step's time, smoothed
    plain_since_probe: int = 0  # plain steps since drafting stopped


SMOOTHING = 0.3  # weight of the newest plain step in `plain_s`


def after_plain(state: DraftState, took_s: float, initial: int, probe_every: int) -> DraftState:
    """The state after a plain step of `took_s`: its time learnt; a probe is due when
    drafting has been off for `probe_every` steps."""
    plain = (
        took_s if state.plain_s is None else SMOOTHING * took_s + (1 - SMOOTHING) * state.plain_s
    )
    if state.plain_s is None:  # the first plain step measured: drafting may start
        return DraftState(initial, plain, 0)
    since = state.plain_since_probe + 1 if state.length == 0 else 0
    length = 1 if state.length == 0 and since >= probe_every else state.length
    return DraftState(length, plain, 0 if length else since)


def after_verify(
    state: DraftState, drafted: int, accepted: int, took_s: float, max_length: int
) -> DraftState:
    """The state after a verify round of `drafted` drafts, `accepted` of them standing,
    that took `took_s`: it gave `accepted + 1` tokens where a plain step gives one."""
    if state.plain_s is None or drafted == 0:
        return state
    paid = (accepted + 1) * state.plain_s >= took_s  # tokens per second, against plain
    if not paid:
        return DraftState(state.length // 2, state.plain_s, 0)
    if accepted == drafted:
        return DraftState(min(max_length, max(2 * state.length, 1)), state.plain_s, 0)
    return DraftState(max(1, min(state.length, accepted + 1)), state.plain_s, 0)

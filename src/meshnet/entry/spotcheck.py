"""Integrity spot checks: a random sample of hop answers, re-run on another copy of the span.

A hostile or broken member can answer with activations of the right shape, session and
position that are simply wrong; nothing in the frame shows it. For a sample of the frames
it sends (`rate`, a setting), the entry, after the hop answered, sends everything that hop
was sent in the session (its replay inputs, the frame included) to another copy of the same
layers as a fresh, throwaway session, and compares that copy's output at the frame's
positions with the hop's answer. Within the quantizations' tolerance, all is well. Beyond
it, a third copy decides: whoever disagrees with the other two is banned (kept out of this
entry's routes for `ban_s`) and reported to the tracker; without a third copy (or when all
three disagree) every party to the disagreement is banned. A check runs in the background,
off the token's path, one at a time per checked node.

The cost is the copy's compute: a check of a frame at position p re-runs p + T tokens there
(as a prefill), so on average a generation of N tokens with check rate r costs about
r * N / 2 extra prefill tokens per generated token (`benchmarks/spotcheck.py` measures it).
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypeVar
from urllib.parse import urlsplit

import torch

from meshnet.entry.bans import Bans
from meshnet.entry.hops import Hops
from meshnet.entry.session import PipelineSession
from meshnet.errors import HopError, RouteError
from meshnet.models.quant import scheme_of
from meshnet.types import Hop, LayerSpan, NodeId, Quant
from meshnet.wire import FrameMeta

log = logging.getLogger(__name__)
K = TypeVar("K")
Result = tuple[tuple[Hop, ...], torch.Tensor, Quant | None]  # (chain, its output, its quant)

# Relative error ||a - b|| / ||b|| between two honest copies of a span's output, measured on
# SmolLM2 spans 10:20 and 20:30 (bf16 on the wire, prefill and decode): fp32, bf16 and int8
# pairs 0.006-0.051; any pair with nf4 up to 0.35 (its GGUF weights are 4-bit already).
# Wrong answers measured: another token's output 0.87-1.0, the input passed through 0.55-0.97.
# A 5% perturbation (0.05) is within tolerance: spot checks catch garbage, not subtle bias.
TOLERANCE = 0.15
NF4_TOLERANCE = 0.5  # also q4's: 4-bit weights, re-quantized where the file's were not Q4
MAX_HOST_TRIES = 3  # routes asked for a copy on another host before taking one on the same


def tolerance(a: Quant | None, b: Quant | None, loose: bool = True) -> float:
    """How far two honest copies with these weight quantizations may differ. Two copies of
    one quantization hold the same weights, so only compute dtype and batching part them:
    the tight tolerance. Without `loose` (a GGUF mesh, whose tracker serves no copy that
    re-quantizes the file: ADR-0060), every pair gets it whatever the hops declare (review
    N8: a liar declaring bf16 passed 30% noise against ggml copies)."""
    if not loose or (a == b and a is not None):
        return TOLERANCE
    return NF4_TOLERANCE if _four_bit(a) or _four_bit(b) or None in (a, b) else TOLERANCE


def _four_bit(quant: Quant | None) -> bool:
    """4-bit weights of the copy's own making: against another kind, the loose tolerance
    (`QuantScheme.four_bit`)."""
    return quant is not None and scheme_of(quant).four_bit


def relative_error(answer: torch.Tensor, reference: torch.Tensor) -> float:
    """||answer - reference|| / ||reference||, in float32 (inf for another shape)."""
    if answer.shape != reference.shape:
        return float("inf")
    ref = reference.float()
    return float((answer.float() - ref).norm() / ref.norm().clamp_min(1e-12))


def outliers(
    results: Sequence[tuple[K, torch.Tensor, Quant | None]], loose: bool = True
) -> list[K]:
    """The parties whose output agrees with no other's (all of them when no two agree):
    whom a disagreement bans. Pure: `results` are (party, output, its quantization);
    `loose` as for `tolerance`."""

    def agree(i: int, j: int) -> bool:
        (_, a, qa), (_, b, qb) = results[i], results[j]
        return relative_error(a, b) <= tolerance(qa, qb, loose)

    n = len(results)
    alone = [
        k for i, (k, _, _) in enumerate(results) if not any(agree(i, j) for j in range(n) if j != i)
    ]
    return alone


@dataclass(frozen=True)
class Sample:
    """One hop answer to check: what the hop was sent in the session (bf16 [1, P + T, H],
    the frame last) and what it answered for the frame (bf16 [1, T, H])."""

    hop: Hop
    inputs: torch.Tensor
    answer: torch.Tensor
    excluded: frozenset[NodeId]  # the session's banned hops: never asked to judge


class SpotChecker:
    """Draws frames to check (`rate` of them), runs each check in the background: one at a
    time per checked node (so every hop of a route gets its turn), `max_in_flight` in all."""

    def __init__(
        self,
        rate: float,
        rng: random.Random,
        bans: Bans,
        max_in_flight: int = 4,
        file_weights: bool = False,  # a GGUF mesh: every copy the file's weights, one tolerance
    ) -> None:
        if not 0.0 <= rate <= 1.0:
            raise ValueError(f"a spot-check rate is a fraction in [0, 1], not {rate}")
        self.rate = rate
        self.loose = not file_weights
        self.rng = rng
        self.bans = bans
        self.max_in_flight = max_in_flight
        self.tasks: dict[NodeId, asyncio.Task[None]] = {}  # checks in flight, by checked node
        self.tokens_rerun = 0  # tokens the checks made other copies compute
        self.checks_run = 0

    def offer(
        self,
        hops: Hops,
        session: PipelineSession,
        k: int,
        meta: FrameMeta,
        answer: torch.Tensor,
    ) -> None:
        """After hop `k` answered `meta`'s frame with `answer`: start a check of it, by
        chance, when none is running and the session kept its inputs."""
        if self.rate <= 0.0 or self.rng.random() >= self.rate:
            return
        self.tasks = {n: t for n, t in self.tasks.items() if not t.done()}
        node = session.hops[k].node_id
        if node in self.tasks or len(self.tasks) >= self.max_in_flight:
            hops.metrics.spot_checks.labels("skipped").inc()
            return
        pieces = session.inputs[k]
        held = sum(p.shape[1] for p in pieces)
        if not session.replayable or held != meta.position + answer.shape[1]:
            hops.metrics.spot_checks.labels("skipped").inc()
            return
        sample = Sample(
            session.hops[k], torch.cat(pieces, dim=1), answer, frozenset(session.banned)
        )
        self.tasks[node] = asyncio.ensure_future(self.check(hops, sample))

    async def drain(self) -> None:
        """Wait for the check in flight (tests, shutdown)."""
        await asyncio.gather(*self.tasks.values(), return_exceptions=True)

    async def check(self, hops: Hops, sample: Sample) -> None:
        """Compare the sample with other copies; ban and report whoever disagrees."""
        try:
            await self._check(hops, sample)
        except Exception:  # a background task: log, never take the entry down
            log.exception("spot check of %s failed", sample.hop)
            hops.metrics.spot_checks.labels("skipped").inc()

    async def _check(self, hops: Hops, sample: Sample) -> None:
        hop, tokens = sample.hop, sample.answer.shape[1]
        self.checks_run += 1
        results: list[Result] = [((hop,), sample.answer, hop.quant)]
        asked = {hop.node_id} | sample.excluded
        for _ in range(2):  # another copy; a third one only to settle a disagreement
            addresses = [h.address for chain, _, _ in results for h in chain]
            found = await self._rerun(hops, sample, frozenset(asked), addresses)
            if found is None:
                break
            chain, output = found
            asked |= {h.node_id for h in chain}
            results.append((tuple(chain), output[:, -tokens:], _quant(chain)))
            if len(results) == 2 and not outliers(results, self.loose):
                hops.metrics.spot_checks.labels("match").inc()
                return
        if len(results) == 1:
            hops.metrics.spot_checks.labels("no_copy").inc()
            return
        await self._judge(hops, results)

    async def _judge(self, hops: Hops, results: list[Result]) -> None:
        """Ban and report every hop of each chain that agrees with no other copy."""
        guilty = outliers(results, self.loose)
        hops.metrics.spot_checks.labels("mismatch").inc()
        honest = [output for chain, output, _ in results if chain not in guilty]
        reference = honest[0] if honest else results[0][1]
        for chain, output, _ in results:
            if chain not in guilty:
                continue
            error = relative_error(output, reference)
            for hop in chain:
                reason = (
                    f"spot check: its answer for layers {hop.span} agrees with none of "
                    f"{len(results) - 1} other copies (relative error {error:.2f})"
                )
                log.warning("banning %s: %s", hop, reason)
                self.bans.ban(hop.node_id)
                hops.metrics.spot_check_bans.inc()
                await hops.report(hop.node_id, reason)

    async def _rerun(
        self,
        hops: Hops,
        sample: Sample,
        exclude: frozenset[NodeId],
        addresses: Sequence[str],
    ) -> tuple[list[Hop], torch.Tensor] | None:
        """`sample.inputs` through another chain for the hop's layers, as a throwaway
        session, away from the hosts of `addresses` (the copies asked so far) when it can
        be; (the chain, its output [1, P + T, H]), or None when there is none."""
        span, hosts = sample.hop.span, frozenset(host_of(a) for a in addresses)
        chain = await copy_route(hops, span, exclude | self.bans.active(), hosts)
        if chain is None:
            return None
        session = hops.keys.new_id("check")
        hidden = sample.inputs
        try:
            for hop in chain:
                hidden = await hops.replay(hop, session, hidden)
                self.tokens_rerun += hidden.shape[1]
        except HopError as exc:  # that copy failed: not a verdict on anyone
            log.info("spot check of %s: copy %s failed: %s", sample.hop, exc.hop, exc.message)
            return None
        finally:
            await asyncio.gather(*(hops.close(h, session) for h in chain))
        return chain, hidden


async def copy_route(
    hops: Hops, span: LayerSpan, exclude: frozenset[NodeId], hosts: frozenset[str]
) -> list[Hop] | None:
    """A chain for `span` without `exclude`, on none of `hosts` when there is one (review
    N8: two copies on one host agreed and outvoted the honest one), else on any; None when
    there is no chain at all."""
    tried: frozenset[NodeId] = frozenset()
    fallback: list[Hop] | None = None
    for _ in range(MAX_HOST_TRIES):
        try:
            chain = await hops.route(span.start, span.end, exclude | tried)
        except RouteError:
            return fallback
        shared = {h.node_id for h in chain if host_of(h.address) in hosts}
        if not shared:
            return chain
        fallback, tried = fallback or chain, tried | shared
    return fallback


def host_of(address: str) -> str:
    return urlsplit(address).hostname or address


def _quant(chain: Sequence[Hop]) -> Quant | None:
    """A chain's quantization for tolerance: a 4-bit one if any hop's is, else the first
    known."""
    quants = [h.quant for h in chain]
    return next((q for q in quants if _four_bit(q)), next((q for q in quants if q), None))

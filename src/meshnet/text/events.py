"""What a generation yields: text deltas, then one `Finished`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from meshnet.types import Hop

FinishReason = Literal["stop", "length"]


@dataclass(frozen=True)
class TokenLogprob:
    """A generated token's log-probability under the model (log-softmax of its logits, before
    penalties and temperature) and the `top` most likely ids with theirs, best first."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class Delta:
    text: str
    logprobs: tuple[TokenLogprob, ...] = ()  # the tokens decided at this step, when asked
    index: int = 0  # the answer (choice) it belongs to, when a request asked for several


@dataclass(frozen=True)
class Finished:
    reason: FinishReason
    prompt_tokens: int
    completion_tokens: int
    route: list[Hop]  # the entry's own span, then the remote hops
    first_token_s: float  # from the request to the first sampled token
    decode_s: float  # from the first sampled token to the end
    token_ids: list[int] = field(default_factory=list)
    failover_pauses_s: list[float] = field(default_factory=list)  # one per replaced hop
    drafted_tokens: int = 0  # draft tokens sent for verification (ADR-0038)
    accepted_tokens: int = 0  # of those, the ones that stood
    decode_rounds: int = 0  # trips through the mesh after the prompt's
    index: int = 0  # the answer (choice) it ends
    degraded: bool = False  # routed among the members last seen: the tracker was unreachable
    cached_tokens: int = 0  # prompt tokens a kept prefix held: not computed (ADR-0058)

    @property
    def decode_tokens_per_s(self) -> float:
        steps = self.completion_tokens - 1
        return steps / self.decode_s if steps > 0 and self.decode_s > 0 else 0.0


Event = Delta | Finished

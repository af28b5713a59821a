"""Push routes (ADR-0034): the rest of a session's route, carried by a pushed frame.

A pushed frame tells its hop where its output goes: `X-Meshnet-Route` lists every remote hop
of the session in order, `X-Meshnet-Reply-To` names the entry that takes the last hop's
output, `X-Meshnet-Route-Proof` is the entry's MAC over both (and the session and model), and
`X-Meshnet-Budget-Ms` is how long the rest of the chain may take. A hop finds itself in the
route by its node id and the frame's layers, and sends its output to the hop after it.

    X-Meshnet-Route: n-1 10:20 http://10.0.0.2:8001, n-2 20:30 https://10.0.0.3:8001
    X-Meshnet-Reply-To: n-0 http://10.0.0.1:8000
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

from meshnet.errors import PushError, WireError, read_error
from meshnet.types import Hop, LayerSpan, NodeId, is_valid_id

ROUTE = "X-Meshnet-Route"
REPLY_TO = "X-Meshnet-Reply-To"
ROUTE_PROOF = "X-Meshnet-Route-Proof"
BUDGET = "X-Meshnet-Budget-Ms"
PUSH_PATH = "/push"  # where the last hop posts its output, on the entry
SHARE_OF_BUDGET = 0.9  # each hop gives the rest of the chain this share of what it has left
MAX_ANSWER_BYTES = 64 * 1024  # a hop's answer to a pushed frame is a short JSON body
MAX_HOPS = 64
MAX_ROUTE_CHARS = 8192  # 64 hops of ~100 characters; headers beyond it are refused


@dataclass(frozen=True)
class Reply:
    """Where the last hop's output goes: the entry's node id and address."""

    node_id: NodeId
    address: str

    def __str__(self) -> str:
        return f"{self.node_id} {self.address}"


@dataclass(frozen=True)
class PushRoute:
    """The remote hops of a session, in order, and the entry they answer to."""

    hops: tuple[Hop, ...]
    reply: Reply

    def signed(self) -> tuple[str, str]:
        """What the entry's route proof covers besides session and model: route, reply."""
        return route_text(self.hops), str(self.reply)

    def headers(self, proof: str, budget_ms: int) -> dict[str, str]:
        """The push headers a frame for this route carries."""
        return {
            ROUTE: route_text(self.hops),
            REPLY_TO: str(self.reply),
            ROUTE_PROOF: proof,
            BUDGET: str(budget_ms),
        }

    def after(self, node_id: str, span: LayerSpan) -> Hop | None:
        """The hop after (`node_id`, `span`), None for the last; a `WireError` when that hop
        is not on the route (a frame sent to the wrong node, or for other layers)."""
        for k, hop in enumerate(self.hops):
            if hop.node_id == node_id and hop.span == span:
                return self.hops[k + 1] if k + 1 < len(self.hops) else None
        raise WireError(f"this node ({node_id}, layers {span}) is not on the route", field=ROUTE)


def route_text(hops: tuple[Hop, ...]) -> str:
    return ", ".join(f"{hop.node_id} {hop.span} {hop.address}" for hop in hops)


_ADDRESS_RE = re.compile(r"https?://[A-Za-z0-9.\-\[\]:]{1,260}")  # scheme://host:port, no path


def _address(text: str, name: str) -> str:
    if not _ADDRESS_RE.fullmatch(text):
        raise WireError(f"{name}: {text[:80]!r} is not an http(s)://host:port address", field=name)
    return text


def _node(text: str, name: str) -> NodeId:
    if not is_valid_id(text):
        raise WireError(f"{name}: invalid node id {text[:80]!r}", field=name)
    return NodeId(text)


def _hop(text: str) -> Hop:
    parts = text.strip().split(" ")
    if len(parts) != 3:
        raise WireError(
            f"{ROUTE}: a hop is 'node-id start:end address', not {text[:80]!r}", field=ROUTE
        )
    try:
        span = LayerSpan.parse(parts[1])
    except ValueError as exc:
        raise WireError(f"{ROUTE}: bad layers {parts[1][:40]!r}", field=ROUTE) from exc
    return Hop(_node(parts[0], ROUTE), _address(parts[2], ROUTE), span)


def parse_route(headers: Mapping[str, str]) -> PushRoute | None:
    """The push route a frame's headers (lower-case names) carry; None when not pushed."""
    text = headers.get(ROUTE.lower())
    if text is None:
        return None
    if len(text) > MAX_ROUTE_CHARS:
        raise WireError(f"{ROUTE} is over {MAX_ROUTE_CHARS} characters", field=ROUTE)
    hops = tuple(_hop(part) for part in text.split(","))
    if len(hops) > MAX_HOPS:
        raise WireError(f"{ROUTE} names over {MAX_HOPS} hops", field=ROUTE)
    for before, after in zip(hops, hops[1:], strict=False):
        if before.span.end != after.span.start:
            raise WireError(f"{ROUTE}: {before.span} is not followed by {after.span}", field=ROUTE)
    reply = headers.get(REPLY_TO.lower(), "").split(" ")
    if len(reply) != 2:
        raise WireError(f"{REPLY_TO} must be 'node-id address'", field=REPLY_TO)
    return PushRoute(hops, Reply(_node(reply[0], REPLY_TO), _address(reply[1], REPLY_TO)))


def budget_ms(headers: Mapping[str, str]) -> int:
    """`X-Meshnet-Budget-Ms`: how long the rest of the chain may take (1 ms .. 1 hour)."""
    text = headers.get(BUDGET.lower(), "")
    if not text.isdigit() or len(text) > 7 or not 1 <= int(text) <= 3_600_000:
        raise WireError(f"{BUDGET} must be 1-3600000 milliseconds", field=BUDGET)
    return int(text)


def passed_back(target: str, status: int, body: bytes) -> PushError:
    """The `PushError` for a refusal from `target`: a push error from further down as it
    came, else `target`'s status and the type of its error, never its words (review N6: a
    hop relayed 300 characters of whatever answered, an internal service's included)."""
    error = read_error(body)
    failed = error.raw.get("failed") if error is not None else None
    if error is not None and error.code == "push_failed" and isinstance(failed, str):
        given = error.raw.get("status")
        return PushError(
            error.message[:300],
            failed=failed,
            status=given if isinstance(given, int) else None,
        )
    kind = error.type if error is not None else ""
    named = f" ({kind})" if kind.isidentifier() and len(kind) <= 40 else ""
    return PushError(f"{target} answered {status}{named}", failed=target, status=status)

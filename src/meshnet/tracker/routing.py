"""Route choice: a pure function from the loaded spans of a model to a chain of hops."""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from meshnet.errors import MissingLayersError, RouteError
from meshnet.security.swarm import TRACKER
from meshnet.tracker.planner import gaps
from meshnet.types import LayerSpan, ModelId, NodeId, Quant


@dataclass(frozen=True)
class Server:
    """One node serving one loaded span."""

    node_id: NodeId
    address: str
    span: LayerSpan
    throughput: float  # higher is faster (measured at start-up: matrix-vector products/s)
    sessions: int  # sessions it holds now
    queue_depth: int = 0  # jobs waiting for its compute thread (at its last heartbeat)
    step_s: float = 0.0  # its median decode round in seconds; 0 = not measured yet

    quant: Quant | None = None  # its weights' quantization (spot checks' tolerance)
    rtt_s: float = 0.0  # its round trip from the entry asking for the route; 0 = unknown


def choose_route(
    model: ModelId,
    num_layers: int,
    servers: Sequence[Server],
    start: int,
    rng: random.Random,
    end: int | None = None,
) -> list[Server]:
    """Hops covering `[start, end)` (`end` defaults to `num_layers`): fewest hops, then cost.

    The cost of a hop is its expected wait (`cost`); among hops of equal cost `rng` picks,
    which spreads sessions across replicas. Raises `MissingLayersError` naming uncovered
    layers, or `RouteError` when layers are covered but no chain lines up.
    """
    end = num_layers if end is None else end
    best: dict[int, tuple[int, float]] = {end: (0, 0.0)}  # position -> (hops, cost)
    by_start: dict[int, list[Server]] = {}
    for server in servers:
        if server.span.end <= end:
            by_start.setdefault(server.span.start, []).append(server)
    for position in range(end - 1, start - 1, -1):
        options = [
            (best[s.span.end][0] + 1, best[s.span.end][1] + cost(s))
            for s in by_start.get(position, [])
            if s.span.end in best
        ]
        if options:
            best[position] = min(options)
    if start not in best:
        _raise_missing(model, num_layers, servers, start, end)
    return _walk(best, by_start, start, end, rng)


def cost(server: Server) -> float:
    """A hop's expected share of a token's time: its time per decode round (measured;
    before the first one, the inverse of its start-up throughput) times the work ahead of a
    new session (every session it holds and every job waiting for its compute thread, plus
    the new one), plus its round trip from the entry (ADR-0035)."""
    base_s = server.step_s if server.step_s > 0 else 1 / max(server.throughput, 1e-9)
    return base_s * (1 + server.sessions + server.queue_depth) + server.rtt_s


def link_rtt_s(
    origin: str, origin_rtt_ms: Mapping[str, float], node: str, node_rtt_ms: Mapping[str, float]
) -> float:
    """The round trip (s) between `origin` and `node` from what each measured (ms by peer,
    `tracker` included): the origin's own measurement, else the node's, else the way
    through the tracker (an upper bound), else 0 (unknown)."""
    for measured in (origin_rtt_ms.get(node), node_rtt_ms.get(origin)):
        if measured is not None:
            return measured / 1000
    via = (origin_rtt_ms.get(TRACKER), node_rtt_ms.get(TRACKER))
    return (via[0] + via[1]) / 1000 if via[0] is not None and via[1] is not None else 0.0


def _walk(
    best: dict[int, tuple[int, float]],
    by_start: dict[int, list[Server]],
    start: int,
    num_layers: int,
    rng: random.Random,
) -> list[Server]:
    hops, position = [], start
    while position < num_layers:
        hops_left = best[position][0]
        candidates = [
            s
            for s in by_start[position]
            if s.span.end in best and best[s.span.end][0] == hops_left - 1
        ]
        cheapest = min(cost(s) + best[s.span.end][1] for s in candidates)
        ties = [s for s in candidates if cost(s) + best[s.span.end][1] <= cheapest * 1.000001]
        choice = ties[rng.randrange(len(ties))]
        hops.append(choice)
        position = choice.span.end
    return hops


def _raise_missing(
    model: ModelId, num_layers: int, servers: Sequence[Server], start: int, end: int
) -> None:
    missing = [
        LayerSpan(max(g.start, start), min(g.end, end))
        for g in gaps(num_layers, [(s.span, s.throughput) for s in servers])
        if g.end > start and g.start < end
    ]
    if missing:
        text = ", ".join(str(g) for g in missing)
        raise MissingLayersError(
            f"no node serves layers {text} of {model}", missing=[(g.start, g.end) for g in missing]
        )
    raise RouteError(
        f"every layer of {model} is served, but no chain of spans starts at "
        f"layer {start} and ends at layer {end}"
    )

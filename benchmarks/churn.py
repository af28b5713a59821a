"""Churn: the tracker's real planner against nodes that come and go, on a simulated clock.

    python benchmarks/churn.py            # 50, 100, 1,000 nodes for 6 h; 10,000 for 1 h
    python benchmarks/churn.py --tiny     # 60 nodes for 3 h (what the tests run)

No processes and no weights: nodes are budgets. Budgets are drawn from GPUs of 4-80 GB plus
small CPU nodes (1-3 GB), each with a quantization (nf4, int8, bf16). The tracker offers seven
Llama shapes (1B to 405B class, 533 GB together at int8) at their real per-layer bytes, so
the mesh size sets how much budget there is per model byte: about 1.5x at 50 nodes, 3x at
100, 30x at 1,000. Lifetimes are log-normal (median 1 h, some days), joins
a Poisson stream that keeps the population steady. Every `--tick` simulated seconds the
tracker plans once over what changed (as its planning share batches work), deaths are seen
at once (the dead-node check takes about one heartbeat), and a LOAD takes its bytes over
`--load-mb-s`. The same event stream runs through today's planner and through the planner
before issue #18 (`baseline_planner.py`), and the table gives, per planner: the share of
time each model is routable (a chain of loaded spans from layer 0 to the last), the mean
time a model stayed unroutable once it had been routable, directives per node-hour, and the
budget in use. Measured after a warm-up in which every model first becomes routable.
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

from meshnet.models.sizing import layer_bytes
from meshnet.models.spec import ModelSpec
from meshnet.tracker.layout import Directive, Holding, ModelOffer, NodeView, first_break
from meshnet.tracker.planner import plan
from meshnet.types import CONVERSIONS, LayerSpan, ModelId, NodeId

sys.path.insert(0, str(Path(__file__).parent))
from baseline_planner import baseline_plan  # noqa: E402
from planner import SHAPES  # noqa: E402

GB = 10**9
HOUR_S = 3600.0
Planner = Callable[[Sequence[ModelOffer], Sequence[NodeView]], list[Directive]]


@dataclass
class SimNode:
    view: NodeView
    dies_at_s: float
    joins_at_s: float = 0.0
    loading: dict[tuple[ModelId, LayerSpan], float] = field(default_factory=dict)  # -> done at


@dataclass
class Tally:
    routable_s: dict[ModelId, float] = field(default_factory=dict)
    outages: list[float] = field(default_factory=list)  # seconds unroutable, per outage
    directives: int = 0
    node_s: float = 0.0
    used: list[float] = field(default_factory=list)  # budget share in use, per tick
    plan_s: list[float] = field(default_factory=list)
    load_s: list[float] = field(default_factory=list)  # each LOAD's duration


def shape_offer(index: int) -> ModelOffer:
    name, layers, hidden, heads, kv, inter = SHAPES[index % len(SHAPES)]
    spec = ModelSpec("llama", layers, hidden, heads, kv, inter, 128256, False, 8192)
    per_layer: dict[str, int] = {q: layer_bytes(spec, q) for q in CONVERSIONS}
    return ModelOffer(ModelId(f"{name}-{index}"), layers, per_layer)


def draw_node(rng: random.Random, index: int, now_s: float) -> SimNode:
    """A node joining at `now_s`."""
    if rng.random() < 0.3:  # a small CPU node
        budget, quant = rng.choice([1, 2, 3]) * GB, "nf4"
    else:
        budget, quant = rng.choice([4, 8, 12, 16, 24, 48, 80]) * GB, rng.choice(CONVERSIONS[1:])
    view = NodeView(NodeId(f"n{index:06d}"), budget, quant, rng.uniform(0.5, 4.0))
    return SimNode(view, now_s + lifetime_s(rng), now_s)


def lifetime_s(rng: random.Random) -> float:
    """Log-normal: median 1 h, one in ~20 beyond a day."""
    return HOUR_S * math.exp(rng.gauss(0.0, 1.9))


MODELS = [shape_offer(i) for i in range(len(SHAPES))]


def ratio(nodes: list[SimNode]) -> float:
    """The nodes' budget over the models' bytes at int8."""
    total = sum(o.num_layers * o.layer_bytes["int8"] for o in MODELS)
    return sum(n.view.budget_bytes for n in nodes) / total


@dataclass(frozen=True)
class Setup:
    nodes: int
    hours: float
    tick_s: float
    load_bytes_s: float
    seed: int = 0


def events(setup: Setup) -> tuple[list[SimNode], list[SimNode]]:
    """(the nodes there at the start, the joiners in order): the same for both planners."""
    rng = random.Random(setup.seed)
    first = [draw_node(rng, i, 0.0) for i in range(setup.nodes)]
    rate_s = setup.nodes / (HOUR_S * math.exp(1.9**2 / 2))  # joins per second: mean lifetime
    joiners: list[SimNode] = []
    t = 0.0
    while t < setup.hours * HOUR_S:
        t += rng.expovariate(rate_s)
        joiners.append(draw_node(rng, setup.nodes + len(joiners), t))
    return first, joiners


def simulate(setup: Setup, planner: Planner) -> Tally:
    first, joiners = events(setup)
    models = MODELS
    live = {n.view.node_id: SimNode(n.view, n.dies_at_s) for n in first}
    pending = list(joiners)
    tally, warm = Tally(), False
    down_since: dict[ModelId, float | None] = {m.model: None for m in models}
    now = 0.0
    while now < setup.hours * HOUR_S:
        now += setup.tick_s
        while pending and pending[0].joins_at_s <= now:
            node = pending.pop(0)
            live[node.view.node_id] = SimNode(node.view, node.dies_at_s)
        for node_id in [n for n, s in live.items() if s.dies_at_s <= now]:
            del live[node_id]
        _finish_loads(live, now)
        started = time.perf_counter()
        directives = planner(models, [s.view for s in live.values()])
        tally.plan_s.append(time.perf_counter() - started)
        tally.load_s += _apply(live, models, directives, now, setup.load_bytes_s)
        routable = {m.model: _routable(m, live) for m in models}
        warm = warm or all(routable.values())
        if not warm:
            continue
        _count(tally, live, models, routable, down_since, now, setup.tick_s, len(directives))
    return tally


def _finish_loads(live: dict[NodeId, SimNode], now: float) -> None:
    for node in live.values():
        done = [key for key, at in node.loading.items() if at <= now]
        if done:
            holdings = tuple(
                Holding(h.model, h.span, True) if (h.model, h.span) in done else h
                for h in node.view.holdings
            )
            node.view = replace(node.view, holdings=holdings)
            for key in done:
                del node.loading[key]


def _apply(
    live: dict[NodeId, SimNode],
    models: list[ModelOffer],
    directives: list[Directive],
    now: float,
    load_bytes_s: float,
) -> list[float]:
    """Carry out `directives`; the seconds each LOAD will take."""
    per_layer, loads = {m.model: m.layer_bytes for m in models}, []
    for d in directives:
        node = live[d.node_id]
        key = (d.model, d.span)
        if d.op == "DROP_SHARD":
            kept = tuple(h for h in node.view.holdings if (h.model, h.span) != key)
            node.view = replace(node.view, holdings=kept)
            node.loading.pop(key, None)
        else:
            node.view = replace(node.view, holdings=(*node.view.holdings, Holding(*key, False)))
            size = len(d.span) * per_layer[d.model][node.view.quant]
            loads.append(size / load_bytes_s)
            node.loading[key] = now + loads[-1]
    return loads


def _routable(offer: ModelOffer, live: dict[NodeId, SimNode]) -> bool:
    spans = [
        h.span
        for n in live.values()
        for h in n.view.holdings
        if h.model == offer.model and h.loaded
    ]
    return first_break(offer.num_layers, spans) is None


def _count(
    tally: Tally,
    live: dict[NodeId, SimNode],
    models: list[ModelOffer],
    routable: dict[ModelId, bool],
    down_since: dict[ModelId, float | None],
    now: float,
    tick_s: float,
    directives: int,
) -> None:
    per_layer = {m.model: m.layer_bytes for m in models}
    for model, up in routable.items():
        tally.routable_s[model] = tally.routable_s.get(model, 0.0) + (tick_s if up else 0.0)
        since = down_since[model]
        if not up and since is None:
            down_since[model] = now
        elif up and since is not None:
            tally.outages.append(now - since)
            down_since[model] = None
    tally.directives += directives
    tally.node_s += tick_s * len(live)
    budget = sum(n.view.budget_bytes for n in live.values())
    used = sum(
        len(h.span) * per_layer[h.model][n.view.quant]
        for n in live.values()
        for h in n.view.holdings
        if h.model in per_layer
    )
    tally.used.append(used / budget if budget else 0.0)


def row(name: str, setup: Setup, tally: Tally, measured_s: float, budget: float) -> str:
    shares = [s / measured_s for s in tally.routable_s.values()] if measured_s > 0 else [0.0]
    outage = statistics.mean(tally.outages) if tally.outages else 0.0
    per_node_hour = tally.directives / (tally.node_s / HOUR_S) if tally.node_s else 0.0
    used = statistics.mean(tally.used) if tally.used else 0.0
    return (
        f"| {setup.nodes:,} | {name} | {budget:.1f} | {statistics.mean(shares):.3%} | "
        f"{min(shares):.3%} | "
        f"{len(tally.outages)} | {outage:.0f} | {statistics.median(tally.load_s):.0f} | "
        f"{per_node_hour:.2f} | {used:.1%} | "
        f"{statistics.median(tally.plan_s) * 1e3:.0f} |"
    )


def load_time_s(load_bytes_s: float) -> float:
    """A typical span load: 10 layers of a 70B-class model at int8."""
    return 10 * shape_offer(5).layer_bytes["int8"] / load_bytes_s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--tick", type=float, default=10.0, help="simulated seconds a plan")
    parser.add_argument("--load-mb-s", type=float, default=200.0)
    args = parser.parse_args()
    load = args.load_mb_s * 1e6
    sizes = [(60, 3.0)] if args.tiny else [(50, 6.0), (100, 6.0), (1_000, 6.0), (10_000, 1.0)]
    print(
        "| nodes | planner | budget / models | routable (mean of models) | routable (worst "
        "model) | outages | mean outage s | median load s | directives per node-hour | "
        "budget in use | median plan ms |"
    )
    print("|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for count, hours in sizes:
        tick = args.tick if count < 5_000 else max(args.tick, 60.0)
        setup = Setup(count, hours, tick, load)
        budget = ratio(events(setup)[0])
        for name, planner in (("today", plan), ("before #18", baseline_plan)):
            tally = simulate(setup, planner)
            measured = len(tally.used) * setup.tick_s
            print(row(name, setup, tally, measured, budget), flush=True)
    print(f"\none span load (10 layers of a 70B-class model at int8): {load_time_s(load):.0f} s")


if __name__ == "__main__":
    main()

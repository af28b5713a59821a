"""Planner cost at scale: simulated nodes, real per-layer sizes, no weights.

    python benchmarks/planner.py          # 10,000 nodes, 20 models
    python benchmarks/planner.py --tiny   # 200 nodes, 4 models (what the tests run)

Models: Llama-shaped configs from 1B to 405B class (80 and 126 layers among them) with their
real per-layer bytes at nf4/int8/bf16 from `models.sizing`. Nodes: budgets from 4 to 80 GB,
mixed quantizations. Reports the full plan's time, one join and one leave event against the
planned state, budget use and route hop counts. Medians of `--repeat` runs.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Callable

from meshnet.models.sizing import layer_bytes
from meshnet.models.spec import ModelSpec
from meshnet.tracker.planner import ModelOffer, NodeView, plan, with_directives
from meshnet.tracker.routing import Server, choose_route
from meshnet.types import QUANTS, ModelId, NodeId

GB = 10**9
# (name, layers, hidden, heads, kv heads, intermediate): public Llama-family shapes
SHAPES = [
    ("1b", 16, 2048, 32, 8, 8192),
    ("3b", 28, 3072, 24, 8, 8192),
    ("8b", 32, 4096, 32, 8, 14336),
    ("14b", 48, 5120, 40, 8, 13824),
    ("32b", 64, 5120, 40, 8, 27648),
    ("70b", 80, 8192, 64, 8, 28672),
    ("405b", 126, 16384, 128, 8, 53248),
]


def offers(count: int) -> list[ModelOffer]:
    out = []
    for i in range(count):
        name, layers, hidden, heads, kv, inter = SHAPES[i % len(SHAPES)]
        spec = ModelSpec("llama", layers, hidden, heads, kv, inter, 128256, False, 8192)
        out.append(
            ModelOffer(ModelId(f"{name}-{i}"), layers, {q: layer_bytes(spec, q) for q in QUANTS})
        )
    return out


def nodes(count: int, rng: random.Random) -> list[NodeView]:
    return [
        NodeView(
            NodeId(f"n{i:05d}"),
            rng.choice([4, 8, 16, 24, 48, 80]) * GB,
            rng.choice(["nf4", "int8", "bf16"]),
            rng.uniform(0.5, 4.0),
        )
        for i in range(count)
    ]


def median_s(fn: Callable[[], object], repeat: int) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    n_nodes, n_models, repeat = (200, 4, 1) if args.tiny else (10_000, 20, args.repeat)
    rng = random.Random(0)
    models, views = offers(n_models), nodes(n_nodes, rng)
    full_s = median_s(lambda: plan(models, views), repeat)
    state = with_directives(views, plan(models, views))
    newcomer = NodeView(NodeId("zz-new"), 24 * GB, "nf4", 1.0)
    join_s = median_s(lambda: plan(models, [*state, newcomer]), repeat)
    leaver = next(v for v in state if v.holdings)
    rest = [v for v in state if v is not leaver]
    leave_s = median_s(lambda: plan(models, rest), repeat)
    by_model = {m.model: m for m in models}
    used = sum(
        len(h.span) * by_model[h.model].layer_bytes[v.quant] for v in state for h in v.holdings
    )
    hops = []
    for m in models:
        servers = [
            Server(v.node_id, "", h.span, v.throughput, 0)
            for v in state
            for h in v.holdings
            if h.model == m.model
        ]
        hops.append(len(choose_route(m.model, m.num_layers, servers, 0, random.Random(0))))
    print(
        "| nodes | models | full plan ms | join ms | leave ms | budget used | "
        "route hops (min / median / max) |"
    )
    print("|---:|---:|---:|---:|---:|---:|---|")
    print(
        f"| {n_nodes:,} | {n_models} | {full_s * 1e3:.0f} | {join_s * 1e3:.0f} | "
        f"{leave_s * 1e3:.0f} | {used / sum(v.budget_bytes for v in views):.1%} | "
        f"{min(hops)} / {statistics.median(hops):g} / {max(hops)} |"
    )


if __name__ == "__main__":
    main()

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

from harness import median_s  # benchmarks/harness.py
from meshnet.models.sizing import layer_bytes
from meshnet.models.spec import ModelSpec
from meshnet.tracker.messages import HeartbeatRequest, ShardRef
from meshnet.tracker.planner import ModelOffer, NodeView, plan, with_directives
from meshnet.tracker.registry import Registry
from meshnet.tracker.routing import Server, choose_route
from meshnet.types import CONVERSIONS, LayerSpan, ModelId, NodeId

GB = 10**9
JSON = {"Content-Type": "application/json"}
MAX_ROUNDS = 40  # plans carried out one after another until one plans nothing
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
            ModelOffer(
                ModelId(f"{name}-{i}"), layers, {q: layer_bytes(spec, q) for q in CONVERSIONS}
            )
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


def budget_use(models: list[ModelOffer], state: list[NodeView], views: list[NodeView]) -> float:
    by_model = {m.model: m for m in models}
    used = sum(
        len(h.span) * by_model[h.model].layer_bytes[v.quant] for v in state for h in v.holdings
    )
    return used / sum(v.budget_bytes for v in views)


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
    first_use = budget_use(models, state, views)
    rounds = 1
    while rounds < MAX_ROUNDS and (directives := plan(models, state)):
        state, rounds = with_directives(state, directives), rounds + 1
    newcomer = NodeView(NodeId("zz-new"), 24 * GB, "nf4", 1.0)
    join_s = median_s(lambda: plan(models, [*state, newcomer]), repeat)
    leaver = next(v for v in state if v.holdings)
    rest = [v for v in state if v is not leaver]
    leave_s = median_s(lambda: plan(models, rest), repeat)
    used = budget_use(models, state, views)
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
        "| nodes | models | full plan ms | join ms | leave ms | budget used after one plan | "
        "plans to settle | budget used settled | route hops (min / median / max) |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    print(
        f"| {n_nodes:,} | {n_models} | {full_s * 1e3:.1f} | {join_s * 1e3:.1f} | "
        f"{leave_s * 1e3:.1f} | {first_use:.1%} | {rounds} | {used:.1%} | "
        f"{min(hops)} / {statistics.median(hops):g} / {max(hops)} |"
    )
    print_heartbeats([200] if args.tiny else [2_000, 10_000], 100 if args.tiny else 1_000)


def heartbeat_costs(count: int, beats: int) -> tuple[float, float]:
    """(registry only, the tracker's whole app) seconds of a heartbeat that changes nothing,
    with `count` nodes registered and their plan carried out. The app figure runs the
    tracker's ASGI app in-process (routing, validation, the access guard with a swarm key,
    JSON both ways; no sockets, no uvicorn), less the client's share measured against an app
    that only answers."""
    import asyncio

    import httpx

    from meshnet.config import AccessConfig, TrackerConfig
    from meshnet.security.signing import Signer
    from meshnet.tracker import messages as msg
    from meshnet.tracker.app import create_app
    from meshnet.tracker.probe import TrustingProber

    models = offers(4)
    views = nodes(count, random.Random(1))
    state = with_directives(views, plan(models, views))
    now = [0.0]  # seconds; moved only while settling, frozen while beats are timed
    registry = Registry(
        models,
        {m.model: m.model for m in models},
        dead_after_s=6.0,
        clock=lambda: now[0],
        max_per_address=count,
    )
    for v in state:
        refs = [msg.ShardRef(model=h.model, span=h.span) for h in v.holdings]
        registry.register(
            msg.RegisterRequest(
                node_id=v.node_id,
                address=f"http://10.0.{len(registry.nodes) // 250}.1:1",
                budget_bytes=v.budget_bytes,
                quant=v.quant,
                throughput=v.throughput,
                loaded=refs,
            )
        )
    beats_of = settle(
        registry, now, {v.node_id: {(h.model, h.span) for h in v.holdings} for v in state}
    )
    plans = registry.plans
    direct = median_s(lambda: [registry.heartbeat(b) for b in beats_of[:beats]], 3) / beats
    assert registry.plans == plans, "a no-op heartbeat planned"
    key = "k" * 32
    app = create_app(
        registry, TrackerConfig(), prober=TrustingProber(), access=AccessConfig(swarm_key=key)
    )

    async def over_http(target: object) -> float:
        transport = httpx.ASGITransport(app=target)  # type: ignore[arg-type]
        auth = Signer(key).auth("tracker", answers=False)  # the bare app signs nothing
        async with httpx.AsyncClient(transport=transport, base_url="http://t", auth=auth) as c:
            bodies = [b.model_dump_json() for b in beats_of[:beats]]
            start = time.perf_counter()
            for body in bodies:
                r = await c.post("/v1/nodes/heartbeat", content=body, headers=JSON)
                assert r.status_code == 200, r.text
            return (time.perf_counter() - start) / len(bodies)

    # the client's own share: the same signed calls against an app that only answers
    client_s = min(asyncio.run(over_http(_answering_app())) for _ in range(3))
    http_s = min(asyncio.run(over_http(app)) for _ in range(3))
    return direct, max(http_s - client_s, 0.0)


def settle(
    registry: Registry, now: list[float], held: dict[NodeId, set[tuple[ModelId, LayerSpan]]]
) -> list[HeartbeatRequest]:
    """Beat every node, each reporting what it was told to load or drop, until a round of
    beats brings no directive: the heartbeats timed after this change nothing. Each round
    moves the clock a second, past any plan the registry deferred (a plan slower than
    `QUICK_PLAN_S` waits; a frozen clock would hide the directives it would give)."""
    registry.replan()
    for _ in range(MAX_ROUNDS):
        beats = [
            HeartbeatRequest(
                node_id=node,
                loaded=[ShardRef(model=model, span=span) for model, span in sorted(spans)],
            )
            for node, spans in held.items()
        ]
        plans, now[0] = registry.plans, now[0] + 1.0
        told = [(b.node_id, d) for b in beats for d in registry.heartbeat(b)]
        for node, d in told:
            spans = held[NodeId(node)]
            (spans.add if d.op == "LOAD_SHARD" else spans.discard)((d.model, d.span))
        if not told and registry.plans == plans:
            return beats
    raise RuntimeError(f"the registry did not settle in {MAX_ROUNDS} rounds of heartbeats")


def _answering_app() -> object:
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    async def answer(request: object) -> JSONResponse:
        await request.body()  # type: ignore[attr-defined]
        return JSONResponse({"directives": []})

    return Starlette(routes=[Route("/v1/nodes/heartbeat", answer, methods=["POST"])])


def print_heartbeats(sizes: list[int], beats: int) -> None:
    from meshnet.tracker.beats import BEATS_PER_S, beat_interval_s

    print(
        "\n| nodes | no-op heartbeat, registry only (us) | the tracker's app, server side (us) "
        "| one core busy at a beat every 2 s | interval the tracker sets (s) | busy at it |"
    )
    print("|---:|---:|---:|---:|---:|---:|")
    for count in sizes:
        direct_s, http_s = heartbeat_costs(count, beats)
        interval_s = beat_interval_s(count, 2.0, BEATS_PER_S)
        print(
            f"| {count:,} | {direct_s * 1e6:.0f} | {http_s * 1e6:.0f} | "
            f"{count / 2.0 * http_s:.0%} | {interval_s:g} | {count / interval_s * http_s:.0%} |"
        )


if __name__ == "__main__":
    main()

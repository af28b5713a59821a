"""One process's Prometheus metrics (text format at `GET /metrics`).

Each app gets its own `Metrics` (a private `CollectorRegistry`), so many apps can live in one
test process and a tracker-as-node reports its tracker and node parts together. Counters and
histograms are updated where the work happens; gauges that merely read state (sessions, KV
bytes, coverage) are filled by `on_scrape` callbacks just before each scrape.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from starlette.requests import Request
from starlette.responses import Response

log = logging.getLogger(__name__)
# `*_created` timestamps double the output and say little here
disable_created_metrics()  # type: ignore[no-untyped-call]
# /forward handling on a CPU: ~1 ms for a decode step, up to seconds for a prefill chunk
FORWARD_BUCKETS_S = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 10)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64)  # rows of one batched decode step


Kind = type[Counter] | type[Gauge] | type[Histogram]


@dataclass(frozen=True)
class Family:
    """One metric family: the `Metrics` attribute it is, its kind, name, help and labels."""

    attribute: str
    kind: Kind
    name: str
    help: str
    labels: tuple[str, ...] = ()
    buckets: tuple[float, ...] | None = None  # a histogram's


G, C, H = Gauge, Counter, Histogram
FAMILIES = (
    Family("sessions_active", G, "meshnet_sessions_active",
           "Sessions holding a KV cache in this process"),
    Family("compute_threads", G, "meshnet_compute_threads",
           "Threads this process computes with (they follow the cores others leave free)"),
    Family("other_cores_busy", G, "meshnet_other_cores_busy",
           "Cores other processes kept busy while this one computed (last measured window)"),
    Family("kv_cache_bytes", G, "meshnet_kv_cache_bytes",
           "Bytes held by KV caches in this process"),
    # kept prefixes (ADR-0058): sampled from the shards at each scrape
    Family("prefix_hits", G, "meshnet_prefix_hits",
           "New sessions that started as a copy of another's first tokens: a kept prefix, a "
           "prompt being answered, another answer's prompt (since start)"),
    Family("prefix_tokens_reused", G, "meshnet_prefix_tokens_reused",
           "Tokens those sessions took from kept prefixes instead of computing (since start)"),
    Family("prefix_cache_sessions", G, "meshnet_prefix_cache_sessions",
           "Kept prefixes held in this process"),
    Family("prefix_cache_bytes", G, "meshnet_prefix_cache_bytes",
           "KV cache bytes held by kept prefixes"),
    Family("forward_seconds", H, "meshnet_forward_seconds",
           "Time to handle one POST /forward, decode to encode", ("model",), FORWARD_BUCKETS_S),
    Family("decode_batch_rows", H, "meshnet_decode_batch_rows",
           "Sessions whose decode step ran in one pass of the compute thread", (), BATCH_BUCKETS),
    Family("tokens_generated", C, "meshnet_tokens_generated", "Tokens sampled by this entry node",
           ("model",)),
    Family("draft_tokens", C, "meshnet_draft_tokens", "Draft tokens this entry verified (ADR-0038)",
           ("model",)),
    Family("accepted_tokens", C, "meshnet_accepted_tokens", "Draft tokens that stood", ("model",)),
    Family("bytes_sent", C, "meshnet_bytes_sent", "Activation-frame bytes sent", ("encoding",)),
    Family("bytes_received", C, "meshnet_bytes_received", "Activation-frame bytes received",
           ("encoding",)),
    Family("link_mbit_s", G, "meshnet_link_mbit_per_second",
           "Measured rate of the link to a peer frames go to (ADR-0037)", ("peer",)),
    Family("weights_served", C, "meshnet_weights_served_bytes",
           "Weight bytes this process served to other members (ADR-0054)"),
    Family("weights_fetched", C, "meshnet_weights_fetched_bytes",
           "Checked weight bytes this process fetched, by the member that sent them", ("peer",)),
    Family("degraded_routes", C, "meshnet_degraded_routes",
           "Routes this entry made among the members it last saw: the tracker was unreachable"),
    Family("failovers", C, "meshnet_failovers", "Hops replaced mid-session by this entry node"),
    Family("spot_checks", C, "meshnet_spot_checks",
           "Hop answers re-run on another copy, by result (match, mismatch, no_copy, skipped)",
           ("result",)),
    Family("spot_check_bans", C, "meshnet_spot_check_bans",
           "Nodes banned by this entry's spot checks"),
    Family("directives", C, "meshnet_directives", "Rebalance directives issued by this tracker",
           ("op",)),
    Family("planning", G, "meshnet_planning",
           "1 while this tracker plans (holds the lease), else 0"),
    Family("planner_terms", C, "meshnet_planner_terms",
           "Leases this tracker won as a new planner"),
    Family("lease_failures", C, "meshnet_lease_failures",
           "Lease rounds that failed on this tracker (logged; the next round goes on)"),
    Family("weights_refused", C, "meshnet_weights_refused",
           "Weights answers this node refused or gave up on, by why (encoded, too_long, "
           "deadline, stalled, hash, busy)", ("why",)),
    Family("layers_covered", G, "meshnet_layers_covered", "Layers served by a live node",
           ("model",)),
    Family("errors", C, "meshnet_errors", "Requests answered with an error, by error type",
           ("error",)),
    Family("requests", C, "meshnet_requests", "API generations ended, by outcome",
           ("model", "outcome")),
)  # fmt: skip


class Metrics:
    """The metric families every meshnet process exports (`FAMILIES`: their names are part of
    our interface), each an attribute of the same name as its entry."""

    sessions_active: Gauge
    compute_threads: Gauge
    other_cores_busy: Gauge
    kv_cache_bytes: Gauge
    prefix_hits: Gauge
    prefix_tokens_reused: Gauge
    prefix_cache_sessions: Gauge
    prefix_cache_bytes: Gauge
    forward_seconds: Histogram
    decode_batch_rows: Histogram
    tokens_generated: Counter
    draft_tokens: Counter
    accepted_tokens: Counter
    bytes_sent: Counter
    bytes_received: Counter
    link_mbit_s: Gauge
    weights_served: Counter
    weights_fetched: Counter
    degraded_routes: Counter
    failovers: Counter
    spot_checks: Counter
    spot_check_bans: Counter
    directives: Counter
    planning: Gauge
    planner_terms: Counter
    lease_failures: Counter
    weights_refused: Counter
    layers_covered: Gauge
    errors: Counter
    requests: Counter

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        for family in FAMILIES:
            setattr(self, family.attribute, _made(family, self.registry))
        self._scrape_hooks: list[Callable[[], None]] = []

    def on_scrape(self, hook: Callable[[], None]) -> None:
        """Run `hook` before every scrape (it sets gauges that read live state)."""
        self._scrape_hooks.append(hook)

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric, gauges refreshed first."""
        for hook in self._scrape_hooks:
            hook()
        return generate_latest(self.registry)

    async def endpoint(self, _: Request) -> Response:
        """`GET /metrics`."""
        return Response(self.render(), media_type=CONTENT_TYPE_LATEST)


def _made(family: Family, registry: CollectorRegistry) -> Counter | Gauge | Histogram:
    """The prometheus collector `family` describes, in `registry`."""
    if family.kind is Histogram:
        buckets = family.buckets or Histogram.DEFAULT_BUCKETS
        return Histogram(
            family.name, family.help, family.labels, buckets=buckets, registry=registry
        )
    kind: type[Counter] | type[Gauge] = Gauge if family.kind is Gauge else Counter
    return kind(family.name, family.help, family.labels, registry=registry)

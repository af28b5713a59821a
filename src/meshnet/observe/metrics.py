"""One process's Prometheus metrics (text format at `GET /metrics`).

Each app gets its own `Metrics` (a private `CollectorRegistry`), so many apps can live in one
test process and a tracker-as-node reports its tracker and node parts together. Counters and
histograms are updated where the work happens; gauges that merely read state (sessions, KV
bytes, coverage) are filled by `on_scrape` callbacks just before each scrape.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

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


class Metrics:
    """The metric families every meshnet process exports (names are part of our interface)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.sessions_active = Gauge(
            "meshnet_sessions_active", "Sessions holding a KV cache in this process", registry=r
        )
        self.compute_threads = Gauge(
            "meshnet_compute_threads",
            "Threads this process computes with (they follow the cores others leave free)",
            registry=r,
        )
        self.other_cores_busy = Gauge(
            "meshnet_other_cores_busy",
            "Cores other processes kept busy while this one computed (last measured window)",
            registry=r,
        )
        self.kv_cache_bytes = Gauge(
            "meshnet_kv_cache_bytes", "Bytes held by KV caches in this process", registry=r
        )
        # kept prefixes (ADR-0058): sampled from the shards at each scrape
        self.prefix_hits = Gauge(
            "meshnet_prefix_hits",
            "New sessions that started as a copy of another's first tokens: a kept prefix, a "
            "prompt being answered, another answer's prompt (since start)",
            registry=r,
        )
        self.prefix_tokens_reused = Gauge(
            "meshnet_prefix_tokens_reused",
            "Tokens those sessions took from kept prefixes instead of computing (since start)",
            registry=r,
        )
        self.prefix_cache_sessions = Gauge(
            "meshnet_prefix_cache_sessions", "Kept prefixes held in this process", registry=r
        )
        self.prefix_cache_bytes = Gauge(
            "meshnet_prefix_cache_bytes", "KV cache bytes held by kept prefixes", registry=r
        )
        self.forward_seconds = Histogram(
            "meshnet_forward_seconds",
            "Time to handle one POST /forward, decode to encode",
            ["model"],
            buckets=FORWARD_BUCKETS_S,
            registry=r,
        )
        self.decode_batch_rows = Histogram(
            "meshnet_decode_batch_rows",
            "Sessions whose decode step ran in one pass of the compute thread",
            buckets=BATCH_BUCKETS,
            registry=r,
        )
        self.tokens_generated = Counter(
            "meshnet_tokens_generated", "Tokens sampled by this entry node", ["model"], registry=r
        )
        self.draft_tokens = Counter(
            "meshnet_draft_tokens",
            "Draft tokens this entry verified (ADR-0038)",
            ["model"],
            registry=r,
        )
        self.accepted_tokens = Counter(
            "meshnet_accepted_tokens", "Draft tokens that stood", ["model"], registry=r
        )
        self.bytes_sent = Counter(
            "meshnet_bytes_sent", "Activation-frame bytes sent", ["encoding"], registry=r
        )
        self.bytes_received = Counter(
            "meshnet_bytes_received", "Activation-frame bytes received", ["encoding"], registry=r
        )
        self.link_mbit_s = Gauge(
            "meshnet_link_mbit_per_second",
            "Measured rate of the link to a peer frames go to (ADR-0037)",
            ["peer"],
            registry=r,
        )
        self.weights_served = Counter(
            "meshnet_weights_served_bytes",
            "Weight bytes this process served to other members (ADR-0054)",
            registry=r,
        )
        self.weights_fetched = Counter(
            "meshnet_weights_fetched_bytes",
            "Checked weight bytes this process fetched, by the member that sent them",
            ["peer"],
            registry=r,
        )
        self.degraded_routes = Counter(
            "meshnet_degraded_routes",
            "Routes this entry made among the members it last saw: the tracker was unreachable",
            registry=r,
        )
        self.failovers = Counter(
            "meshnet_failovers", "Hops replaced mid-session by this entry node", registry=r
        )
        self.spot_checks = Counter(
            "meshnet_spot_checks",
            "Hop answers re-run on another copy, by result (match, mismatch, no_copy, skipped)",
            ["result"],
            registry=r,
        )
        self.spot_check_bans = Counter(
            "meshnet_spot_check_bans", "Nodes banned by this entry's spot checks", registry=r
        )
        self.directives = Counter(
            "meshnet_directives", "Rebalance directives issued by this tracker", ["op"], registry=r
        )
        self.planning = Gauge(
            "meshnet_planning", "1 while this tracker plans (holds the lease), else 0", registry=r
        )
        self.planner_terms = Counter(
            "meshnet_planner_terms", "Leases this tracker won as a new planner", registry=r
        )
        self.lease_failures = Counter(
            "meshnet_lease_failures",
            "Lease rounds that failed on this tracker (logged; the next round goes on)",
            registry=r,
        )
        self.weights_refused = Counter(
            "meshnet_weights_refused",
            "Weights answers this node refused or gave up on, by why (encoded, too_long, "
            "deadline, stalled, hash, busy)",
            ["why"],
            registry=r,
        )
        self.layers_covered = Gauge(
            "meshnet_layers_covered", "Layers served by a live node", ["model"], registry=r
        )
        self.errors = Counter(
            "meshnet_errors",
            "Requests answered with an error, by error type",
            ["error"],
            registry=r,
        )
        self.requests = Counter(
            "meshnet_requests",
            "API generations ended, by outcome",
            ["model", "outcome"],
            registry=r,
        )
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

"""What the tracker knows of one node: its registration, holdings, load and reports."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from meshnet.tracker import messages as msg
from meshnet.tracker.membership import Key
from meshnet.tracker.planner import Directive, Holding, NodeView
from meshnet.tracker.reports import Reports
from meshnet.types import ModelId, NodeId


@dataclass
class NodeRecord:
    request: msg.RegisterRequest
    last_seen_s: float
    loaded: set[Key] = field(default_factory=set)
    assigned: set[Key] = field(default_factory=set)  # told to load, not yet reported loaded
    failed: set[Key] = field(default_factory=set)
    pending: list[Directive] = field(default_factory=list)  # not yet delivered
    sessions: int = 0
    queue_depth: int = 0  # jobs waiting for its compute thread at its last heartbeat
    step_s: float = 0.0  # its median decode round (seconds); 0 until it has run one
    threads: int = 0  # compute threads it said it uses (0: not said)
    rtt_ms: dict[str, float] = field(default_factory=dict)  # round trips it measured, by peer
    # who reported it failing, until when: out of their routes (or all: `Reports`),
    # heartbeats or not (a node that fails frames may well go on beating)
    reports: Reports = field(default_factory=Reports)
    token: bytes | None = None  # SHA-256 of its membership token; None: registered in-process
    pinned: set[Key] = field(default_factory=set)  # the spans it registered with
    checked_s: float = 0.0  # when the tracker last checked that it still listens
    dropping: set[Key] = field(default_factory=set)  # told to drop, still reported
    peer: str = ""  # the address it registered from (for the per-address cap)
    refused: set[ModelId] = field(default_factory=set)  # its copy differs from the offered one
    fetching: list[msg.FetchState] = field(default_factory=list)  # at its last heartbeat
    weights: frozenset[str] = frozenset()  # digests of models it holds parts of
    # spans this tracker told it to load and it then reported loaded: the only ones it is
    # named a weights holder for (what it registered with is a claim: review W1)
    earned: set[Key] = field(default_factory=set)

    def view(self, by_digest: Mapping[str, ModelId] | None = None) -> NodeView:
        holdings = tuple(Holding(m, s, True) for m, s in sorted(self.loaded)) + tuple(
            Holding(m, s, False) for m, s in sorted(self.assigned - self.loaded)
        )
        r = self.request
        return NodeView(
            NodeId(r.node_id),
            r.budget_bytes - r.kv_reserve_bytes,
            r.quant,
            r.throughput,
            holdings,
            frozenset(ModelId(m) for m in r.models) if r.models else None,
            frozenset(self.failed),
            entry=r.entry,
            keeps_entry=r.keeps_entry,
            sessions=self.sessions,
            refused=frozenset(self.refused),
            weights=frozenset(by_digest[d] for d in self.weights if by_digest and d in by_digest),
        )

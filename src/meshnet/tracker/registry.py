"""The tracker's state: node records, heartbeat expiry, and planning when something changed.

All mutation goes through `Registry`, under its one lock (handlers run on the event loop and
in FastAPI's thread pool); the clock is injected. Only spans a node reports loaded count as
coverage; spans it was told to load (or reports loading) block re-assignment. A heartbeat
that changes no holding, failure or membership plans nothing; when a plan takes long (a big
mesh), the next one waits so that planning keeps to `PLANNING_SHARE` of the tracker's time.
A (re)started tracker plans nothing for `rejoin_beats` intervals from its first registration:
live nodes register again meanwhile and declare what they hold, so a restart moves no span.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence

from meshnet.observe.metrics import Metrics
from meshnet.security.vouch import TrackerIdentity
from meshnet.tracker import messages as msg
from meshnet.tracker.beats import BEATS_PER_S, beat_interval_s, host_of, overdue
from meshnet.tracker.holders import Candidate, holders
from meshnet.tracker.lease import Lease
from meshnet.tracker.membership import (
    Key,
    NotYourNodeError,
    RegistrationError,
    UnknownNodeError,
    check_claims,
    check_fits,
    check_room,
    check_token,
    token_digest,
)
from meshnet.tracker.planner import Directive, ModelOffer, plan
from meshnet.tracker.record import NodeRecord
from meshnet.tracker.reports import TRACKER_REPORTS
from meshnet.types import ModelId, NodeId, SourceKind

log = logging.getLogger(__name__)
LATE_AFTER_BEATS = 1.5  # a node this many intervals without a heartbeat shows as late
SUSPECT_S = 30.0  # a node an entry reported failing stays out of routes this long (default)
PLANNING_SHARE = 0.1  # planning may take this share of the tracker's time, at most...
QUICK_PLAN_S = 0.005  # ...once a plan takes longer than this; quicker plans run every time


class Registry:
    """Nodes, their shards, and the directives owed to them."""

    def __init__(
        self,
        offers: Sequence[ModelOffer],
        sources: dict[ModelId, str],
        *,
        dead_after_s: float,
        clock: Callable[[], float],
        heartbeat_interval_s: float | None = None,
        suspect_s: float = SUSPECT_S,
        metrics: Metrics | None = None,
        max_nodes: int = 20_000,
        max_per_address: int = 64,
        timer: Callable[[], float] = time.perf_counter,
        rejoin_beats: float = 0.0,
    ) -> None:
        self.offers = {o.model: o for o in offers}
        self.sources = sources  # model id -> what nodes pass to their loader
        self.source_kinds: dict[ModelId, SourceKind] = {}  # ... and what kind of source it is
        self.digests: dict[ModelId, str] = {}  # ... and its content, where known (ADR-0054)
        self.base_dead_after_s = dead_after_s
        self.base_interval_s = heartbeat_interval_s or dead_after_s / 3
        self.suspect_s = suspect_s  # how long a reported node stays out of routes
        self.clock = clock
        self.timer = timer  # measures what a plan costs (real seconds)
        self.metrics = metrics or Metrics()
        self.max_nodes, self.max_per_address = max_nodes, max_per_address
        self.lock = threading.RLock()  # every read and change of the state below
        self.nodes: dict[NodeId, NodeRecord] = {}
        self.recent: deque[tuple[float, Directive]] = deque(maxlen=50)  # (issued at, directive)
        # (received at, entry node, summary) of the generations entry nodes finished
        self.requests: deque[tuple[float, NodeId, msg.RequestSummary]] = deque(maxlen=50)
        self.dirty = False  # something changed since the last plan
        self.plans = 0  # plans run (tests and the churn benchmark count them)
        self._next_plan_s = float("-inf")  # clock time before which a due plan waits
        self.rejoin_s: float | None = rejoin_beats * self.base_interval_s  # None: under way
        self._turn = 0  # where the next scan for a span's weight holders starts
        self.lease: Lease | None = None  # one of several trackers: plans only with the lease
        self.identity = TrackerIdentity()  # vouches for the clients it forwards (review P1)

    @property
    def interval_s(self) -> float:
        """The heartbeat interval nodes are told now: the configured one, stretched in a big
        mesh so that heartbeats stay under `BEATS_PER_S` (`beat_interval_s`)."""
        return beat_interval_s(len(self.nodes), self.base_interval_s, BEATS_PER_S)

    @property
    def dead_after_s(self) -> float:
        """Silence that makes a node dead: as many intervals as configured."""
        return self.base_dead_after_s * self.interval_s / self.base_interval_s

    def validate(self, request: msg.RegisterRequest) -> None:
        """Refuse (400) a registration naming models to serve that this tracker does not
        offer, or spans outside an offered model. Spans of models no longer offered are
        accepted: the planner tells the node to drop them."""
        unknown = sorted(set(request.models or []) - set(self.offers))
        if unknown:
            raise RegistrationError(
                f"models {unknown} are not offered here (offered: {sorted(self.offers)})",
                field="models",
            )
        for ref in request.loaded:
            self._key(ref, request.quant)

    def register(
        self, request: msg.RegisterRequest, peer: str | None = None, token: str | None = None
    ) -> list[Directive]:
        """Take `request` in (replacing any record of its id); `token` is the membership
        token its later calls must carry (None: registered in-process, unchecked)."""
        with self.lock:
            self.validate(request)
            if self.rejoin_s is not None:  # the first registration: the others are coming
                self._next_plan_s, self.rejoin_s = self.clock() + self.rejoin_s, None
            node_id, address = NodeId(request.node_id), peer or host_of(request.address)
            check_room(self.nodes, node_id, address, self.max_nodes, self.max_per_address)
            loaded = {self._key(ref, request.quant) for ref in request.loaded}
            per_layer = {m: o.layer_bytes.get(request.quant, 0) for m, o in self.offers.items()}
            check_fits(request.node_id, loaded, per_layer, request.budget_bytes)
            self.nodes[node_id] = NodeRecord(
                request,
                self.clock(),
                loaded=loaded,
                peer=address,
                token=token_digest(token) if token else None,
                pinned=set(loaded),
                weights=frozenset(request.weights),
            )
            log.info(
                "node %s registered at %s (%d bytes, %s%s)",
                request.node_id,
                request.address,
                request.budget_bytes,
                request.quant,
                ", entry" if request.entry else "",
            )
            self._changed()
            return self._deliver(node_id)

    def heartbeat(self, beat: msg.HeartbeatRequest) -> list[Directive]:
        with self.lock:
            record = self.nodes.get(NodeId(beat.node_id))
            if record is None:
                raise UnknownNodeError(
                    f"node {beat.node_id} is not registered; register again", field="node_id"
                )
            check_token(record.token, beat.token, beat.node_id)
            quant = record.request.quant  # validate everything first
            loaded = {self._key(ref, quant) for ref in beat.loaded}
            loading = {self._key(ref, quant) for ref in beat.loading}
            failed = {self._key(f.shard) for f in beat.failed}
            if not self.plans_now():  # another tracker assigned them: a registration's trust
                self._adopt(record, loaded, loading)
            # what enters routes: assigned, registered with, held before, or told to drop
            # and not dropped yet
            allowed = record.assigned | record.pinned | record.loaded | record.dropping
            check_claims(beat.node_id, loaded, allowed, "claims")
            record.last_seen_s = self.clock()
            reported = loaded | loading
            record.dropping &= reported  # what it no longer reports, it has dropped
            loaded -= record.dropping
            undelivered = {(d.model, d.span) for d in record.pending if d.op == "LOAD_SHARD"}
            assigned = (record.assigned & (reported | undelivered)) - record.failed - failed
            changed = (loaded, assigned) != (record.loaded, record.assigned) or not (
                failed <= record.failed
            )
            record.earned = (record.earned | (loaded & record.assigned)) & loaded
            record.loaded, record.assigned = loaded, assigned
            record.failed |= failed
            record.refused |= {ModelId(f.shard.model) for f in beat.failed if f.refuses_model}
            record.fetching = list(beat.fetching)
            if beat.weights is not None and frozenset(beat.weights) != record.weights:
                record.weights, changed = frozenset(beat.weights), True
            record.sessions = beat.sessions
            record.queue_depth, record.step_s = beat.queue_depth, beat.step_s
            record.threads = beat.threads
            record.rtt_ms = dict(beat.rtt_ms)
            self.requests.extend(
                (record.last_seen_s, NodeId(beat.node_id), r) for r in beat.requests
            )
            if changed:
                self._changed()
            else:
                self.plan_if_due()
            return self._deliver(NodeId(beat.node_id))

    def leave(self, node_id: NodeId, token: str | None = None) -> bool:
        """`node_id` leaves (its token checked unless `token` is None: in-process)."""
        with self.lock:
            record = self.nodes.get(node_id)
            if record is not None and token is not None:
                check_token(record.token, token, node_id)
            gone = self.nodes.pop(node_id, None) is not None
            if gone:
                log.info("node %s left; re-planning its spans", node_id)
                self._changed()
            return gone

    def check_member(self, node_id: str, token: str) -> None:
        """Refuse (403) a call made in the name of `node_id` without its token."""
        with self.lock:
            record = self.nodes.get(NodeId(node_id))
            if record is None:
                raise NotYourNodeError(f"node {node_id} is not registered here", field="reporter")
            check_token(record.token, token, node_id)

    def report(self, node_id: NodeId, reason: str, reporter: str = TRACKER_REPORTS) -> bool:
        """`reporter` (an entry node, or the tracker) saw `node_id` fail: keep it out of
        routes for `suspect_s` (whose routes: see `tracker/reports.py`)."""
        with self.lock:
            record = self.nodes.get(node_id)
            if record is None:
                return False
            log.warning("node %s reported failing by %s: %s", node_id, reporter, reason)
            record.reports.add(reporter, self.clock() + self.suspect_s)
            return True

    def expire(self) -> list[NodeId]:
        with self.lock:
            now = self.clock()
            dead = [n for n, r in self.nodes.items() if now - r.last_seen_s > self.dead_after_s]
            for node_id in dead:
                log.warning(
                    "node %s missed heartbeats for %.1f s: dead", node_id, self.dead_after_s
                )
                del self.nodes[node_id]
            if dead:
                self._changed()
            else:
                self.plan_if_due()
            return dead

    def to_check(self) -> list[NodeId]:
        """Nodes overdue for a heartbeat and not checked since it fell due (see `gone`)."""
        with self.lock:
            return overdue(
                {n: (r.last_seen_s, r.checked_s) for n, r in self.nodes.items()},
                self.clock(),
                self.interval_s,
            )

    def gone(self, node_id: NodeId, checked: bool) -> None:
        """The result of checking an overdue node: nothing listens (`checked` False) -> dead now."""
        with self.lock:
            record = self.nodes.get(node_id)
            if record is None:
                return
            record.checked_s = self.clock()
            if not checked:
                log.warning("node %s missed a heartbeat and refuses connections: dead", node_id)
                del self.nodes[node_id]
                self._changed()

    def state(self, record: NodeRecord, now: float) -> msg.NodeState:
        """What the dashboard says of a node (`late`: one heartbeat clearly missed)."""
        if record.reports.agreed(now):
            return "suspect"
        if now - record.last_seen_s > LATE_AFTER_BEATS * self.interval_s:
            return "late"
        if record.assigned - record.loaded:
            return "loading"
        return "ready" if record.loaded else "idle"

    def plans_now(self) -> bool:
        """Whether this tracker plans: always when it is the mesh's only one; else while it
        holds the lease of `tracker/lease.py` (the others answer with no directives)."""
        return self.lease is None or self.lease.leads(self.clock())

    def term(self) -> int | None:
        """The term of the directives this tracker issues now; None while it does not plan."""
        if self.lease is None:
            return 0
        return self.lease.planner_term if self.plans_now() else None

    def follow(self) -> None:
        """Another tracker plans now: what we planned and did not deliver is dropped."""
        with self.lock:
            for record in self.nodes.values():
                record.pending.clear()
            self.dirty = True  # plan afresh if the lease comes back

    def _adopt(self, record: NodeRecord, loaded: set[Key], loading: set[Key]) -> None:
        """A follower takes the spans a node reports as declared, within its budget, as a
        registration would (the planner assigned them); those it is loading count as
        assigned, so that a new planner does not assign them again."""
        per_layer = {m: o.layer_bytes.get(record.request.quant, 0) for m, o in self.offers.items()}
        held = loaded | loading
        check_fits(record.request.node_id, held, per_layer, record.request.budget_bytes)
        record.pinned |= held
        record.assigned |= loading - loaded

    def plan_if_due(self) -> None:
        """Plan now if something changed and the last plan's cost allows (see the module)."""
        with self.lock:
            if self.dirty and self.clock() >= self._next_plan_s and self.plans_now():
                self.replan()

    def replan(self) -> None:
        """Run the planner; queue each new directive for its node."""
        with self.lock:
            started = self.timer()
            by_digest = {d: m for m, d in self.digests.items()}
            views = [r.view(by_digest) for r in self.nodes.values()]
            for directive in plan(list(self.offers.values()), views):
                self._issue(directive)
            self.dirty, self.plans = False, self.plans + 1
            cost_s = self.timer() - started
            wait_s = cost_s * (1 / PLANNING_SHARE - 1) if cost_s > QUICK_PLAN_S else 0.0
            self._next_plan_s = self.clock() + wait_s

    def _changed(self) -> None:
        self.dirty = True
        self.plan_if_due()

    def _issue(self, directive: Directive) -> None:
        record = self.nodes[directive.node_id]
        key = (directive.model, directive.span)
        if directive.op == "LOAD_SHARD":
            record.assigned.add(key)
            record.dropping.discard(key)
        else:
            record.loaded.discard(key)
            record.assigned.discard(key)
            record.dropping.add(key)
        record.pending.append(directive)
        self.recent.append((self.clock(), directive))
        self.metrics.directives.labels(directive.op).inc()
        d = directive
        log.info("%s %s %s to %s: %s", d.op, d.model, d.span, d.node_id, d.reason)

    def _deliver(self, node_id: NodeId) -> list[Directive]:
        record = self.nodes[node_id]
        if not self.plans_now():
            return []  # planned before our lease ran out: dropped by `follow`
        out, record.pending = record.pending, []
        return out

    def _key(self, ref: msg.ShardRef, quant: str | None = None) -> Key:
        """A reported span as a key: a model no longer offered is kept (to be dropped); a span
        outside an offered model's layers, or held in a quantization it is not served in (one
        re-quantizing a GGUF file's weights, ADR-0060), is refused (400)."""
        offer = self.offers.get(ModelId(ref.model))
        if offer is not None and ref.span.end > offer.num_layers:
            raise RegistrationError(
                f"span {ref.span} is outside {ref.model}'s {offer.num_layers} layers", field="span"
            )
        if offer is not None and quant is not None and quant not in offer.layer_bytes:
            raise RegistrationError(
                f"{ref.model} is not served as {quant}, which would re-quantize its file's "
                f"weights; serve it as one of {sorted(offer.layer_bytes)}",
                field="quant",
            )
        return ModelId(ref.model), ref.span

    def to_message(self, directive: Directive) -> msg.DirectiveMessage:
        return msg.DirectiveMessage(
            op=directive.op,
            model=directive.model,
            source=self.sources.get(directive.model, directive.model),
            source_kind=self.source_kinds.get(directive.model),
            span=directive.span,
            reason=directive.reason,
            digest=self.digests.get(directive.model),
            holders=self.holders(directive) if directive.op == "LOAD_SHARD" else [],
        )

    def holders(self, directive: Directive) -> list[msg.WeightHolder]:
        """Whom the node told to load `directive`'s span may fetch its weights from: nodes
        scanned from a turning start until `holders.SCAN` serve some of it (a big mesh), of
        the spans this tracker assigned them (`NodeRecord.earned`), never what they claim."""
        model, now, records = directive.model, self.clock(), list(self.nodes.items())
        if model not in self.digests:
            return []
        self._turn = (self._turn + 1) % max(1, len(records))
        candidates = (
            Candidate(
                n, r.request.address, spans, r.sessions + r.queue_depth, r.reports.agreed(now)
            )
            for n, r in records[self._turn :] + records[: self._turn]
            if n != directive.node_id and (spans := frozenset(s for m, s in r.earned if m == model))
        )
        return holders(directive.span, candidates)

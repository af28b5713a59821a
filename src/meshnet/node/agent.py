"""The node's side of the control plane: register, heartbeat, carry out directives.

A node needs nothing but the tracker's address and a budget: it registers (with any spans it
already holds), heartbeats every interval with what it has loaded, is loading and failed to
load, and loads or drops shards as the tracker's directives say. When the tracker does not
know it (a tracker restart), it registers again by itself.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import secrets
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx

from meshnet.errors import CopyDiffersError, read_error
from meshnet.models.source import check_source_kind
from meshnet.node.app import NodeService
from meshnet.node.runner import ShardRunner
from meshnet.node.weights import NodeWeights
from meshnet.security.swarm import TRACKER
from meshnet.tracker import messages as msg
from meshnet.types import LayerSpan

log = logging.getLogger(__name__)
FENCE_BEATS = 3  # a higher term's planner silent this many intervals: a lower term may direct
Loader = Callable[[str, str, LayerSpan], ShardRunner]  # (model id, source, span) -> runner


def node_id(data_dir: Path) -> str:
    """This node's id, created once and kept in `data_dir` so a restart keeps its identity."""
    path = data_dir / "node_id"
    if path.exists():
        return path.read_text().strip()
    data_dir.mkdir(parents=True, exist_ok=True)
    new = f"node-{uuid.uuid4().hex[:12]}"
    path.write_text(new + "\n")
    return new


@dataclass
class Membership:
    """This node's id and the membership token its registration got: heartbeats and
    `leave` carry it, and so do the reports its entry role sends about other nodes. Kept in
    `path` (mode 0600), a restarted node proves it is the same node when it registers again
    (review N5: without it, anyone could re-register a live id at its address)."""

    node_id: str
    token: str = ""
    path: Path | None = None

    @classmethod
    def kept(cls, node_id: str, path: Path) -> Membership:
        """The membership a previous run of this node kept in `path` (none: no token)."""
        return cls(node_id, path.read_text().strip() if path.exists() else "", path)

    def renew(self, token: str) -> None:
        self.token = token
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as out:
                out.write(token + "\n")


class RefusedError(Exception):
    """The tracker answered a control-plane call with an error."""


def _claims_refused(response: httpx.Response) -> bool:
    """A heartbeat refused for spans this tracker did not assign (it restarted while a load
    was under way): registering again declares them, within the budget."""
    error = read_error(response.content)
    return response.status_code == 400 and error is not None and error.field == "loaded"


def _check(response: httpx.Response, what: str) -> None:
    """Raise `RefusedError` with the tracker's own words when it refused `what`."""
    if response.is_success:
        return
    error = read_error(response.content)
    reason = error.message if error is not None else response.text[:200]
    hint = " (is this node's swarm key the tracker's?)" if response.status_code == 401 else ""
    raise RefusedError(f"the tracker refused our {what}: {response.status_code} {reason}{hint}")


@dataclass
class Link:
    """One of the mesh's trackers, as this node's agent keeps it."""

    client: httpx.AsyncClient  # base_url = the tracker
    registered: bool = False
    retry_s: float = 0.1  # registration retries start fast: the first may beat our server
    down: str = ""  # why it was last unreachable (logged once until it answers)

    @property
    def url(self) -> str:
        return str(self.client.base_url).rstrip("/")


class NodeAgent:
    """Keeps one node registered with each of the mesh's trackers, and its shards as the
    planning one directs (ADR-0057: directives of a term below the highest seen are ignored)."""

    def __init__(
        self,
        service: NodeService,
        client: httpx.AsyncClient | Sequence[httpx.AsyncClient],
        registration: msg.RegisterRequest,
        loader: Loader,
        on_load: Callable[[ShardRunner], object] = lambda runner: None,
        on_drop: Callable[[str, LayerSpan], object] = lambda model, span: None,
        membership: Membership | None = None,
        weights: NodeWeights | None = None,
    ) -> None:
        self.membership = membership or Membership(registration.node_id)
        self.weights = weights  # where spans' weights come from (None: the source as named)
        self.digests: dict[str, str] = {}  # model -> its digest, from directives
        if weights is not None:
            weights.report = self._report_holder
        self.service = service
        clients = [client] if isinstance(client, httpx.AsyncClient) else list(client)
        self.links = [Link(c) for c in clients]
        self.term = -1  # the highest planner term whose directives we took...
        self.term_heard_s = -math.inf  # ...and when its planner last answered (monotonic)
        self.registration = registration
        self.loader = loader
        self.on_load = on_load  # on the event loop, once a loaded span serves
        self.on_drop = on_drop  # ... once a span is dropped
        self.interval_s = 2.0
        self.loading: dict[tuple[str, LayerSpan], asyncio.Task[None]] = {}
        self.failed: list[msg.ShardFailure] = []
        self._pinging: asyncio.Future[None] | None = None  # the peers' round trips being measured

    def loaded(self) -> list[msg.ShardRef]:
        return [msg.ShardRef(model=m, span=s) for m, s in self.service.shards]

    @property
    def client(self) -> httpx.AsyncClient:
        """The first tracker's client."""
        return self.links[0].client

    @property
    def registered(self) -> bool:
        return all(link.registered for link in self.links)

    async def run(self) -> None:
        """Register, then heartbeat forever, with every tracker at its own pace (cancel to
        stop): one that is down or slow holds none of the others back."""
        await asyncio.gather(*(self._keep(link) for link in self.links))

    async def _keep(self, link: Link) -> None:
        while True:
            try:
                await self._beat_one(link)
                link.down = ""
            except (httpx.HTTPError, ValueError) as exc:
                self._unreachable(link, f"unreachable ({type(exc).__name__}: {exc})")
            except RefusedError as exc:
                self._unreachable(link, str(exc))
            except Exception:  # a link's loop is a boundary: it must not end, nor end others
                log.exception("tracker %s: heartbeat failed; retrying", link.url)
            if link.registered:
                await asyncio.sleep(self.interval_s)
            else:
                await asyncio.sleep(link.retry_s)
                link.retry_s = min(self.interval_s, link.retry_s * 2)

    def _unreachable(self, link: Link, why: str) -> None:
        if why != link.down:
            log.warning("tracker %s: %s; retrying", link.url, why)
        link.down = why

    async def retire(self, task: asyncio.Task[None]) -> None:
        """Stop heartbeating (`task` is `run()`), then leave: the tracker re-plans at once."""
        task.cancel()
        await self.leave()

    async def leave(self) -> None:
        body = {"node_id": self.registration.node_id, "token": self.membership.token}
        await self._tell_all("/v1/nodes/leave", body, "that we are leaving")

    async def _tell_all(self, path: str, body: Mapping[str, object], what: str) -> None:
        """POST `body` to every tracker at once (a down one costs its timeout, not theirs)."""

        async def tell(link: Link) -> None:
            try:
                await link.client.post(path, json=body, timeout=2.0)
            except httpx.HTTPError as exc:
                log.warning("could not tell tracker %s %s: %s", link.url, what, exc)

        await asyncio.gather(*(tell(link) for link in self.links))

    async def _beat(self) -> None:
        """One heartbeat (or registration) with every tracker."""
        await asyncio.gather(*(self._beat_one(link) for link in self.links))

    async def _beat_one(self, link: Link) -> None:
        if not link.registered:
            await self._register(link)
            return
        # at most MAX_REQUESTS (a bounded deque); lost if this beat fails: they are for display
        finished = self.service.take_finished() if link is self.links[0] else []
        beat = msg.HeartbeatRequest(
            node_id=self.registration.node_id,
            token=self.membership.token,
            term=self.term,
            loaded=self.loaded(),
            loading=[msg.ShardRef(model=m, span=s) for m, s in self.loading],
            failed=self.failed,
            sessions=self.service.session_count(),
            queue_depth=self.service.scheduler.queue_depth(),
            step_s=round(self.service.scheduler.step_s(), 6),
            threads=self.service.scheduler.threads.threads,
            requests=finished,
            rtt_ms=self.service.peers.report_ms(),
            fetching=self.weights.states() if self.weights is not None else [],
            weights=self.weights.digests() if self.weights is not None else None,
        )
        sent = time.perf_counter()
        response = await link.client.post("/v1/nodes/heartbeat", json=beat.model_dump(mode="json"))
        self.service.peers.record(
            TRACKER, time.perf_counter() - sent
        )  # ~1 ms of it is the tracker's
        self._ping_peers()

        if response.status_code in (403, 404) or _claims_refused(response):
            log.info("tracker %s does not know this node (restarted?); registering", link.url)
            link.registered = False
            await self._register(link)
            return
        _check(response, "heartbeat")
        answer = msg.HeartbeatResponse.model_validate(response.json())
        if answer.heartbeat_interval_s:  # a big mesh stretches everyone's interval
            self.interval_s = answer.heartbeat_interval_s
        if answer.term is not None:  # the planner has heard of our failures
            self.failed = []
        self._apply(answer.directives, answer.term, link.url)

    def _ping_peers(self) -> None:
        """Ping the peers that are due, in the background (a slow one must not hold the
        heartbeats back); one round at a time."""
        if self._pinging is not None and not self._pinging.done():
            return
        due = self.service.peers.due()
        if due:
            self._pinging = asyncio.ensure_future(self._ping(due))

    async def _ping(self, due: list[tuple[str, str]]) -> None:
        times = await asyncio.gather(*(self.service.forwarder.ping(address) for _, address in due))
        for (node_id, _), rtt_s in zip(due, times, strict=True):
            if rtt_s is not None:
                self.service.peers.record(node_id, rtt_s)

    async def _register(self, link: Link) -> None:
        if not self.membership.token:  # ours, the same with every tracker
            self.membership.renew(secrets.token_urlsafe(24))
        held = self.weights.digests() if self.weights is not None else []
        token, term = self.membership.token, self.term
        update = {"loaded": self.loaded(), "token": token, "weights": held, "term": term}
        request = self.registration.model_copy(update=update)
        response = await link.client.post(
            "/v1/nodes/register", json=request.model_dump(mode="json")
        )
        _check(response, "registration")
        answer = msg.RegisterResponse.model_validate(response.json())
        self.service.tracker_keys.add(answer.tracker_key)  # from its own address: trusted
        if answer.token != self.membership.token:
            self.membership.renew(answer.token)
        self.interval_s = answer.heartbeat_interval_s
        link.registered, link.retry_s = True, 0.1
        log.info("registered with tracker %s as %s", link.url, answer.node_id)
        self._apply(answer.directives, answer.term, link.url)

    def _apply(
        self, directives: list[msg.DirectiveMessage], term: int | None, tracker: str = ""
    ) -> None:
        """Carry out a planner's directives; none from a tracker that does not plan (`term`
        None) or from a planner older than one we have heard from (a partition healing)."""
        if term is None or not self._fenced_in(term):
            if directives:
                log.warning("ignored %d directives of planner term %s", len(directives), term)
            return
        self.term, self.term_heard_s = term, time.monotonic()
        for d in directives:
            log.info("%s %s %s: %s", d.op, d.model, d.span, d.reason)
            key = (d.model, d.span)
            if d.op == "DROP_SHARD":
                self.service.shards.remove(d.model, d.span)
                self.on_drop(d.model, d.span)
                self._keep_cache()  # what no span uses now may leave the cache
            elif key not in self.service.shards and key not in self.loading:
                self.loading[key] = asyncio.create_task(self._load(d, tracker))

    def _fenced_in(self, term: int) -> bool:
        """Whether a planner of `term` may direct us: one of our highest term or above, or
        a lower one once our highest term's planner has been silent `FENCE_BEATS` intervals
        (every tracker restarted: their terms start over; trackers take no term from nodes,
        so a member's huge term fences nobody out for good: review L1)."""
        if term >= self.term:
            return True
        if time.monotonic() - self.term_heard_s < FENCE_BEATS * self.interval_s:
            return False
        log.warning("planner term %d is gone; taking directives of term %d", self.term, term)
        return True

    async def _load(self, d: msg.DirectiveMessage, tracker: str = "") -> None:
        """Load `d`'s span (`tracker`: the URL of the tracker that sent `d`)."""
        key = (d.model, d.span)
        try:
            source = await self._source(d, tracker)
            runner = await asyncio.get_running_loop().run_in_executor(
                self.service.scheduler.worker, self.loader, d.model, source, d.span
            )
            self.service.shards.add(runner)
            self.on_load(runner)
            log.info("loaded %s layers %s", d.model, d.span)
            self._keep_cache()
        except Exception as exc:  # a load is a task boundary: report, let the tracker re-plan
            log.exception("loading %s layers %s failed", d.model, d.span)
            self.failed.append(
                msg.ShardFailure(
                    shard=msg.ShardRef(model=d.model, span=d.span),
                    error=str(exc)[:2000],
                    refuses_model=isinstance(exc, CopyDiffersError),
                )
            )
        finally:
            self.loading.pop(key, None)

    async def _source(self, d: msg.DirectiveMessage, tracker: str) -> str:
        """What the loader reads for `d`: the weights this node holds or fetched (ADR-0054)."""
        if self.weights is None:
            check_source_kind(d.source, d.source_kind)  # before the loader: no download
            return d.source
        if d.digest is not None:
            self.digests[d.model] = d.digest
        return await self.weights.obtain(d, tracker or None)

    def _keep_cache(self) -> None:
        if self.weights is not None:
            used = {self.digests[m] for m, _ in self.service.shards if m in self.digests}
            self.weights.keep(used)

    async def _report_holder(self, node_id: str, why: str) -> None:
        """Tell the tracker a member sent weights that fail their hash (like a failed spot
        check: it leaves routes for a while)."""
        body = msg.ReportRequest(
            node_id=node_id,
            reason=why[:500],
            reporter=self.registration.node_id,
            token=self.membership.token,
        )
        await self._tell_all("/v1/nodes/report", body.model_dump(mode="json"), f"of {node_id}")

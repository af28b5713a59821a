"""Where a node's spans' weights come from (ADR-0054).

A directive names the model's source on the tracker's machine and, for a GGUF model, its
digest. When this node has a GGUF file at that source, the parts the span reads are checked
against the manifest (hashed once, as the load is about to read them) and loaded from it; a
copy that differs is refused with the part named. Otherwise the span's parts are fetched
from the members that hold them, into this node's cache, and loaded from there.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

from meshnet.errors import WeightsError
from meshnet.models.source import check_source_kind, default_gguf, source_kind
from meshnet.observe.metrics import Metrics
from meshnet.security.signing import Signer
from meshnet.security.swarm import TRACKER
from meshnet.tracker import messages as msg
from meshnet.types import LayerSpan
from meshnet.weights.fetch import Fetcher, Holder
from meshnet.weights.manifest import Manifest, Part
from meshnet.weights.store import HeldFile, WeightStore

log = logging.getLogger(__name__)
Report = Callable[[str, str], Awaitable[None]]  # (node id, why): a holder that sent bad bytes
Key = tuple[str, LayerSpan]
STALL_S = 45.0  # a fetch with no new byte this long fails (over one range's deadline, 30 s)


def local_file(source: str) -> Path | None:
    """The GGUF file `source` names on this machine, or None."""
    kind = source_kind(source)
    if kind == "default":
        try:
            return default_gguf()
        except Exception:  # the default model's package missing: it may be fetched
            return None
    return Path(source).expanduser() if kind == "gguf" else None


class NodeWeights:
    """A node's weights: its local files, checked, and what it fetches from the mesh."""

    def __init__(
        self,
        store: WeightStore,
        tracker_url: str,
        *,
        entry: bool,
        signer: Signer | None = None,
        verify: object = True,
        metrics: Metrics | None = None,
    ) -> None:
        self.store = store
        self.tracker = Holder(TRACKER, tracker_url)
        self.entry = entry  # a span from layer 0 comes with the head
        self.signer = signer or Signer(None)
        self.verify = verify
        self.metrics = metrics
        self.report: Report | None = None
        self.fetches: dict[Key, Fetcher] = {}
        self.stall_s = STALL_S

    def parts(self, manifest: Manifest, span: LayerSpan) -> list[Part]:
        return manifest.span_parts(span, entry=self.entry)

    async def obtain(self, d: msg.DirectiveMessage, tracker: str | None = None) -> str:
        """What to pass the loader for directive `d`'s span: a checked local file, the cache's
        file once the span's parts are fetched, or (no digest) the source as named.
        `tracker`: the URL of the tracker that sent `d` (its manifest is the one taken)."""
        if d.digest is None:
            check_source_kind(d.source, d.source_kind)  # before the loader: no download
            return d.source
        fetcher = self._fetcher(d, Holder(TRACKER, tracker) if tracker else self.tracker)
        local = local_file(d.source)
        key = (d.model, d.span)
        self.fetches[key] = fetcher
        try:
            if local is not None and local.is_file():
                manifest = await fetcher.manifest_of(d.digest)
                parts = self.parts(manifest, d.span)
                await asyncio.to_thread(self.store.check_local, local, manifest, parts)
                return str(local)
            started = time.monotonic()
            held = await self._watched(
                fetcher, fetcher.fetch(d.digest, lambda m: self.parts(m, d.span))
            )
            log.info("weights of %s %s here in %.1f s", d.model, d.span, time.monotonic() - started)
            self.store.touch(d.digest)
            return str(held.path)
        finally:
            self.fetches.pop(key, None)

    def _fetcher(self, d: msg.DirectiveMessage, tracker: Holder) -> Fetcher:
        holders = [Holder(h.node_id, h.address) for h in d.holders] + [tracker]
        return Fetcher(
            self.store,
            holders,
            signer=self.signer,
            verify=self.verify,
            metrics=self.metrics,
            report=self._report,
            manifest_from=tracker,
        )

    async def _watched(self, fetcher: Fetcher, fetch: Awaitable[HeldFile]) -> HeldFile:
        """`fetch`'s file, or `WeightsError` once it has fetched nothing for `stall_s` (a
        holder trickling bytes over several deadlines, or every holder stalled: review W2):
        the load fails saying so, and the planner gives the span to another node."""
        job = asyncio.ensure_future(fetch)
        seen, since = -1, time.monotonic()
        while True:
            done, _ = await asyncio.wait({job}, timeout=min(1.0, self.stall_s / 4))
            if done:
                return job.result()
            got = fetcher.progress.done_bytes if fetcher.progress is not None else 0
            if got != seen:
                seen, since = got, time.monotonic()
            elif time.monotonic() - since > self.stall_s:
                job.cancel()
                await asyncio.gather(job, return_exceptions=True)
                if self.metrics is not None:
                    self.metrics.weights_refused.labels("stalled").inc()
                names = ", ".join(h.name for h in fetcher.holders)
                raise WeightsError(
                    f"no weight bytes came for {self.stall_s:.0f} s from {names}; "
                    "giving the load up",
                    field="holders",
                )

    async def _report(self, holder: Holder, why: str) -> None:
        if self.report is not None and holder.name != TRACKER:
            await self.report(holder.name, why)

    def states(self) -> list[msg.FetchState]:
        """How far each fetch under way has come (for heartbeats)."""
        out = []
        for (model, span), fetcher in self.fetches.items():
            p = fetcher.progress
            if p is not None:
                out.append(
                    msg.FetchState(
                        shard=msg.ShardRef(model=model, span=span),
                        done_bytes=p.done_bytes,
                        total_bytes=p.total_bytes,
                        rate_bytes_s=round(p.rate_bytes_s(), 1),
                    )
                )
        return out

    def digests(self) -> list[str]:
        return self.store.digests()[:64]

    def keep(self, digests: set[str]) -> None:
        """Drop cached models beyond the cache's cap, but none of `digests` (in use)."""
        self.store.evict(digests)

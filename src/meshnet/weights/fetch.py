"""A node fetches exactly the parts its span needs from the members that hold them (ADR-0054).

Parts go to a few workers at once; each asks its holders in turn, least loaded first (the
order the tracker gave), in `RANGE_BYTES` ranges written straight to the cache file and hashed
as they come. A part whose hash is wrong is fetched again from another holder and its sender
reported; a holder that fails or stalls is left for the rest of the fetch. Parts already in
the cache's record are not fetched again, so a fetch cut short resumes where it stopped.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from urllib.parse import quote

import httpx

from meshnet.errors import WeightsError
from meshnet.observe.metrics import Metrics
from meshnet.observe.progress import Task, progress
from meshnet.security.signing import Signer
from meshnet.weights.manifest import Manifest, Part, parse_manifest
from meshnet.weights.store import HeldFile, WeightStore

log = logging.getLogger(__name__)
RANGE_BYTES = 4 << 20  # one call's bytes
WORKERS = 4  # parts fetched at once (from different holders where there are several)
CALL_TIMEOUT_S = 30.0  # a holder silent this long on one range is left for this fetch
SYNC_BYTES = 64 << 20  # checked parts are synced and recorded together, this many bytes at most


@dataclass(frozen=True)
class Holder:
    """A member that may hold the parts: its node id (`tracker` for the tracker) and address."""

    name: str
    address: str


@dataclass
class FetchProgress:
    """What a fetch has done so far (heartbeats, `meshnet status`, the dashboard)."""

    total_bytes: int
    done_bytes: int = 0
    started_s: float = field(default_factory=time.monotonic)

    def rate_bytes_s(self, now_s: float | None = None) -> float:
        elapsed = (now_s or time.monotonic()) - self.started_s
        return self.done_bytes / elapsed if elapsed > 0 else 0.0

    def eta_s(self) -> float | None:
        rate = self.rate_bytes_s()
        return (self.total_bytes - self.done_bytes) / rate if rate > 0 else None


Report = Callable[[Holder, str], Awaitable[None]]  # a holder that sent bad bytes, and why


class Fetcher:
    """Fetches parts of one model into `store`'s cache from `holders` (in preference order)."""

    def __init__(
        self,
        store: WeightStore,
        holders: Sequence[Holder],
        *,
        signer: Signer | None = None,
        verify: object = True,  # TLS: httpx's `verify`
        metrics: Metrics | None = None,
        report: Report | None = None,
        timeout_s: float = CALL_TIMEOUT_S,
    ) -> None:
        if not holders:
            raise WeightsError("no member holds these weights", field="holders")
        self.store = store
        self.holders = list(holders)
        self.signer = signer or Signer(None)
        self.verify = verify
        self.metrics = metrics
        self.report = report
        self.timeout_s = timeout_s
        self.left: set[str] = set()  # holders that failed or stalled during this fetch
        self.progress: FetchProgress | None = None
        self.checked: list[Part] = []  # hashed and written, not yet synced and recorded

    async def manifest_of(self, digest: str) -> Manifest:
        """The manifest `digest` names: the store's, else the first right one a holder gives."""
        held = self.store.files.get(digest)
        if held is not None:
            return held.manifest
        async with self._client() as client:
            return await self.manifest(client, digest)

    def _client(self) -> httpx.AsyncClient:
        return httpx.AsyncClient(timeout=self.timeout_s, verify=self.verify)  # type: ignore[arg-type]

    async def manifest(self, client: httpx.AsyncClient, digest: str) -> Manifest:
        """The manifest `digest` names, from the first holder that gives the right one."""
        errors = []
        for holder in self.holders:
            try:
                response = await self._get(client, holder, f"/v1/weights/{digest}/manifest")
                response.raise_for_status()
                return parse_manifest(response.content, digest)
            except (httpx.HTTPError, WeightsError) as exc:
                errors.append(f"{holder.name}: {exc}")
        raise WeightsError(f"no holder gave model {digest[:16]}...'s manifest: {'; '.join(errors)}")

    async def fetch(self, digest: str, parts_of: Callable[[Manifest], list[Part]]) -> HeldFile:
        """The cache's file of model `digest` holding every part `parts_of(manifest)` names."""
        async with self._client() as client:
            held = self.store.files.get(digest)
            manifest = held.manifest if held is not None else await self.manifest(client, digest)
            parts = parts_of(manifest)
            if held is not None and held.has(parts):
                return held
            held = self.store.cache_entry(manifest)
            todo = [p for p in parts if p.name not in held.held]
            self.progress = FetchProgress(sum(p.nbytes for p in todo))
            with progress(
                f"fetching {len(todo)} parts of model {digest[:12]}", self.progress.total_bytes
            ) as task:
                queue: asyncio.Queue[Part] = asyncio.Queue()
                for part in sorted(todo, key=lambda p: -p.nbytes):  # big first: even finish
                    queue.put_nowait(part)
                workers = min(WORKERS, max(1, len(todo)))
                jobs = [
                    asyncio.create_task(self._work(client, held, queue, i, task))
                    for i in range(workers)
                ]
                try:
                    await asyncio.gather(*jobs)
                finally:  # no worker outlives the fetch; what was checked stays (a resume)
                    for job in jobs:
                        job.cancel()
                    await asyncio.gather(*jobs, return_exceptions=True)
                    await self._commit(held)
            return held

    async def _commit(self, held: HeldFile) -> None:
        parts, self.checked = self.checked, []
        await asyncio.to_thread(self.store.commit, held, parts)

    async def _work(
        self,
        client: httpx.AsyncClient,
        held: HeldFile,
        queue: asyncio.Queue[Part],
        first: int,
        task: Task,
    ) -> None:
        while not queue.empty():
            part = queue.get_nowait()
            await self._part(client, held, part, first, task)

    async def _part(
        self, client: httpx.AsyncClient, held: HeldFile, part: Part, first: int, task: Task
    ) -> None:
        """Fetch `part` from the first holder (from the `first`-th on) that gives it right."""
        order = (
            self.holders[first % len(self.holders) :] + self.holders[: first % len(self.holders)]
        )
        errors = []
        for holder in order:
            if holder.name in self.left:
                continue
            try:
                await self._from(client, holder, held, part, task)
                return
            except _BadBytes as exc:
                errors.append(f"{holder.name}: {exc}")
                log.warning(
                    "%s sent part %s that fails its hash; fetching it elsewhere",
                    holder.name,
                    part.name,
                )
                reported = holder.name in self.left  # by another worker, at the same time
                self.left.add(holder.name)
                if self.report is not None and not reported:
                    await self.report(holder, f"sent weights that fail their hash ({part.name})")
            except (httpx.HTTPError, _Refused) as exc:
                errors.append(f"{holder.name}: {exc or type(exc).__name__}")
                if not isinstance(exc, _Refused) and holder.name not in self.left:
                    self.left.add(holder.name)  # down or stalled: not again in this fetch
                    log.warning("weights: %s failed (%r); going on without it", holder.name, exc)
        raise WeightsError(
            f"no holder gave part {part.name!r}: {'; '.join(errors) or 'none left'}",
            field=part.name,
        )

    async def _from(
        self, client: httpx.AsyncClient, holder: Holder, held: HeldFile, part: Part, task: Task
    ) -> None:
        digest, got = hashlib.sha256(), 0
        target = f"/v1/weights/{held.manifest.digest}/parts/{quote(part.name, safe='')}"
        while got < part.nbytes:  # an empty part has nothing to fetch
            end = min(part.nbytes, got + RANGE_BYTES)
            response = await self._get(client, holder, target, {"Range": f"bytes={got}-{end - 1}"})
            if response.status_code == 404:
                raise _Refused(f"does not hold {part.name}")
            response.raise_for_status()
            data = response.content
            if len(data) != end - got:
                raise _BadBytes(f"sent {len(data)} bytes for a range of {end - got}")
            digest.update(data)
            await asyncio.to_thread(self.store.write, held, part.offset + got, data)
            got = end
            self._advance(holder, len(data), task)
        if digest.hexdigest() != part.sha256:
            raise _BadBytes(f"part {part.name} fails its hash")
        self.checked.append(part)
        if sum(p.nbytes for p in self.checked) >= SYNC_BYTES:
            await self._commit(held)

    def _advance(self, holder: Holder, nbytes: int, task: Task) -> None:
        if self.progress is not None:
            self.progress.done_bytes += nbytes
        task.advance(nbytes)
        if self.metrics is not None:
            self.metrics.weights_fetched.labels(peer=holder.name).inc(nbytes)

    async def _get(
        self,
        client: httpx.AsyncClient,
        holder: Holder,
        target: str,
        headers: dict[str, str] | None = None,
    ) -> httpx.Response:
        auth = self.signer.auth(holder.name)
        url = holder.address.rstrip("/") + target
        return await client.get(url, headers=headers, auth=auth or httpx.USE_CLIENT_DEFAULT)


class _BadBytes(Exception):
    """A holder's bytes are not the part's."""


class _Refused(Exception):
    """A holder answered that it does not hold the part (it may hold others)."""

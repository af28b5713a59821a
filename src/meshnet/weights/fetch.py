"""A node fetches exactly the parts its span needs from the members that hold them (ADR-0054).

Parts go to a few workers at once; each asks its holders in turn, least loaded first (the
order the tracker gave), in `RANGE_BYTES` ranges written straight to the cache file and hashed
as they come. A part whose hash is wrong is fetched again from another holder and its sender
reported; a holder that fails or stalls is left for the rest of the fetch. Parts already in
the cache's record are not fetched again, so a fetch cut short resumes where it stopped.

Holders are members, not trusted with this node's memory or time (review W1, W2): answers are
read as the hop path reads frames, unencoded (`Accept-Encoding: identity`; an encoded answer
is refused), streamed and cut off past the length asked for, each within `deadline_s`, and
their signature checked over what was read.
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

from meshnet.errors import AuthError, WeightsError
from meshnet.observe.metrics import Metrics
from meshnet.observe.progress import Task, progress
from meshnet.security.signing import AnswerNotSigned, Signer
from meshnet.weights.manifest import Manifest, Part, parse_manifest
from meshnet.weights.store import HeldFile, WeightStore

log = logging.getLogger(__name__)
RANGE_BYTES = 4 << 20  # one call's bytes
WORKERS = 4  # parts fetched at once (from different holders where there are several)
CALL_TIMEOUT_S = 30.0  # a holder that has not sent one range (or a manifest) in this is left
MAX_MANIFEST_BYTES = 64 << 20  # ~100,000 parts at ~300 bytes of JSON each, with room
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
        manifest_from: Holder | None = None,
    ) -> None:
        """`manifest_from`: the one member asked for manifests (the tracker that sent the
        directive); None: every holder in turn."""
        if not holders:
            raise WeightsError("no member holds these weights", field="holders")
        self.store = store
        self.holders = list(holders)
        self.signer = signer or Signer(None)
        self.verify = verify
        self.metrics = metrics
        self.report = report
        self.timeout_s = timeout_s
        self.manifest_from = manifest_from
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
        for holder in [self.manifest_from] if self.manifest_from else self.holders:
            try:
                status, body = await self._get(
                    client, holder, f"/v1/weights/{digest}/manifest", MAX_MANIFEST_BYTES
                )
                if status != 200:
                    raise _Refused(f"answered HTTP {status}")
                return parse_manifest(body, digest)
            except (httpx.HTTPError, WeightsError, _Refused, _BadBytes) as exc:
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
                log.warning("%s: %s (part %s); fetching it elsewhere", holder.name, exc, part.name)
                self._refused(exc.why)
                reported = holder.name in self.left  # by another worker, at the same time
                self.left.add(holder.name)
                if self.report is not None and not reported:
                    await self.report(holder, f"weights answer refused: {exc} ({part.name})")
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
            ask = {"Range": f"bytes={got}-{end - 1}"}
            status, data = await self._get(client, holder, target, end - got, ask)
            if status == 404:
                raise _Refused(f"does not hold {part.name}")
            if status not in (200, 206):
                raise _Refused(f"answered HTTP {status}")
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
        limit_bytes: int,
        headers: dict[str, str] | None = None,
    ) -> tuple[int, bytes]:
        """The status and body of a GET of `target` from `holder`: unencoded, at most
        `limit_bytes`, within `timeout_s` in all, a 2xx answer signed by the holder
        (`_BadBytes` otherwise; `httpx.TimeoutException` past the deadline)."""
        url = holder.address.rstrip("/") + target
        asked = {"Accept-Encoding": "identity", **(headers or {})}
        request = client.build_request("GET", url, headers=asked)
        auth = self.signer.auth(holder.name, answers=False) or httpx.USE_CLIENT_DEFAULT
        try:
            async with asyncio.timeout(self.timeout_s):
                response = await client.send(request, auth=auth, stream=True)
                try:
                    body = await _capped(response, limit_bytes)
                finally:
                    await response.aclose()
        except TimeoutError:
            self._refused("deadline")
            raise httpx.ReadTimeout(
                f"no whole answer in {self.timeout_s:.0f} s", request=request
            ) from None
        try:
            self.signer.check_answer(
                request.headers, response.status_code, response.headers.multi_items(), body
            )
        except AuthError as exc:  # left, not reported: anyone on the path could do this
            raise AnswerNotSigned(f"{url}: {exc.message}", request=request) from None
        return response.status_code, body

    def _refused(self, why: str) -> None:
        if self.metrics is not None:
            self.metrics.weights_refused.labels(why).inc()


async def _capped(response: httpx.Response, limit_bytes: int) -> bytes:
    """`response`'s body as sent, refused when encoded or longer than `limit_bytes`: nothing
    is inflated, and no more than the limit is ever held."""
    encoding = response.headers.get("content-encoding", "identity").strip().lower()
    if encoding not in ("", "identity"):
        raise _BadBytes(f"sent a {encoding!r}-encoded answer (identity was asked for)", "encoded")
    declared = response.headers.get("content-length")
    if declared is not None and (not declared.isdigit() or int(declared) > limit_bytes):
        raise _BadBytes(f"announced {declared[:20]} bytes; at most {limit_bytes} fit", "too_long")
    chunks, got = [], 0
    async for chunk in response.aiter_raw():
        got += len(chunk)
        if got > limit_bytes:
            raise _BadBytes(f"sent more than the {limit_bytes} bytes asked for", "too_long")
        chunks.append(chunk)
    return b"".join(chunks)


class _BadBytes(Exception):
    """A holder's bytes are not the part's (`why`: the metric's label)."""

    def __init__(self, message: str, why: str = "hash") -> None:
        super().__init__(message)
        self.why = why


class _Refused(Exception):
    """A holder answered that it does not hold the part (it may hold others)."""

"""A member's trackers (ADR-0057): one client for the calls any of them answers (routes,
coverage, entries), which passes each call on to the next tracker when one is down, and the
check at start that they are trackers of one mesh.

Registration and heartbeats go to every tracker, each over its own client (`NodeAgent`).
"""

from __future__ import annotations

import logging
import ssl
from collections.abc import Sequence

import httpx

from meshnet.config import AccessConfig
from meshnet.errors import ConfigError
from meshnet.security.signing import Signer
from meshnet.security.swarm import TRACKER
from meshnet.security.tls import client_context

log = logging.getLogger(__name__)
DOWN = (httpx.ConnectError, httpx.ConnectTimeout)  # nothing listens, or nothing accepts


class Failover(httpx.AsyncBaseTransport):
    """Sends each call to the tracker that answered last; when one refuses the connection
    (or does not accept it in time) the call goes to the next in `urls`, in turn. A call
    that reached a tracker is never sent twice."""

    def __init__(self, urls: Sequence[str], inner: httpx.AsyncBaseTransport) -> None:
        self.urls = [httpx.URL(u) for u in urls]
        self.inner = inner
        self.current = 0  # the tracker that answered last

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        error: Exception = httpx.ConnectError("no tracker to try", request=request)
        for turn in range(len(self.urls)):
            k = (self.current + turn) % len(self.urls)
            to = self.urls[k]
            request.url = request.url.copy_with(scheme=to.scheme, host=to.host, port=to.port)
            request.headers["Host"] = to.netloc.decode("ascii")
            try:
                response = await self.inner.handle_async_request(request)
            except DOWN as exc:
                error = exc
                continue
            if k != self.current:
                log.warning("tracker %s answers in place of %s", to, self.urls[self.current])
                self.current = k
            return response
        raise error

    async def aclose(self) -> None:
        await self.inner.aclose()


def tracker_client(
    urls: str | Sequence[str], access: AccessConfig, timeout_s: float = 10.0
) -> httpx.AsyncClient:
    """An httpx client for a mesh's trackers (`urls`, in the order to try them) that signs
    every call with the swarm key and refuses an answer it did not sign."""
    urls = [urls] if isinstance(urls, str) else list(urls)
    if not urls:
        raise ConfigError("no tracker URL")
    verify = client_context(access.tls)
    inner = httpx.AsyncHTTPTransport(verify=verify)
    return httpx.AsyncClient(
        base_url=urls[0],
        timeout=timeout_s,
        auth=Signer(access.swarm_key).auth(TRACKER),
        transport=Failover(urls, inner) if len(urls) > 1 else inner,
    )


def check_trackers(urls: Sequence[str], verify: ssl.SSLContext | bool = True) -> list[str]:
    """At start: `ConfigError` naming both when two trackers offer different models; the
    trackers that cannot be reached or answer garbage are logged and returned (the node
    starts with the others, and keeps trying them)."""
    offered: dict[str, list[str]] = {}
    unreached = []
    with httpx.Client(timeout=3.0, verify=verify) as client:
        for url in urls:
            try:
                models = client.get(url + "/health").json()["models"]
                offered[url] = sorted(str(m) for m in models)
            except httpx.HTTPError as exc:
                log.warning("tracker %s cannot be reached (%s); starting with the others", url, exc)
                unreached.append(url)
            except (ValueError, KeyError, TypeError):
                log.warning("tracker %s answers garbage to /health; starting with the others", url)
                unreached.append(url)
    (first, models), *others = list(offered.items()) or [("", [])]
    for url, theirs in others:
        if theirs != models:
            raise ConfigError(
                f"trackers {first} and {url} offer different models ({models} and {theirs}): "
                "they are not one mesh's trackers"
            )
    return unreached

"""The registration probe: is a registering node reachable, at the address it claims, and a
member? The tracker calls the node's `GET /v1/identity?challenge=...` (signed) and checks the
node id and the challenge proof in the answer (ADR-0017)."""

from __future__ import annotations

import asyncio
import json
import secrets
import ssl
from typing import Protocol

import httpx

from meshnet.errors import MeshError
from meshnet.security.signing import Signer
from meshnet.security.swarm import challenge_proof

MAX_ANSWER_BYTES = 4096  # an identity answer is ~150 bytes
# one text for every way a probe fails: no oracle for what is (or is not) at an address
PROBE_FAILED = (
    "node {} did not answer the tracker's probe at {} as a member; it must be reachable by "
    "the tracker at the address it registers, and hold the mesh's swarm key"
)


class ProbeError(MeshError):
    """A registering node failed the probe; it is not counted."""

    http_status = 400


class Prober(Protocol):
    async def probe(self, node_id: str, address: str) -> None:
        """Return when `address` answers as `node_id` with a valid proof; else `ProbeError`."""
        ...

    async def reachable(self, address: str) -> bool:
        """False only when nothing listens at `address` (connection refused): the process
        is gone. A slow or odd answer counts as reachable; heartbeat expiry handles those."""
        ...


class HttpProber:
    """Probes over HTTP with a signed request; a short timeout keeps registration quick."""

    def __init__(
        self,
        signer: Signer,
        timeout_s: float = 3.0,
        transport: httpx.AsyncBaseTransport | None = None,
        verify: ssl.SSLContext | bool = True,
    ) -> None:
        self.signer = signer
        self.verify = verify  # https addresses: the mesh's CA (or the system's)
        self.timeout_s = timeout_s
        self.transport = transport  # None = the network; tests pass an ASGI transport

    async def probe(self, node_id: str, address: str) -> None:
        challenge = secrets.token_hex(16)
        try:
            async with asyncio.timeout(self.timeout_s):  # in all: a trickled answer ends too
                status, body = await self._get(node_id, address, challenge)
            answer = json.loads(body) if status == 200 else {}
        except (httpx.HTTPError, httpx.InvalidURL, ValueError, TimeoutError) as exc:
            raise ProbeError(PROBE_FAILED.format(node_id, address), field="address") from exc
        if status != 200 or not isinstance(answer, dict):
            raise ProbeError(PROBE_FAILED.format(node_id, address), field="address")
        self._check_answer(node_id, address, challenge, answer)

    async def _get(self, node_id: str, address: str, challenge: str) -> tuple[int, bytes]:
        """The identity answer's status and at most `MAX_ANSWER_BYTES` of its body, read as
        sent (an encoded body is never inflated)."""
        headers = {"Accept-Encoding": "identity"}
        async with (
            httpx.AsyncClient(
                timeout=self.timeout_s,
                auth=self.signer.auth(node_id, answers=False),  # the answer carries a proof
                transport=self.transport,
                verify=self.verify,
            ) as http,
            http.stream(
                "GET", f"{address}/v1/identity", params={"challenge": challenge}, headers=headers
            ) as response,
        ):
            body = b""
            async for piece in response.aiter_raw():
                body += piece
                if len(body) > MAX_ANSWER_BYTES:
                    raise ValueError("the identity answer is too long")
            return response.status_code, body

    def _check_answer(
        self, node_id: str, address: str, challenge: str, answer: dict[str, object]
    ) -> None:
        key = self.signer.key
        expected = challenge_proof(key, challenge, node_id) if key else ""
        if answer.get("node_id") != node_id or answer.get("proof") != expected:
            raise ProbeError(PROBE_FAILED.format(node_id, address), field="address")

    async def reachable(self, address: str) -> bool:
        try:
            client = httpx.AsyncClient(timeout=0.5, transport=self.transport, verify=self.verify)
            async with client as http:
                await http.get(f"{address}/health")
        except httpx.ConnectError:
            return False
        except (httpx.HTTPError, httpx.InvalidURL):
            return True
        return True


class TrustingProber:
    """The fake: every node is reachable (in-process tests with made-up addresses)."""

    def __init__(self) -> None:
        self.probed: list[tuple[str, str]] = []
        self.gone: set[str] = set()  # addresses that refuse connections, as a killed process

    async def probe(self, node_id: str, address: str) -> None:
        self.probed.append((node_id, address))
        if address in self.gone:
            raise ProbeError(f"{address} refuses connections", field="address")

    async def reachable(self, address: str) -> bool:
        return address not in self.gone


class OwnNodeTrusted:
    """Probes every node but the tracker's own entry node (tracker-as-node).

    That one registers in-process while its server is still starting, before any other node
    can be planned around it; probing it would race its own start-up. Another process
    registering the same id and address would pass the probe anyway: the address answers
    with that id.
    """

    def __init__(self, inner: Prober, node_id: str, address: str) -> None:
        self.inner = inner
        self.own = (node_id, address)

    async def probe(self, node_id: str, address: str) -> None:
        if (node_id, address) != self.own:
            await self.inner.probe(node_id, address)

    async def reachable(self, address: str) -> bool:
        return address == self.own[1] or await self.inner.reachable(address)

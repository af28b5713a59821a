"""The registration probe: is a registering node reachable, at the address it claims, and a
member? The tracker calls the node's `GET /v1/identity?challenge=...` (signed) and checks the
node id and the challenge proof in the answer (ADR-0017)."""

from __future__ import annotations

import secrets
from typing import Protocol

import httpx

from meshnet.errors import MeshError
from meshnet.security.signing import Signer
from meshnet.security.swarm import challenge_proof


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
    ) -> None:
        self.signer = signer
        self.timeout_s = timeout_s
        self.transport = transport  # None = the network; tests pass an ASGI transport

    async def probe(self, node_id: str, address: str) -> None:
        challenge = secrets.token_hex(16)
        try:
            async with httpx.AsyncClient(
                timeout=self.timeout_s, auth=self.signer.auth(), transport=self.transport
            ) as http:
                response = await http.get(f"{address}/v1/identity", params={"challenge": challenge})
            answer = response.json() if response.status_code == 200 else {}
        except (httpx.HTTPError, ValueError) as exc:
            raise ProbeError(
                f"node {node_id} is not reachable at {address} ({type(exc).__name__}); it must "
                "be reachable by the tracker at the address it registers",
                field="address",
            ) from exc
        if response.status_code != 200:
            raise ProbeError(
                f"{address} refused the tracker's probe ({response.status_code})", field="address"
            )
        self._check_answer(node_id, address, challenge, answer)

    def _check_answer(
        self, node_id: str, address: str, challenge: str, answer: dict[str, object]
    ) -> None:
        key = self.signer.key
        expected = challenge_proof(key, challenge, node_id) if key else ""
        if answer.get("node_id") != node_id or answer.get("proof") != expected:
            raise ProbeError(
                f"{address} does not answer as node {node_id} with a valid proof", field="address"
            )

    async def reachable(self, address: str) -> bool:
        try:
            async with httpx.AsyncClient(timeout=0.5, transport=self.transport) as http:
                await http.get(f"{address}/health")
        except httpx.ConnectError:
            return False
        except httpx.HTTPError:
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

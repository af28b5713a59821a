"""TLS end to end (issue #20 item 6): a tracker and a node, real processes, serving https
with certificates signed by a CA made in the test; the node registers an https address,
the tracker probes it over TLS, and a client that does not trust the CA is refused."""

from __future__ import annotations

import asyncio
import datetime
import ipaddress
import ssl
from pathlib import Path

import httpx
import pytest
import torch
import uvicorn
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from meshnet.assemble.http import ServerLimits, server_config
from meshnet.config import TlsConfig
from meshnet.entry.transport import HttpTransport
from meshnet.errors import HopError
from meshnet.node.app import create_app as create_node_app
from meshnet.node.runner import EchoRunner
from meshnet.security.tls import client_context, server_options
from meshnet.status import fetch_coverage
from meshnet.types import Hop, LayerSpan, ModelId, NodeId
from meshnet.wire import FrameMeta
from tests.conftest import run
from tests.e2e.procs import free_port, start, stop, wait_for
from tests.owned import new_session


def _name(text: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, text)])


def make_ca_and_cert(folder: Path) -> tuple[Path, Path, Path]:
    """A CA, and a certificate it signed for 127.0.0.1 and localhost: (ca, cert, key)."""
    now = datetime.datetime.now(datetime.UTC)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = (
        x509.CertificateBuilder()
        .subject_name(_name("meshnet test CA"))
        .issuer_name(_name("meshnet test CA"))
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    key = ec.generate_private_key(ec.SECP256R1())
    names = [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name("localhost"))
        .issuer_name(ca.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName(names), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    paths = folder / "ca.pem", folder / "cert.pem", folder / "key.pem"
    paths[0].write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    paths[1].write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    paths[2].write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return paths


@pytest.mark.slow
def test_a_tracker_and_a_node_talk_https_only(tmp_path: Path) -> None:
    ca, cert, key = make_ca_and_cert(tmp_path)
    tls = ["--tls-cert", str(cert), "--tls-key", str(key), "--tls-ca", str(ca)]
    port, node_port = free_port(), free_port()
    url = f"https://127.0.0.1:{port}"
    env_key = tmp_path / "swarm.key"
    tracker = start(
        ["tracker", "--port", str(port), "--swarm-key-file", str(env_key), *tls],
        tmp_path / "tracker.log",
    )
    node = None
    try:
        trusted = ssl.create_default_context(cafile=str(ca))
        wait_for(lambda: _answers(f"{url}/health", trusted), 60, "the https tracker")
        node = start(
            ["node", "--tracker", url, "--port", str(node_port), "--quant", "fp32"]
            + ["--no-entry", "--budget", "165MB", "--data-dir", str(tmp_path / "node")]
            + ["--swarm-key-file", str(env_key), *tls],
            tmp_path / "node.log",
        )

        def registered() -> bool:
            nodes = fetch_coverage(url, ca_file=str(ca))["nodes"]
            return any(n["address"] == f"https://127.0.0.1:{node_port}" for n in nodes)

        wait_for(registered, 60, "the node to register its https address (probed over TLS)")
        with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
            httpx.get(f"{url}/health")  # the system's CAs do not know the mesh's
        with pytest.raises(httpx.HTTPError):
            httpx.get(f"http://127.0.0.1:{port}/health", timeout=5)  # no plain http either
    finally:
        for process in (node, tracker):
            if process is not None:
                stop(process)


def _answers(url: str, verify: ssl.SSLContext) -> bool:
    try:
        return httpx.get(url, verify=verify, timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def test_frames_cross_an_https_hop_with_the_mesh_ca(tmp_path: Path) -> None:
    """The activation plane over TLS: the real uvicorn settings serve a node app with the
    certificate, and the entry's transport trusts it through the CA file only."""
    ca, cert, key = make_ca_and_cert(tmp_path)
    tls = TlsConfig(str(cert), str(key), str(ca))
    app = create_node_app(EchoRunner(ModelId("m"), LayerSpan(2, 4)))

    async def scenario() -> list[object]:
        config = server_config(app, "127.0.0.1", 0, ServerLimits(), **server_options(tls))
        server = uvicorn.Server(config)
        task = asyncio.create_task(server.serve())
        while not server.started:
            await asyncio.sleep(0.01)
        port = server.servers[0].sockets[0].getsockname()[1]
        hop = Hop(NodeId("unregistered"), f"https://127.0.0.1:{port}", LayerSpan(2, 4))
        meta = FrameMeta(new_session(), ModelId("m"), LayerSpan(2, 4), 0)
        results: list[object] = []
        for context in (client_context(tls), client_context(TlsConfig())):
            transport = HttpTransport(tls=context)
            try:
                results.append(await transport.forward(hop, meta, torch.ones(1, 3, 8)))
            except HopError as exc:
                results.append(exc)
            finally:
                await transport.aclose()
            meta = FrameMeta(new_session(), ModelId("m"), LayerSpan(2, 4), 0)
        server.should_exit = True
        await task
        return results

    trusted, untrusted = run(scenario())
    assert isinstance(trusted, torch.Tensor) and trusted.shape == (1, 3, 8)
    assert isinstance(untrusted, HopError) and "certificate" in untrusted.message.lower()

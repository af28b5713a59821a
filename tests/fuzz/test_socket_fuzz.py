"""Fuzzing at the socket (issue #20's "done when"): raw bytes against a real uvicorn running
our server settings in front of a node app with a swarm key, and arbitrary answers against
the real registration prober. Nothing may crash either: every answer below 500 (or a closed
connection), the server still healthy after; every probe failure the one text."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from meshnet.config import AccessConfig
from meshnet.node.app import create_app
from meshnet.node.runner import EchoRunner
from meshnet.security.signing import Signer
from meshnet.tracker.probe import HttpProber, ProbeError
from meshnet.types import LayerSpan, ModelId
from tests.conftest import run
from tests.fuzz.harness import KEY, record, report
from tests.security.test_server import serving


@pytest.fixture(scope="module")
def node_port() -> Iterator[int]:
    app = create_app(EchoRunner(ModelId("m"), LayerSpan(0, 2)), access=AccessConfig(KEY))
    with serving(app) as port:  # our server settings, with short limits
        yield port


def exchange(port: int, data: bytes, wait_s: float = 0.3) -> bytes:
    """Send `data`; what comes back until the answer's headers are in, the server closes, or
    `wait_s` passes in silence (an incomplete request: the server waits for the rest)."""
    with socket.create_connection(("127.0.0.1", port), timeout=wait_s) as sock:
        got = b""
        try:
            sock.sendall(data)
            while b"\r\n\r\n" not in got and (chunk := sock.recv(65536)):
                got += chunk
        except OSError:  # reset, or quiet for wait_s
            pass
    return got


tokens = st.text(st.characters(codec="latin-1"), max_size=40)
printable = st.text(st.characters(min_codepoint=33, max_codepoint=126), max_size=40)
names = st.text("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-", min_size=1)
request_lines = st.one_of(
    st.builds(
        lambda m, p, v: f"{m} {p} {v}",
        st.sampled_from(["GET", "POST", "POST", "POST", "DELETE", "PUT", "BREW", "get"]),
        st.one_of(
            st.sampled_from(["/forward", "/health", "/sessions/x", "/v1/identity", "//x", "*"]),
            tokens.map(lambda t: "/" + t.replace(" ", "")),
        ),
        st.sampled_from(["HTTP/1.1"] * 6 + ["HTTP/1.0", "HTTP/2", "HTTP/9.9", ""]),
    ),
)
headers = st.lists(
    st.tuples(
        st.one_of(
            st.sampled_from(
                [
                    "Content-Length",
                    "Transfer-Encoding",
                    "X-Meshnet-Auth",
                    "X-Meshnet-Shape",
                    "Host",
                    "Content-Encoding",
                    "Expect",
                ]
            ),
            names,
            printable,  # mostly not a valid name: 400 from the parser
        ),
        st.one_of(printable, tokens),
    ),
    max_size=8,
)


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(line=request_lines, fields=headers, body=st.binary(max_size=300))
def test_raw_requests_never_get_a_5xx_and_the_node_stays_up(
    node_port: int, line: str, fields: list[tuple[str, str]], body: bytes
) -> None:
    if all(k.lower() not in ("content-length", "transfer-encoding") for k, _ in fields):
        fields = [*fields, ("Content-Length", str(len(body)))]  # else: the body as given
    fields = [("Host", "localhost"), *fields]
    head = line + "\r\n" + "".join(f"{k}: {v}\r\n" for k, v in fields) + "\r\n"
    answer = exchange(node_port, head.encode("latin-1") + body)
    status = answer.split(b"\r\n", 1)[0].split(b" ")
    code = int(status[1]) if len(status) > 1 and status[1].isdigit() else 0
    record("uvicorn+guard raw request", code)  # 0: closed, or waiting for the rest
    assert code < 500, answer[:300]


def test_the_node_answers_after_the_raw_requests(node_port: int) -> None:
    answer = exchange(node_port, b"GET /health HTTP/1.1\r\nHost: localhost\r\n\r\n")
    assert answer.startswith(b"HTTP/1.1 200")
    print(report())


class RawServer:
    """Answers every connection with `self.reply`, whatever it was asked."""

    def __init__(self) -> None:
        self.reply = b""
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        threading.Thread(target=self._loop, daemon=True).start()

    def _loop(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with conn:
                conn.settimeout(1.0)
                try:
                    conn.recv(65536)
                    conn.sendall(self.reply)
                except OSError:
                    pass


@pytest.fixture(scope="module")
def raw_server() -> Iterator[RawServer]:
    server = RawServer()
    yield server
    server.sock.close()


answers = st.one_of(
    st.binary(max_size=400),
    st.builds(
        lambda status, fields, body: (
            (
                f"HTTP/1.1 {status} X\r\n" + "".join(f"{k}: {v}\r\n" for k, v in fields) + "\r\n"
            ).encode("latin-1")
            + body
        ),
        st.integers(100, 599),
        st.lists(
            st.tuples(
                st.sampled_from(
                    [
                        "Content-Length",
                        "Content-Encoding",
                        "Transfer-Encoding",
                        "Content-Type",
                        "Location",
                    ]
                ),
                tokens,
            ),
            max_size=4,
        ),
        st.one_of(
            st.binary(max_size=300),
            st.sampled_from([b'{"node_id": "n1", "proof": ""}', b"{}", b"[]", b"null"]),
        ),
    ),
)


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(reply=answers)
def test_any_answer_fails_the_real_prober_with_one_text(
    raw_server: RawServer, reply: bytes
) -> None:
    raw_server.reply = reply
    prober = HttpProber(Signer(KEY), timeout_s=0.5)
    started = time.monotonic()
    with pytest.raises(ProbeError) as failed:
        run(prober.probe("n1", f"http://127.0.0.1:{raw_server.port}"))
    assert time.monotonic() - started < 2.0
    assert failed.value.field == "address"
    assert "did not answer the tracker's probe" in failed.value.message
    record("prober against raw answers", 400)

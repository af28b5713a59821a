"""Hypothesis against `POST /forward` of a node running a real (tiny, random) llama shard.

Each case mutates a valid frame that would continue a live session: headers (any subset, any
value), body (valid, cut, random, compressed garbage), encodings, shapes, positions, sessions.
The answer must be below 500. Then the live session's correct next step must give exactly
the reference output (its cache was not corrupted), and once the session is closed the node
holds no session (none leaked).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
import torch
import zstandard
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from meshnet.config import AccessConfig, WireLimits
from meshnet.errors import MeshError
from meshnet.models.loader import load_shard
from meshnet.models.source import resolve
from meshnet.node.app import create_app
from meshnet.node.torch_runner import TorchShardRunner
from meshnet.types import LayerSpan, ModelId, SessionId
from meshnet.wire import FrameMeta, decode
from meshnet.wire import headers as h
from tests.conftest import run
from tests.fuzz.harness import KEY, SigningProxy, record, report
from tests.owned import close_proof, encode, new_session, proof
from tests.wire.test_fuzz import values

pytestmark = pytest.mark.slow
SPAN, MODEL = LayerSpan(2, 4), ModelId("tiny")
PREFILL, STEP = torch.randn(1, 4, 64), torch.randn(1, 1, 64)
LIMITS = WireLimits(max_body_bytes=1 << 16, max_tensor_bytes=1 << 16)
LIVE, OTHER = new_session(), new_session()

bodies = st.one_of(
    st.just("valid"),
    st.just("cut"),
    st.binary(max_size=600),
    st.binary(max_size=300).map(lambda b: zstandard.ZstdCompressor().compress(b)),
)
choices = {
    **values,
    h.SESSION: st.sampled_from([LIVE, OTHER, "", "a b", "x" * 200]),
    h.LAYERS: st.sampled_from(["2:4", "0:2", "2:5", "4:2", "x"]),
    h.MODEL: st.sampled_from(["tiny", "other", ""]),
    h.SHAPE: st.sampled_from(["1,1,64", "1,2,64", "2,1,64", "1,1,63", "1,0,64", "1,9999,64"]),
    h.POSITION: st.sampled_from(["0", "3", "4", "5", "2047", "4096", "-1"]),
}
one_change = st.sampled_from(sorted(choices)).flatmap(lambda k: choices[k].map(lambda v: {k: v}))
overrides = st.one_of(one_change, st.fixed_dictionaries({}, optional=choices))  # type: ignore[arg-type]


def session_frame(sid: str, position: int, hidden: torch.Tensor) -> tuple[dict[str, str], bytes]:
    frame = encode(hidden, FrameMeta(SessionId(sid), MODEL, SPAN, position))
    return dict(frame.headers), bytes(frame.body)


@pytest.fixture(scope="module")
def shard_runner(tiny_folder: Callable[[str], Path]) -> Callable[[], TorchShardRunner]:
    shard = load_shard(resolve(str(tiny_folder("llama"))), SPAN, "fp32")
    return lambda: TorchShardRunner(MODEL, shard)


def reference(make: Callable[[], TorchShardRunner]) -> torch.Tensor:
    runner = make()
    runner.forward(FrameMeta(SessionId("r"), MODEL, SPAN, 0), PREFILL.to(torch.bfloat16))
    return runner.forward(FrameMeta(SessionId("r"), MODEL, SPAN, 4), STEP.to(torch.bfloat16))


def test_forward_fuzz_never_crashes_corrupts_or_leaks(
    shard_runner: Callable[[], TorchShardRunner],
) -> None:
    expected = reference(shard_runner)
    runner = shard_runner()
    app = SigningProxy(create_app(runner, LIMITS, access=AccessConfig(KEY)), "unregistered")

    async def post(headers: dict[str, str], body: bytes) -> httpx.Response:
        raw = {k: v.encode() for k, v in headers.items()}  # any bytes may arrive in a header
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://node") as client:
            return await client.post("/forward", headers=raw, content=body)

    async def delete(sid: str) -> None:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://node") as client:
            await client.delete(f"/sessions/{sid}", headers=close_proof(sid, "unregistered"))

    @settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
    @given(
        changes=overrides,
        body=st.one_of(st.just("valid"), bodies),
        drop=st.sets(st.sampled_from(list(values)), max_size=1),
    )
    def one(changes: dict[str, str], body: object, drop: set[str]) -> None:
        for sid in (LIVE, OTHER):  # a failed example may have left them
            run(delete(sid))
        live_headers, live_body = session_frame(LIVE, 0, PREFILL)
        assert run(post(live_headers, live_body)).status_code == 200
        headers, valid = session_frame(LIVE, 4, STEP)
        headers = {k: v for k, v in (headers | changes).items() if k not in drop}
        with contextlib.suppress(MeshError):  # signed anew, as its entry would: the node
            headers |= proof(h.parse_meta(h.lower_keys(headers)), STEP)  # judges the change
        payload = {"valid": valid, "cut": valid[:-3]}.get(body, body)  # type: ignore[call-overload]
        response = run(post(headers, payload))
        record("node POST /forward", response.status_code)
        assert response.status_code < 500, response.text
        if response.status_code >= 400:
            assert response.json()["error"]["message"]
            step_headers, step_body = session_frame(LIVE, 4, STEP)
            step = run(post(step_headers, step_body))
            assert step.status_code == 200, step.text
            assert torch.equal(decode(step.headers, step.content)[1], expected)
        for sid in (LIVE, OTHER):
            run(delete(sid))
        assert runner.session_count() == 0

    one()
    print(report())

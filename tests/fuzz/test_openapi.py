"""Schemathesis against the served OpenAPI documents of the tracker and of the API.

Every operation gets schema-conforming and schema-violating cases; each answer must be below
500 (a 4xx with a JSON error body when refused), and after each case a correct request must
still give the right result: the tracker still routes over a known node, the API still
completes "abc" with "def" and leaves no session and no in-flight slot behind.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest
import schemathesis
from fastapi import FastAPI
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode
from starlette.testclient import TestClient

from meshnet.api.app import create_app as create_api_app
from meshnet.config import AccessConfig, ApiLimits, TrackerConfig
from meshnet.security.limits import ClientLimiter
from meshnet.tracker.app import create_app as create_tracker_app
from meshnet.tracker.planner import ModelOffer
from meshnet.tracker.probe import TrustingProber
from meshnet.tracker.registry import Registry
from meshnet.types import ModelId
from tests.entry.fakes import fake_mesh
from tests.fuzz.harness import API_KEY, KEY, SigningProxy, record, report

pytestmark = pytest.mark.slow
MB = 1 << 20
EXAMPLES = 30  # per operation and mode
ANCHOR = {
    "node_id": "anchor",
    "address": "http://127.0.0.1:9",
    "budget_bytes": 400 * MB,
    "quant": "fp32",
    "throughput": 1.0,
    "loaded": [{"model": "m", "span": {"start": 0, "end": 30}}],
}


def tracker() -> tuple[FastAPI, Callable[[TestClient], None]]:
    offers = [ModelOffer(ModelId("m"), 30, {q: 10 * MB for q in ("fp32", "bf16", "int8", "nf4")})]
    registry = Registry(offers, {ModelId("m"): "m"}, dead_after_s=600.0, clock=time.monotonic)
    app = create_tracker_app(
        registry, TrackerConfig(route_seed=0), prober=TrustingProber(), access=AccessConfig(KEY)
    )

    token: list[str] = []  # the anchor's membership token: it registers again with it (N5)

    def still_right(client: TestClient) -> None:
        kept = {"token": token[-1]} if token else {}
        again = client.post("/v1/nodes/register", json=ANCHOR | kept)
        assert again.status_code == 200, again.text
        token.append(again.json()["token"])
        route = client.get("/v1/route", params={"model": "m"})
        assert route.status_code == 200, route.text
        ends = [(h["span"]["start"], h["span"]["end"]) for h in route.json()["hops"]]
        assert ends[0][0] == 0 and ends[-1][1] == 30
        assert all(a[1] == b[0] for a, b in zip(ends, ends[1:], strict=False))

    return app, still_right


def api() -> tuple[FastAPI, Callable[[TestClient], None]]:
    generator, _, runners = fake_mesh()
    limits = ApiLimits(requests_per_minute=0, max_tokens=64)
    limiter = ClientLimiter(limits)
    access = AccessConfig(KEY, api_keys=(API_KEY,))
    app = create_api_app({"fake": generator}, 8, limits=limits, access=access, limiter=limiter)

    def still_right(client: TestClient) -> None:
        body = {"model": "fake", "prompt": "abc", "max_tokens": 3, "temperature": 0}
        answer = client.post("/v1/completions", json=body)
        assert answer.status_code == 200 and answer.json()["choices"][0]["text"] == "def"
        assert all(r.session_count() == 0 for r in runners.values())
        assert limiter.in_flight == {}

    return app, still_right


def operations(build: Callable[[], tuple[FastAPI, Any]]) -> list[tuple[str, bool]]:
    """(operation, whether it takes any input a negative case could violate)."""
    app, _ = build()
    schema = schemathesis.openapi.from_asgi("/openapi.json", app)
    found = [o.ok() for o in schema.get_all_operations()]
    return [(f"{o.method.upper()} {o.path}", bool(o.body) or len(o.query) > 0) for o in found]


CASES = [
    (name, build, op, mode)
    for name, build in (("tracker", tracker), ("api", api))
    for op, has_input in operations(build)
    for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE)
    if has_input or mode == GenerationMode.POSITIVE
]


@pytest.mark.parametrize(
    ("name", "build", "operation", "mode"),
    CASES,
    ids=[f"{c[0]} {c[2]} {c[3].value}" for c in CASES],
)
def test_openapi_operations_never_crash_and_leave_the_app_right(
    name: str, build: Callable[[], tuple[FastAPI, Any]], operation: str, mode: GenerationMode
) -> None:
    app, still_right = build()
    signed = SigningProxy(app)
    schema = schemathesis.openapi.from_asgi("/openapi.json", app)
    method, path = operation.split(" ")
    strategy = schema[path][method].as_strategy(generation_mode=mode)

    @settings(
        max_examples=EXAMPLES,
        deadline=None,
        suppress_health_check=list(HealthCheck),
        database=None,
    )
    @given(case=strategy)
    def one(case: Any) -> None:
        if name == "api" and mode == GenerationMode.POSITIVE and isinstance(case.body, dict):
            case.body["model"] = "fake"  # reach generation with every other field as generated
        request = case.as_transport_kwargs(base_url="http://testserver")
        request.pop("cookies", None)  # none are generated; httpx deprecates the argument
        if isinstance(request.get("data"), str | bytes):  # raw bodies of negative cases
            request["content"] = request.pop("data")
        try:
            response = client.request(**request)
        except Exception as exc:  # the test client itself refuses to send it (a huge query)
            if type(exc).__name__ == "InvalidURL":
                return
            raise
        record(f"{name} {operation}", response.status_code)
        assert response.status_code < 500, response.text
        if response.status_code >= 400:
            error = response.json()["error"]
            assert error["message"] and "type" in error
        still_right(client)

    with TestClient(signed, client=("127.0.0.1", 50000)) as client:
        one()
    print(report())

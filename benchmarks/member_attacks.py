"""The review of 2026-12-07's member attacks that need no node process (`attacks.py` runs
them after its own rows): W1, W2 against the `Fetcher` as a node builds it, L1 against a
tracker's `Registry`, P1 against an entry's guard and prefix index, K1 against the ggml KV
pool and a node's KV caps. Each over real HTTP servers where the attack is.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import tempfile
import time
import tracemalloc
import zlib
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import numpy as np
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from attacks import KEY, MiB, Row, free_port  # benchmarks/attacks.py
from meshnet.api.app import access_rules
from meshnet.assemble.http import in_thread
from meshnet.config import AccessConfig, ApiLimits, NodeConfig
from meshnet.entry.prefixes import PrefixIndex, scope_of
from meshnet.entry.session import PipelineSession
from meshnet.errors import WeightsError
from meshnet.http_errors import install_error_handlers
from meshnet.models.ggml_span import GgmlSpan
from meshnet.models.source import default_gguf, resolve
from meshnet.node.startup import kept_bytes, live_bytes
from meshnet.observe.metrics import Metrics
from meshnet.security.access import Credentials, Guard, client_of, key_tag
from meshnet.security.signing import Signer
from meshnet.security.vouch import VOUCH_HEADER, TrackerIdentity, TrackerKeys
from meshnet.tracker import messages as msg
from meshnet.tracker.lease import Lease
from meshnet.tracker.offers import offer
from meshnet.tracker.registry import Registry
from meshnet.types import LayerSpan, ModelId, SessionId
from meshnet.weights.fetch import CALL_TIMEOUT_S, Fetcher, Holder
from meshnet.weights.manifest import Manifest, make_manifest
from meshnet.weights.serve import WeightServer, add_weight_routes, weight_rules
from meshnet.weights.store import WeightStore


def serving(app: Starlette) -> contextlib.AbstractContextManager[int]:
    """`app` under uvicorn as meshnet configures it, in a thread of this process: its port."""
    return in_thread(app, free_port())


def honest_holder(store: WeightStore) -> Starlette:
    """The tracker serving what `store` holds, to members only, as trackers and nodes do."""
    credentials = Credentials(AccessConfig(swarm_key=KEY), frozenset({"tracker"}))
    app = Starlette(middleware=[Middleware(Guard, rules=weight_rules(), credentials=credentials)])
    install_error_handlers(app)
    add_weight_routes(app, WeightServer(store))
    return app


def hostile_holder(bomb: bytes, every_s: float) -> Starlette:
    """A member posing as a holder (review W1, W2): `bomb` (gzip) as every answer; without
    one, a body that never ends, 1 byte each `every_s`."""

    async def answer(request: Request) -> Response:
        if bomb:
            return Response(bomb, headers={"Content-Encoding": "gzip"})

        async def drip() -> AsyncIterator[bytes]:
            while True:
                yield b"\0"
                await asyncio.sleep(every_s)

        return StreamingResponse(drip(), status_code=206)

    app = Starlette()
    app.add_route("/v1/weights/{digest}/manifest", answer)
    app.add_route("/v1/weights/{digest}/parts/{name}", answer)
    return app


def gzip_zeros(nbytes: int) -> bytes:
    """`nbytes` of zeros gzipped (level 9: ~1 MB a GiB), deflated 1 MiB at a time."""
    packer = zlib.compressobj(9, zlib.DEFLATED, 31)  # wbits 31: a gzip header and trailer
    zeros = bytes(MiB)
    return b"".join([*(packer.compress(zeros) for _ in range(nbytes // MiB)), packer.flush()])


FETCHED = LayerSpan(10, 12)  # two layers of the default model: ~4.2 MiB in 18 parts


def fetch_past(liar: int, honest: int, manifest: Manifest, deadline_s: float) -> tuple[str, str]:
    """The real `Fetcher` as a node builds it (`node/weights.py`: the directive's holders, the
    liar first, then the tracker, which gives the manifest) fetching FETCHED: what it did,
    and "seconds / MiB": until the fetch ended, and the peak traced (this process, both
    holders' serving threads included: an upper bound)."""
    holders = [Holder("node-liar", f"http://127.0.0.1:{liar}")]
    holders.append(Holder("tracker", f"http://127.0.0.1:{honest}"))
    metrics = Metrics()
    with tempfile.TemporaryDirectory() as root:
        fetcher = Fetcher(
            WeightStore(Path(root)), holders, signer=Signer(KEY), metrics=metrics,
            timeout_s=deadline_s, manifest_from=holders[1],
        )  # fmt: skip
        tracemalloc.start()
        started = time.monotonic()
        try:
            parts = lambda m: m.span_parts(FETCHED, entry=False)  # noqa: E731
            asyncio.run(fetcher.fetch(manifest.digest, parts))
            outcome = fetched(metrics, "node-liar" in fetcher.left)
        except WeightsError as exc:
            outcome = f"refused: {exc}"[:80]
        finally:
            took, peak = time.monotonic() - started, tracemalloc.get_traced_memory()[1]
            tracemalloc.stop()
    return outcome, f"{took:.1f} / {peak / MiB:.1f}"


def fetched(metrics: Metrics, left: bool) -> str:
    """Whose bytes a fetch took and why it refused answers, from the fetcher's own metrics."""

    def count(name: str, **labels: str) -> float:
        return metrics.registry.get_sample_value(f"meshnet_weights_{name}_total", labels) or 0.0

    peers = [p for p in ("tracker", "node-liar") if count("fetched_bytes", peer=p)]
    whys = [w for w in ("encoded", "too_long", "deadline", "hash") if count("refused", why=w)]
    source = "the honest holder" if peers == ["tracker"] else " and ".join(peers) or "nobody"
    return f"from {source}; liar {'left' if left else 'kept'} ({', '.join(whys) or 'no refusal'})"


def weight_rows(tiny: bool) -> list[Row]:
    """W1, W2: a member posing as the first holder of a node's parts, the tracker second."""
    bomb = gzip_zeros(1 << 30)  # 1 GiB inflated, as in the review
    # a byte well inside each read's timeout (httpx's, 30 s, was all there was): only a
    # deadline on the whole range ends it; the tiny run shortens both
    every_s, deadline_s = (0.25, 1.0) if tiny else (5.0, CALL_TIMEOUT_S)
    manifest = make_manifest(default_gguf())  # one read of its ~98 MB (hashing)
    w1 = f"W1 holder answering 1 GiB of zeros in {len(bomb) / MiB:.1f} MiB of gzip"
    w2 = f"W2 holder sending 1 byte / {every_s:g} s ({deadline_s:.0f} s deadline)"
    rows: list[Row] = []
    with tempfile.TemporaryDirectory() as root:
        store = WeightStore(Path(root))
        store.offer_file(default_gguf(), manifest)
        with serving(honest_holder(store)) as honest:
            for name, app, limit_s in (
                (w1, hostile_holder(bomb, 0), CALL_TIMEOUT_S),
                (w2, hostile_holder(b"", every_s), deadline_s),
            ):
                with serving(app) as liar:
                    outcome, figure = fetch_past(liar, honest, manifest, limit_s)
                rows.append((name, outcome, figure, "s until fetched / MiB traced at peak"))
    return rows


def lease_rows() -> list[Row]:
    """L1: a member registers and beats with the highest term a message may carry, to one of
    three trackers' registries (in process, as its HTTP routes call it); then that tracker
    asks the others for the lease, as `tracker/peering.py` does."""
    urls, now, huge = ["http://t1", "http://t2", "http://t3"], 10.0, 1 << 62
    registry = Registry(
        [offer("default")], {ModelId("default"): "default"}, dead_after_s=6.0, clock=lambda: now
    )
    registry.lease = Lease(urls[0], urls, 3.0, 0.0)
    registry.register(
        msg.RegisterRequest(
            node_id="member", address="http://127.0.0.1:9001", budget_bytes=300 * 10**6,
            quant="fp32", throughput=1.0, term=huge,
        )
    )  # fmt: skip
    registry.heartbeat(msg.HeartbeatRequest(node_id="member", term=huge))
    ask = registry.lease.ask(now)
    own = registry.lease.vote(ask, now)
    grants = [Lease(url, urls, 3.0, 0.0).vote(ask, now) for url in urls[1:]]
    won = registry.lease.tally(ask, now, own, grants) and registry.plans_now()
    answer = f"next term {ask.term}: {'plans' if won else 'does not plan (!)'}"
    return [("L1 registration and heartbeat with term 2**62", answer, ask.term, "term asked")]


VICTIM_KEY = "victim-client-api-key-0001"  # the client whose kept prompt a member is after
VICTIM_PROMPT = tuple(range(1000, 1000 + 4 * 64))  # 4 whole blocks (BLOCK_TOKENS) of token ids
TRACKER = TrackerIdentity()  # the tracker the entry registered with


def scope_app(index: PrefixIndex, keys: TrackerKeys) -> Starlette:
    """An entry's API guard as `api/app.py` builds it (API keys, the swarm key, the trackers
    it registered with), before a handler saying the prefix scope the call got and how many
    of the victim's kept tokens a match in that scope would reuse (`entry/generation.py`)."""
    access = AccessConfig(swarm_key=KEY, api_keys=(VICTIM_KEY,))
    credentials = Credentials(access, frozenset({"entry-1"}), trackers=keys)

    async def chat(request: Request) -> Response:
        scope = scope_of("client", client_of(request.scope))  # the default --prefix-sharing
        found = index.match(VICTIM_PROMPT, scope, lambda hops: True) if scope is not None else None
        return JSONResponse({"scope": scope, "tokens": found[1] if found else 0})

    rules = access_rules(ApiLimits(), members=True)
    app = Starlette(middleware=[Middleware(Guard, rules=rules, credentials=credentials)])
    app.add_route("/v1/chat/completions", chat, methods=["POST"])
    return app


def scoped_call(port: int, client: str, vouched: bool) -> tuple[str, int]:
    """A member-signed call naming `client` (with the tracker's vouch or not): the scope the
    entry put it in, and the victim's tokens it matched there."""
    body = json.dumps({"model": "default", "messages": [{"role": "user", "content": "hi"}]})
    headers = {"Content-Type": "application/json", "X-Meshnet-Client": client}
    if vouched:
        digest = hashlib.sha256(body.encode()).hexdigest()
        headers[VOUCH_HEADER] = TRACKER.vouch(client, "entry-1", digest)
    path = "/v1/chat/completions"
    headers |= Signer(KEY).headers("POST", path, body.encode(), to="entry-1", headers=headers)
    answer = httpx.post(f"http://127.0.0.1:{port}{path}", content=body, headers=headers)
    return str(answer.json()["scope"]), int(answer.json()["tokens"])


def scope_rows() -> list[Row]:
    """P1: the victim's prompt kept in its scope (as forwarded by the tracker), then a member
    naming the victim's key tag, without a vouch and (the control) with the tracker's."""
    victim = f"key:{key_tag(VICTIM_KEY)}"  # what every entry the tracker forwards it to sees
    index = PrefixIndex()
    index.add(PipelineSession(SessionId("victim"), [], list(VICTIM_PROMPT)), f"via-{victim}")
    keys = TrackerKeys()
    keys.add(TRACKER.public)
    with serving(scope_app(index, keys)) as port:
        named, control = scoped_call(port, victim, False), scoped_call(port, victim, True)
    unit = "of the victim's kept tokens matched"
    return [
        ("P1 member call naming another client's tag", f"scope {named[0]}", named[1], unit),
        ("P1 (control) the same, vouched by the tracker", f"scope {control[0]}", control[1], unit),
    ]


def anon_mib() -> float:
    """This process's resident anonymous memory (MiB)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) / 1024
    return 0.0


def pool_rows() -> list[Row]:
    """K1: the ggml KV pool after a 1,200-token session closed (10 layers of the default
    model: ~8.8 MiB of keys and values), and what a node lending 300 MB may hold in KV."""
    span = GgmlSpan(resolve("default").path, LayerSpan(0, 10))
    hidden = np.random.default_rng(0).standard_normal((1200, 576), dtype=np.float32)
    cache = span.new_cache()
    span.forward(hidden, cache, 0)
    before = anon_mib()
    del cache  # the session dropped: its cells are free
    given, after = span.pool.give_back() / MiB, anon_mib()
    config = NodeConfig(budget_bytes=300 * 10**6)  # `--budget 300MB`, the review's node E
    live, kept = live_bytes(config, "default", LayerSpan(0, 30)), kept_bytes(config)
    return [
        ("K1 ggml pool after a 1,200-token session closed", f"{given:.1f} MiB given back",
         f"{before:.0f} -> {after:.0f}", "MiB of RssAnon before -> after"),
        ("K1 KV of live sessions, 300 MB node holding 0:30", "at most", f"{live / MiB:.1f}",
         f"MiB: budget less weights (was --max-kv-cache, {config.max_cache_bytes / MiB:,.0f})"),
        ("K1 KV of kept prefixes, same node", "at most", f"{kept / MiB:.1f}",
         "MiB (its KV reserve, 10% of the budget)"),
    ]  # fmt: skip

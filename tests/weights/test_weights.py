"""Models known by content, and their parts served and fetched over real HTTP (ADR-0054)."""

from __future__ import annotations

import asyncio
import errno
import gzip
import os
import shutil
import time
import tracemalloc
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import pytest
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.responses import Response, StreamingResponse

from meshnet.config import AccessConfig
from meshnet.errors import RangeError, WeightsError
from meshnet.http_errors import install_error_handlers
from meshnet.models.gguf_file import read_gguf
from meshnet.models.source import default_gguf
from meshnet.observe.metrics import Metrics
from meshnet.security.access import Credentials, Guard
from meshnet.security.signing import Signer
from meshnet.types import LayerSpan
from meshnet.weights.fetch import RANGE_BYTES, Fetcher, Holder
from meshnet.weights.manifest import HEADER, Manifest, make_manifest, parse_manifest, verify
from meshnet.weights.serve import (
    MAX_RANGE_BYTES,
    UploadLimit,
    WeightServer,
    add_weight_routes,
    parse_range,
    weight_rules,
)
from meshnet.weights.store import WeightStore
from tests.security.test_server import serving

KEY = "weights-test-swarm-key-0123456789abcdef"
SPAN = LayerSpan(10, 12)


@pytest.fixture(scope="module")
def manifest() -> Manifest:
    return make_manifest(default_gguf())


def flipped_copy(tmp: Path, manifest: Manifest, *names: str) -> Path:
    """A copy of the default file with one byte of each part `names` flipped."""
    copy = tmp / "flipped.gguf"
    shutil.copyfile(default_gguf(), copy)
    with copy.open("r+b") as f:
        for name in names:
            part = manifest.part(name)
            assert part is not None
            f.seek(part.offset + part.nbytes // 2)
            byte = f.read(1)
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([byte[0] ^ 0x01]))
    return copy


def test_a_manifest_names_every_tensor_and_its_digest_is_its_content(manifest: Manifest) -> None:
    index = read_gguf(default_gguf())
    assert [p.name for p in manifest.parts] == [HEADER] + [t.name for t in index.tensors]
    assert manifest.parts[0].nbytes == index.data_start
    assert parse_manifest(manifest.canonical(), manifest.digest) == manifest
    other = manifest.model_copy(update={"file_bytes": manifest.file_bytes + 1})
    assert other.digest != manifest.digest
    with pytest.raises(WeightsError, match="digest"):
        parse_manifest(other.canonical(), manifest.digest)
    with pytest.raises(WeightsError, match="not a manifest"):
        parse_manifest(b'{"format": "gguf", "file_bytes": 1, "parts": []}', manifest.digest)


def test_a_manifest_whose_part_ends_past_the_file_is_refused(manifest: Manifest) -> None:
    body = manifest.model_dump()
    body["file_bytes"] = 10
    with pytest.raises(ValueError, match="past the file"):
        Manifest.model_validate(body)


def test_a_span_needs_its_layers_and_an_entry_span_the_head_too(manifest: Manifest) -> None:
    inner = {p.name for p in manifest.span_parts(SPAN, entry=True)}
    assert inner == {HEADER} | {n for n in _names(manifest) if n.startswith(("blk.10.", "blk.11."))}
    entry = {p.name for p in manifest.span_parts(LayerSpan(0, 1), entry=True)}
    assert {"token_embd.weight", "output_norm.weight"} <= entry
    lean = {p.name for p in manifest.span_parts(LayerSpan(0, 1), entry=False)}
    assert "token_embd.weight" not in lean and "blk.0.attn_q.weight" in lean


def _names(manifest: Manifest) -> list[str]:
    return [p.name for p in manifest.parts]


@pytest.mark.parametrize("name", ["blk.11.ffn_up.weight", HEADER, "last", "first"])
def test_a_local_copy_that_differs_is_refused_with_the_part_named(
    tmp_path: Path, manifest: Manifest, name: str
) -> None:
    """Any part the load reads, the first and the last checked too (test review 12-07, W1:
    a `verify` that skipped the last part it was given passed every unit test)."""
    parts = manifest.span_parts(SPAN, entry=False)
    name = {"last": parts[-1].name, "first": parts[0].name}.get(name, name)
    copy = flipped_copy(tmp_path, manifest, name)
    with pytest.raises(WeightsError, match="header" if name == HEADER else name):
        verify(copy, manifest, parts)
    store = WeightStore(tmp_path / "store")
    with pytest.raises(WeightsError):
        store.check_local(copy, manifest, parts)
    assert manifest.digest not in store.files  # nothing of it is served


def test_a_checked_span_of_a_local_file_is_not_hashed_again(
    tmp_path: Path, manifest: Manifest
) -> None:
    store = WeightStore(tmp_path)
    store.check_local(default_gguf(), manifest, manifest.span_parts(SPAN, entry=False))
    checked = next((tmp_path / "checked").glob("*.json"))
    before = checked.stat().st_mtime_ns
    store.check_local(default_gguf(), manifest, manifest.span_parts(SPAN, entry=False))
    assert checked.stat().st_mtime_ns == before
    assert store.files[manifest.digest].held >= {"blk.10.attn_q.weight", HEADER}


@pytest.mark.parametrize(
    ("header", "expected"),
    [
        (None, (0, 100)),
        ("bytes=0-9", (0, 10)),
        ("bytes=90-", (90, 100)),
        ("bytes=99-99", (99, 100)),
    ],
)
def test_ranges_within_a_part(header: str | None, expected: tuple[int, int]) -> None:
    assert parse_range(header, 100) == expected


@pytest.mark.parametrize(
    "header", ["bytes=0-100", "bytes=50-10", "bytes=100-", "items=0-1", "bytes=0-1,4-5", "bytes=-5"]
)
def test_ranges_outside_a_part_are_refused(header: str) -> None:
    with pytest.raises(RangeError):
        parse_range(header, 100)


def test_a_range_over_the_call_limit_is_refused() -> None:
    with pytest.raises(RangeError, match="at most"):
        parse_range(None, MAX_RANGE_BYTES + 1)


def test_uploads_keep_to_their_limit() -> None:
    now = [0.0]
    limit = UploadLimit(1000.0, clock=lambda: now[0])
    assert limit.book(500) == pytest.approx(0.5)
    assert limit.book(500) == pytest.approx(1.0)  # queued behind the first
    now[0] = 5.0
    assert limit.book(1000) == pytest.approx(1.0)  # idle time is not saved up
    assert UploadLimit(None).book(10**9) == 0.0


def weights_app(store: WeightStore, name: str = "tracker") -> Starlette:
    """A member named `name` serving what `store` holds, to members only."""
    app = Starlette(middleware=[_guard(KEY, name)])
    install_error_handlers(app)
    add_weight_routes(app, WeightServer(store))
    return app


def _guard(key: str, name: str) -> Middleware:
    access = AccessConfig(swarm_key=key)
    credentials = Credentials(access, frozenset({name}))
    return Middleware(Guard, rules=weight_rules(), credentials=credentials)


@pytest.fixture(scope="module")
def holder(tmp_path_factory: pytest.TempPathFactory, manifest: Manifest) -> Iterator[Holder]:
    """A member serving the whole default file."""
    store = WeightStore(tmp_path_factory.mktemp("holder"))
    store.offer_file(default_gguf(), manifest)
    with serving(weights_app(store)) as port:
        yield Holder("tracker", f"http://127.0.0.1:{port}")


def fetch(  # type: ignore[no-untyped-def]
    store: WeightStore,
    holders: list[Holder],
    digest: str,
    span: LayerSpan = SPAN,
    reports: list[str] | None = None,
    entry: bool = False,
):
    """Fetch `span`'s parts of model `digest` into `store`: (its file, the fetcher)."""

    async def report(holder: Holder, why: str) -> None:
        (reports if reports is not None else []).append(f"{holder.name}: {why}")

    fetcher = Fetcher(store, holders, signer=Signer(KEY), report=report)
    return asyncio.run(fetcher.fetch(digest, lambda m: m.span_parts(span, entry=entry))), fetcher


def test_a_node_fetches_exactly_its_span_and_the_loaders_read_it(
    tmp_path: Path, manifest: Manifest, holder: Holder
) -> None:
    store = WeightStore(tmp_path)
    held, fetcher = fetch(store, [holder], manifest.digest)
    needed = manifest.span_parts(SPAN, entry=False)
    assert held.held == {p.name for p in needed}
    assert fetcher.progress is not None and fetcher.progress.done_bytes == sum(
        p.nbytes for p in needed
    )
    verify(held.path, manifest, needed)  # the bytes at their places
    assert os.stat(held.path).st_blocks * 512 < manifest.file_bytes / 4  # sparse: the span only
    index = read_gguf(held.path)
    assert [t.name for t in index.tensors] == [t.name for t in read_gguf(default_gguf()).tensors]
    again, second = fetch(WeightStore(tmp_path), [holder], manifest.digest)  # a restart
    assert again.held == held.held and second.progress is None  # nothing fetched again


def test_a_holder_sending_a_flipped_byte_is_reported_and_the_part_comes_from_another(
    tmp_path: Path, manifest: Manifest, holder: Holder
) -> None:
    liar = WeightStore(tmp_path / "liar")
    tensors = [p.name for p in manifest.span_parts(SPAN, entry=False) if p.name != HEADER]
    liar.offer_file(flipped_copy(tmp_path, manifest, *tensors), manifest)
    reports: list[str] = []
    with serving(weights_app(liar, "node-liar")) as port:
        bad = Holder("node-liar", f"http://127.0.0.1:{port}")
        held, _ = fetch(
            WeightStore(tmp_path / "me"), [bad, holder], manifest.digest, reports=reports
        )
    verify(held.path, manifest, manifest.span_parts(SPAN, entry=False))
    assert len(reports) == 1 and reports[0].startswith("node-liar: weights answer refused")


def test_a_part_that_fails_its_hash_is_never_recorded_as_held(
    tmp_path: Path, manifest: Manifest, holder: Holder
) -> None:
    """A fetch from a liar alone fails, and what it kept for a resume holds none of the
    liar's parts (test review 12-07, W2: a part recorded before its hash check passed every
    unit test, and a resume would have loaded it)."""
    liar = WeightStore(tmp_path / "liar")
    tensors = [p.name for p in manifest.span_parts(SPAN, entry=False) if p.name != HEADER]
    liar.offer_file(flipped_copy(tmp_path, manifest, *tensors), manifest)
    store = WeightStore(tmp_path / "me")
    refused = pytest.raises(WeightsError, match="no holder gave")
    with serving(weights_app(liar, "node-liar")) as port, refused:
        fetch(store, [Holder("node-liar", f"http://127.0.0.1:{port}")], manifest.digest)
    kept = WeightStore(tmp_path / "me").files[manifest.digest].held
    assert not set(tensors) & set(kept)


def test_a_fetch_cut_short_resumes_from_its_checked_parts(
    tmp_path: Path, manifest: Manifest, holder: Holder, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = WeightStore(tmp_path)
    writes = [0]
    real = os.pwrite

    def full_disk(fd: int, data: bytes, offset: int) -> int:
        writes[0] += 1
        if writes[0] > 3:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(fd, data, offset)

    monkeypatch.setattr(os, "pwrite", full_disk)
    with pytest.raises(WeightsError, match="No space left"):
        fetch(store, [holder], manifest.digest)
    monkeypatch.setattr(os, "pwrite", real)
    reopened = WeightStore(tmp_path)
    kept = reopened.files[manifest.digest].held
    assert 0 < len(kept) < len(manifest.span_parts(SPAN, entry=False))
    held, fetcher = fetch(reopened, [holder], manifest.digest)
    verify(held.path, manifest, manifest.span_parts(SPAN, entry=False))
    assert fetcher.progress is not None
    assert fetcher.progress.total_bytes < sum(
        p.nbytes for p in manifest.span_parts(SPAN, entry=False)
    )


def test_a_dead_holder_is_left_and_the_fetch_completes_from_the_next(
    tmp_path: Path, manifest: Manifest, holder: Holder
) -> None:
    dead = Holder("node-gone", "http://127.0.0.1:9")  # nothing listens on the discard port
    held, fetcher = fetch(WeightStore(tmp_path), [dead, holder], manifest.digest)
    assert "node-gone" in fetcher.left and held.has(manifest.span_parts(SPAN, entry=False))
    with pytest.raises(WeightsError, match="no holder gave"):
        fetch(WeightStore(tmp_path / "x"), [dead], manifest.digest)


def test_weights_calls_are_for_members_and_bad_ones_get_json_errors(
    manifest: Manifest, holder: Holder
) -> None:
    base = f"{holder.address}/v1/weights/{manifest.digest}"
    assert httpx.get(f"{base}/manifest").status_code == 401  # no swarm-key proof
    auth = Signer(KEY).auth("tracker")
    got = httpx.get(f"{base}/manifest", auth=auth)
    assert got.status_code == 200 and got.content == manifest.canonical()
    cases = {
        f"{base}/parts/blk.0.attn_q.weight": ({"Range": "bytes=0-99999999"}, 416, "Range"),
        f"{base}/parts/nope.weight": ({}, 404, "name"),
        f"{holder.address}/v1/weights/{'0' * 64}/manifest": ({}, 404, "digest"),
    }
    for url, (headers, status, field) in cases.items():
        answer = httpx.get(url, headers=headers, auth=Signer(KEY).auth("tracker"))
        assert answer.status_code == status, url
        assert answer.json()["error"]["field"] == field


def test_the_cache_keeps_to_its_cap_least_recently_used_first(
    tmp_path: Path, manifest: Manifest, holder: Holder
) -> None:
    store = WeightStore(tmp_path, cache_bytes=1)
    held, _ = fetch(store, [holder], manifest.digest)
    assert store.evict(keep={manifest.digest}) == []  # in use: kept over the cap
    assert store.evict(keep=set()) == [manifest.digest]
    assert not held.path.exists() and manifest.digest not in WeightStore(tmp_path).files


def test_an_entry_span_fetched_alone_gives_the_same_tokens_and_logits(
    tmp_path: Path, manifest: Manifest, holder: Holder
) -> None:
    """Head, tokenizer and chat template come with an entry span: the cache's file serves an
    entry as the original does (the span's layers only on disk)."""
    import numpy as np
    import torch

    from meshnet.assemble.entry import load_entry_model
    from meshnet.config import NodeConfig

    span = LayerSpan(0, 2)
    held, _ = fetch(WeightStore(tmp_path), [holder], manifest.digest, span=span, entry=True)
    config = NodeConfig(compile=False, port=0, threads=1)
    cached = load_entry_model(config, "m", str(held.path), span)
    original = load_entry_model(config, "m", str(default_gguf()), span)
    chat = [{"role": "user", "content": "What is the capital of France?"}]
    ids = original.codec.chat(chat)
    assert cached.codec.chat(chat) == ids
    tokens = torch.tensor([ids])
    for model in (cached, original):
        model.hidden = model.head.embed_tokens(tokens, 0)  # type: ignore[attr-defined]
    assert torch.equal(cached.hidden, original.hidden)  # type: ignore[attr-defined]
    hidden = original.hidden[:, -1:]  # type: ignore[attr-defined]
    np.testing.assert_array_equal(cached.head.logits(hidden), original.head.logits(hidden))


def test_a_holder_that_stalls_is_left_and_the_part_comes_from_another(
    tmp_path: Path, manifest: Manifest, holder: Holder
) -> None:
    async def stall(request: object) -> Response:
        await asyncio.sleep(30)
        return Response(b"")

    app = Starlette()
    app.add_route("/v1/weights/{digest}/manifest", stall)
    app.add_route("/v1/weights/{digest}/parts/{name}", stall)
    with serving(app) as port:
        slow = Holder("node-slow", f"http://127.0.0.1:{port}")
        store = WeightStore(tmp_path)
        fetcher = Fetcher(store, [slow, holder], signer=Signer(KEY), timeout_s=0.5)
        parts = lambda m: m.span_parts(SPAN, entry=False)  # noqa: E731
        held = asyncio.run(fetcher.fetch(manifest.digest, parts))
    assert "node-slow" in fetcher.left and held.has(manifest.span_parts(SPAN, entry=False))


def test_a_manifest_names_each_tensors_type_and_shape(manifest: Manifest) -> None:
    index = read_gguf(default_gguf())
    got = [(p.name, p.ggml_type, tuple(p.shape)) for p in manifest.parts[1:]]
    assert got == [(t.name, int(t.tensor_type), tuple(t.shape)) for t in index.tensors]
    assert manifest.parts[0].ggml_type is None and manifest.parts[0].shape == []


def hostile_app(mode: str) -> Starlette:
    """A member posing as a holder (review W1, W2): `gzip` answers 1 GiB of zeros in ~1 MB;
    `trickle` sends a byte every 0.2 s; `long` sends more bytes than the range asked for."""
    bomb = gzip.compress(bytes(1 << 30), compresslevel=1) if mode == "gzip" else b""

    async def answer(request: object) -> Response:
        if mode == "gzip":
            return Response(bomb, headers={"Content-Encoding": "gzip"})
        if mode == "long":
            return Response(bytes(RANGE_BYTES + 1), status_code=206)

        async def drip() -> AsyncIterator[bytes]:
            while True:
                yield b"\0"
                await asyncio.sleep(0.2)

        return StreamingResponse(drip(), status_code=206)

    app = Starlette()
    app.add_route("/v1/weights/{digest}/manifest", answer)
    app.add_route("/v1/weights/{digest}/parts/{name}", answer)
    return app


@pytest.mark.parametrize("mode", ["gzip", "trickle", "long"])
def test_a_hostile_holder_costs_at_most_a_range_and_a_deadline(
    tmp_path: Path, manifest: Manifest, holder: Holder, mode: str
) -> None:
    """Answers are read as sent (never inflated), cut off past the range's length, and each
    within the deadline in all: the part comes from the honest holder, the liar is left."""
    with serving(hostile_app(mode)) as port:
        liar = Holder("node-liar", f"http://127.0.0.1:{port}")
        metrics = Metrics()
        fetcher = Fetcher(
            WeightStore(tmp_path),
            [liar, holder],
            signer=Signer(KEY),
            timeout_s=1.0,
            metrics=metrics,
        )
        parts = lambda m: m.span_parts(SPAN, entry=False)  # noqa: E731
        tracemalloc.start()
        started = time.monotonic()
        try:
            held = asyncio.run(fetcher.fetch(manifest.digest, parts))
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
    assert held.has(manifest.span_parts(SPAN, entry=False)) and "node-liar" in fetcher.left
    assert peak < 8 * RANGE_BYTES  # the bomb's 1 GiB was never inflated
    assert time.monotonic() - started < 10
    why = {"gzip": "encoded", "trickle": "deadline", "long": "too_long"}[mode]
    assert metrics.weights_refused.labels(why)._value.get() >= 1


def test_a_fetch_that_makes_no_progress_fails_naming_its_holders(tmp_path: Path) -> None:
    """Review W2: a load that fetches nothing for `stall_s` fails (the planner re-plans it)."""
    from meshnet.node.weights import NodeWeights

    weights = NodeWeights(WeightStore(tmp_path), "http://127.0.0.1:9", entry=False)
    weights.stall_s = 0.3
    fetcher = Fetcher(WeightStore(tmp_path), [Holder("node-x", "http://127.0.0.1:9")])

    async def never() -> object:
        await asyncio.sleep(30)
        return None

    started = time.monotonic()
    with pytest.raises(WeightsError, match="no weight bytes came for 0 s from node-x"):
        asyncio.run(weights._watched(fetcher, never()))  # type: ignore[arg-type]
    assert time.monotonic() - started < 3


def test_ranges_asked_and_never_read_hold_at_most_the_budget_then_503(
    tmp_path: Path, manifest: Manifest
) -> None:
    """Review W3: 256 ranges asked and never read took a tracker to 4.4 GiB. The bytes being
    answered count against a budget per address (503 beyond) and come back when the asker
    goes; the answer goes out in pieces, so a reader of nothing holds up one piece."""
    from meshnet.weights import serve

    store = WeightStore(tmp_path)
    store.offer_file(default_gguf(), manifest)
    server = WeightServer(store)
    app = Starlette(middleware=[_guard(KEY, "tracker")])
    install_error_handlers(app)
    add_weight_routes(app, server)
    target = f"/v1/weights/{manifest.digest}/parts/token_embd.weight"
    ask = {"Range": f"bytes=0-{serve.MAX_RANGE_BYTES - 1}"}
    with serving(app) as port, httpx.Client(base_url=f"http://127.0.0.1:{port}") as client:
        held = []
        for _ in range(serve.PEER_IN_FLIGHT_BYTES // serve.MAX_RANGE_BYTES):
            call = client.build_request("GET", target, headers=ask)
            held.append(
                client.send(call, auth=Signer(KEY).auth("tracker", answers=False), stream=True)
            )
        assert all(r.status_code == 206 for r in held)
        assert server.total == serve.PEER_IN_FLIGHT_BYTES  # still being answered
        busy = client.get(target, headers=ask, auth=Signer(KEY).auth("tracker"))
        assert busy.status_code == 503 and busy.json()["error"]["field"] == "Range"
        for response in held:
            response.close()
        deadline = time.monotonic() + 5
        while server.total and time.monotonic() < deadline:
            time.sleep(0.05)
        assert server.total == 0 and not server.in_flight
        again = client.get(target, headers=ask, auth=Signer(KEY).auth("tracker"))
        assert again.status_code == 206 and len(again.content) == serve.MAX_RANGE_BYTES

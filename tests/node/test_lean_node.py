"""A node whose span ggml computes never loads torch (ADR-0052): a real `--no-entry` process
on the default GGUF file serves frames from numpy alone, and answers what the same span
computes in this process."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest

from meshnet.models.ggml_span import GgmlSpan
from meshnet.models.source import resolve
from meshnet.security.signing import Signer
from meshnet.types import LayerSpan, ModelId
from meshnet.wire import FrameMeta, decode_bits
from meshnet.wire.frame import bf16_bits, bits_to_float32
from tests.node.test_node_process import node_process
from tests.owned import close_proof, encode, new_session

KEY = "lean-node-test-key-padded-to-128-bits-0123456789"
SPAN = LayerSpan(10, 20)
MiB = 1 << 20
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def lean_node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, int]]:
    args = ["--no-entry", "--layers", str(SPAN)]
    with node_process([*args, "--data-dir", str(tmp_path_factory.mktemp("lean"))], KEY) as node:
        yield node


def mapped_libraries(pid: int) -> set[str]:
    """The shared objects process `pid` has mapped (what it imported, in C)."""
    lines = Path(f"/proc/{pid}/maps").read_text().splitlines()
    return {Path(line.split()[-1]).name for line in lines if ".so" in line}


def resident_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def test_a_ggml_node_serves_frames_without_torch(lean_node: tuple[str, int]) -> None:
    url, pid = lean_node
    rng = np.random.default_rng(0)
    prompt = rng.standard_normal((1, 130, 576), dtype=np.float32)
    step = rng.standard_normal((1, 1, 576), dtype=np.float32)
    meta = FrameMeta(new_session(), ModelId("default"), SPAN, 0)
    node_id = httpx.get(f"{url}/health").json()["node_id"]
    with httpx.Client(base_url=url, auth=Signer(KEY).auth(node_id), timeout=60) as client:
        outs = []
        for at, hidden in ((0, prompt), (130, step)):
            frame = encode(hidden, FrameMeta(meta.session, meta.model, SPAN, at))  # type: ignore[arg-type]
            answer = client.post("/forward", headers=frame.headers, content=bytes(frame.body))
            assert answer.status_code == 200, answer.text
            outs.append(decode_bits(answer.headers, answer.content)[1])
        libraries = mapped_libraries(pid)
        assert any("ggml" in name for name in libraries), sorted(libraries)  # the check sees
        assert not any("torch" in name for name in libraries), sorted(libraries)
        rss = resident_bytes(pid)
        closing = close_proof(meta.session, node_id)
        assert client.delete(f"/sessions/{meta.session}", headers=closing).status_code == 200
    expected = reference(prompt, step)
    for out, want in zip(outs, expected, strict=True):
        got = bits_to_float32(out)[0]
        assert np.abs(got - want).max() <= 0.02 * np.abs(want).max(), np.abs(got - want).max()
    # the span's ten layers are ~24 MiB of the file; a torch node starts at ~280 MiB
    assert rss < 200 * MiB, rss / MiB


def test_a_ggml_node_refuses_bad_frames_and_keeps_no_session(lean_node: tuple[str, int]) -> None:
    url, _ = lean_node
    node_id = httpx.get(f"{url}/health").json()["node_id"]
    nan = np.full((1, 2, 576), np.nan, dtype=np.float32)
    wide = np.zeros((1, 2, 577), dtype=np.float32)
    with httpx.Client(base_url=url, auth=Signer(KEY).auth(node_id), timeout=60) as client:
        for hidden, field in ((nan, "body"), (wide, "X-Meshnet-Shape")):
            frame = encode(hidden, FrameMeta(new_session(), ModelId("default"), SPAN, 0))  # type: ignore[arg-type]
            answer = client.post("/forward", headers=frame.headers, content=bytes(frame.body))
            assert answer.status_code == 400 and answer.json()["error"]["field"] == field
    assert httpx.get(f"{url}/health").json()["sessions"] == 0


def reference(prompt: np.ndarray, step: np.ndarray) -> list[np.ndarray]:
    """The same span in this process, on the frames' bf16 values."""
    span = GgmlSpan(resolve("default").path, SPAN, threads=2)
    cache = span.new_cache()
    widen = lambda x: bits_to_float32(bf16_bits(x))[0]  # noqa: E731  # what the wire carried
    first = span.forward(widen(prompt), cache, 0)
    return [first, span.forward(widen(step), cache, 130)]

"""Joining with nothing but the tracker's address (ADR-0054), in real processes.

The tracker offers `model.gguf`, a copy of the default model in its own working directory:
a path no node started elsewhere can see. Node C runs beside the file; node B runs in an
empty directory, fetches the span the planner gives it from C and the tracker, and goes on
from the tracker when C is SIGKILLed mid-fetch (C's uploads are slowed to keep it busy);
the mesh's greedy answer through B equals the all-local mesh's. Node D's own copy has a
flipped byte in every layer it could be given: it refuses the directive with the tensor
named, and the tracker gives it no span of the model.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
from pathlib import Path

import httpx
import pytest

from meshnet.models.source import default_gguf
from meshnet.weights.manifest import make_manifest
from tests.e2e.procs import ask_france, free_port, get_json, start, stop_together, wait_for

pytestmark = pytest.mark.slow
MODEL = "model.gguf"
ENTRY = "0:15"  # the tracker's own span; nodes are given 15:30
# uploads a second of node C and the tracker: B's fetch of a 15-layer span (35 MB) takes
# ~6 s, long enough to kill C in the middle of it
SLOW_UPLOAD = {"c": "2MB", "tracker": "4MB"}


def coverage(url: str) -> dict:  # type: ignore[type-arg]
    return get_json(f"{url}/v1/coverage")  # type: ignore[no-any-return]


def node(url: str, name: str, folder: Path, *extra: str) -> tuple[list[str], Path]:
    data = folder / f"data-{name}"
    args = ["node", "--tracker", url, "--port", str(free_port()), "--no-entry"]
    return [*args, "--budget", "100MB", "--data-dir", str(data), *extra], data


def summary(url: str, node_id: str) -> dict:  # type: ignore[type-arg]
    """The tracker's summary of `node_id` (empty before it registers)."""
    return next((n for n in coverage(url)["nodes"] if n["node_id"] == node_id), {})


def node_id(data: Path) -> str:
    wait_for(lambda: (data / "node_id").exists(), 60, f"{data} to hold a node id")
    return (data / "node_id").read_text().strip()


def serves(url: str, node: str) -> bool:
    return any(s["model"] == MODEL for s in summary(url, node).get("loaded", []))


def test_a_node_without_the_file_fetches_its_span_and_answers_as_the_local_mesh(
    tmp_path: Path,
) -> None:
    env = {k: v for k, v in os.environ.items() if k != "MESHNET_SWARM_KEY"}
    env["MESHNET_SWARM_KEY"] = "weights-mesh-swarm-key-0123456789abcdef"
    dirs = {name: tmp_path / name for name in ("tracker", "b", "d")}
    for folder in dirs.values():
        folder.mkdir()
    shutil.copyfile(default_gguf(), dirs["tracker"] / MODEL)
    flipped(dirs["d"] / MODEL)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    procs: dict[str, subprocess.Popen[bytes]] = {}
    try:
        tracker = ["tracker", "--port", str(port), "--model", MODEL, "--layers", ENTRY]
        tracker += ["--heartbeat-interval", "1", "--data-dir", str(tmp_path / "t-data")]
        tracker += ["--weights-upload-limit", SLOW_UPLOAD["tracker"]]
        procs["tracker"] = start(tracker, tmp_path / "t.log", env, cwd=dirs["tracker"])
        args, data_c = node(url, "c", tmp_path, "--weights-upload-limit", SLOW_UPLOAD["c"])
        procs["c"] = start(args, tmp_path / "c.log", env, cwd=dirs["tracker"])  # beside it
        wait_for(lambda: coverage(url)["models"][0]["routable"], 120, "the all-local mesh")
        local = ask_france(url, MODEL)
        assert coverage(url)["models"][0]["digest"] == make_manifest(default_gguf()).digest

        args, data_b = node(url, "b", tmp_path)
        procs["b"] = start(args, tmp_path / "b.log", env, cwd=dirs["b"])
        b = node_id(data_b)
        wait_for(lambda: summary(url, b).get("fetching"), 60, "node B to fetch")
        procs["c"].send_signal(signal.SIGKILL)  # the only other holder, mid-fetch
        c = node_id(data_c)
        wait_for(lambda: serves(url, b), 120, "node B to serve the span it fetched")
        assert f"weights: {c} failed" in (tmp_path / "b.log").read_text()
        assert not (dirs["b"] / MODEL).exists()
        assert ask_france(url, MODEL) == local
        fetched = httpx.get(f"{summary(url, b)['address']}/metrics", headers=_key(env)).text
        assert 'meshnet_weights_fetched_bytes_total{peer="tracker"}' in fetched

        args, data_d = node(url, "d", tmp_path)
        procs["d"] = start(args, tmp_path / "d.log", env, cwd=dirs["d"])
        d_log = tmp_path / "d.log"
        wait_for(lambda: "differs from model" in d_log.read_text(), 60, "D to refuse")
        assert "tensor 'blk." in d_log.read_text()
        d = node_id(data_d)
        wait_for(lambda: summary(url, d).get("state") == "idle", 30, "D to be left idle")
        assert not summary(url, d)["loading"] and not summary(url, d)["loaded"]
    finally:
        stop_together(procs.values())


def _key(env: dict[str, str]) -> dict[str, str]:
    return {}  # /metrics on a node answers loopback callers without a key


def flipped(path: Path) -> None:
    """A copy of the default model with one byte flipped in each layer from 15 on."""
    manifest = make_manifest(default_gguf())
    shutil.copyfile(default_gguf(), path)
    with path.open("r+b") as f:
        for part in manifest.parts:
            if part.name.endswith("attn_q.weight") and int(part.name.split(".")[1]) >= 15:
                f.seek(part.offset + 7)
                byte = f.read(1)
                f.seek(part.offset + 7)
                f.write(bytes([byte[0] ^ 0xFF]))

"""Membership on the shared real mesh: only holders of the swarm key get in, nothing else
changes when they are refused, and a captured request cannot be replayed."""

from __future__ import annotations

import json
import stat

import httpx
import pytest
import torch

from meshnet.security.signing import Signer
from meshnet.types import LayerSpan, ModelId, SessionId
from meshnet.wire import FrameMeta, encode
from tests.e2e.mesh import Mesh

pytestmark = pytest.mark.slow


def registration(address: str) -> dict[str, object]:
    return {
        "node_id": "intruder",
        "address": address,
        "budget_bytes": 10**9,
        "quant": "fp32",
        "throughput": 1.0,
    }


def members(mesh: Mesh) -> set[tuple[str, str]]:
    return {(n["node_id"], n["address"]) for n in mesh.coverage()["nodes"]}


def test_the_tracker_made_a_private_key_and_strangers_cannot_join(mesh: Mesh) -> None:
    mesh.wait_whole()  # runs before the failover tests, which leave nodes stopped
    assert stat.S_IMODE(mesh.key_file.stat().st_mode) == 0o600
    key = mesh.env["MESHNET_SWARM_KEY"]
    assert mesh.key_file.read_text().strip() == key  # the printed command names this key
    before = members(mesh)
    url = f"{mesh.url}/v1/nodes/register"
    body = registration(mesh.addresses["a"])
    unsigned = httpx.post(url, json=body, timeout=10)
    wrong = httpx.post(
        url,
        json=body,
        timeout=10,
        auth=Signer("not-the-swarm-key-padded-to-128-bits-0123456789").auth("tracker"),
    )
    assert unsigned.status_code == wrong.status_code == 401
    assert wrong.json()["error"]["field"] == "X-Meshnet-Auth"
    # a member claiming an address where it cannot be reached is not counted either
    auth = Signer(key).auth("tracker")
    nowhere = httpx.post(url, json=registration("http://127.0.0.1:9"), auth=auth)
    assert nowhere.status_code == 400 and nowhere.json()["error"]["field"] == "address"
    # ...nor one claiming another node's address (the probe answers with that node's id)
    impostor = httpx.post(url, json=body, timeout=10, auth=Signer(key).auth("tracker"))
    assert impostor.status_code == 400 and "did not answer the tracker's probe" in impostor.text
    assert members(mesh) == before and "intruder" not in str(mesh.coverage())


def test_nodes_refuse_unsigned_frames_and_replays(mesh: Mesh) -> None:
    node = mesh.addresses["a"]
    meta = FrameMeta(SessionId("intruder"), ModelId("default"), LayerSpan(10, 20), 0)
    frame = encode(torch.randn(1, 2, 576), meta)
    refused = httpx.post(f"{node}/forward", headers=frame.headers, content=bytes(frame.body))
    assert refused.status_code == 401 and mesh.sessions("a") == 0

    signer = Signer(mesh.env["MESHNET_SWARM_KEY"])
    body = json.dumps({"node_id": "nobody", "reason": "test"}).encode()
    headers = signer.headers("POST", "/v1/nodes/report", body, to="tracker")
    headers["Content-Type"] = "application/json"
    first = httpx.post(f"{mesh.url}/v1/nodes/report", content=body, headers=headers)
    again = httpx.post(f"{mesh.url}/v1/nodes/report", content=body, headers=headers)
    # signed, but by no registered reporter with its membership token (ADR-0030): 403;
    # sent again, the proof itself is refused as a replay
    assert first.status_code == 403 and first.json()["error"]["field"] == "reporter"
    assert again.status_code == 401 and "replay" in again.json()["error"]["message"]

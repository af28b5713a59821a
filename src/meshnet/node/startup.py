"""What a node process needs before it serves: its span loader, its budget, its registration."""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import httpx
import torch

from meshnet.config import AccessConfig, NodeConfig
from meshnet.models.loader import load_shard
from meshnet.models.quantize import default_quant
from meshnet.models.source import resolve
from meshnet.node.agent import node_id
from meshnet.node.torch_runner import TorchShardRunner
from meshnet.security.signing import Signer
from meshnet.security.swarm import TRACKER
from meshnet.security.tls import client_context
from meshnet.tracker import messages as msg
from meshnet.types import LayerSpan, ModelId

log = logging.getLogger(__name__)


def load_runner(
    config: NodeConfig, model_id: str, source: str, span: LayerSpan
) -> TorchShardRunner:
    shard = load_shard(
        resolve(source), span, config.quant, fast=config.fast_path, compile=config.compile
    )
    return TorchShardRunner(
        ModelId(model_id),
        shard,
        ttl_s=config.session_ttl_s,
        max_cache_bytes=config.max_cache_bytes,
        evict_idle_s=config.evict_idle_s,
    )


def default_budget_bytes() -> int:
    """Free GPU memory on CUDA; half the available RAM on the CPU."""
    if torch.cuda.is_available():
        free, _ = torch.cuda.mem_get_info()
        return int(free)
    pages = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return int(pages // 2)


def measure_throughput(repeats: int = 30) -> float:
    """Relative speed: 1024x1024 matrix-vector products per second (a short timed pass)."""
    layer = torch.nn.Linear(1024, 1024)
    x = torch.randn(1, 1024)
    with torch.inference_mode():
        layer(x)
        start = time.perf_counter()
        for _ in range(repeats):
            layer(x)
    return repeats / (time.perf_counter() - start)


def registration(config: NodeConfig, scheme: str = "http") -> msg.RegisterRequest:
    """What this node tells the tracker: where it is, its budget, whether it may be an entry
    (and keeps an entry span given by hand: `--layers 0:K`)."""
    budget = config.budget_bytes or default_budget_bytes()
    data_dir = Path(config.data_dir or Path.home() / ".meshnet" / f"node-{config.port}")
    pinned = LayerSpan.parse(config.layers) if config.layers else None
    return msg.RegisterRequest(
        node_id=node_id(data_dir),
        address=config.public_address or f"{scheme}://{config.host}:{config.port}",
        budget_bytes=budget,
        kv_reserve_bytes=int(budget * config.kv_reserve_fraction),
        quant=config.quant or default_quant(),
        throughput=measure_throughput(),
        entry=config.entry,
        keeps_entry=config.entry and pinned is not None and pinned.start == 0,
    )


def tracker_client(url: str, access: AccessConfig, timeout_s: float = 10.0) -> httpx.AsyncClient:
    """An httpx client for the tracker that signs every call with the swarm key."""
    auth = Signer(access.swarm_key).auth(TRACKER)  # and refuses an answer it did not sign
    verify = client_context(access.tls)
    return httpx.AsyncClient(base_url=url, timeout=timeout_s, auth=auth, verify=verify)

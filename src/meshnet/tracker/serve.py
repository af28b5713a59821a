"""Start the tracker: resolve the offered models' configs (no weights), then serve."""

from __future__ import annotations

import logging
import time

import httpx
import uvicorn

from meshnet.config import AccessConfig, TrackerConfig
from meshnet.models.sizing import layer_bytes
from meshnet.models.source import resolve
from meshnet.security.signing import Signer
from meshnet.tracker.app import create_app
from meshnet.tracker.forward import EntryForwarder
from meshnet.tracker.planner import ModelOffer
from meshnet.tracker.probe import HttpProber
from meshnet.tracker.registry import Registry
from meshnet.types import QUANTS, ModelId, is_valid_id

log = logging.getLogger(__name__)


def offer(name: str) -> ModelOffer:
    """What the tracker offers for model `name`: its depth and per-layer bytes per quant."""
    source = resolve(name)
    model_id = name if is_valid_id(name) else source.model_id.replace("/", "--")
    return ModelOffer(
        ModelId(model_id), source.spec.num_layers, {q: layer_bytes(source.spec, q) for q in QUANTS}
    )


def build_registry(config: TrackerConfig) -> Registry:
    offers, sources = [], {}
    for name in config.models:
        model = offer(name)
        offers.append(model)
        sources[model.model] = name
        log.info(
            "offering %s: %d layers, %d bytes per layer at fp32",
            model.model,
            model.num_layers,
            model.layer_bytes["fp32"],
        )
    return Registry(
        offers,
        sources,
        dead_after_s=config.dead_after_s,
        clock=time.monotonic,
        heartbeat_interval_s=config.heartbeat_interval_s,
        max_nodes=config.max_nodes,
        max_per_address=config.max_nodes_per_address,
    )


def serve(config: TrackerConfig, access: AccessConfig) -> None:
    """A tracker that runs no model: the control plane, and clients forwarded to entries."""
    prober = HttpProber(Signer(access.swarm_key))
    registry = build_registry(config)
    # a generation streams for minutes: no read timeout, but connecting must be quick
    outbound = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=5.0))
    forwarder = EntryForwarder(registry, outbound)
    app = create_app(registry, config, prober=prober, access=access, forwarder=forwarder)
    log.info("tracker on http://%s:%d", config.host, config.port)
    uvicorn.run(app, host=config.host, port=config.port, log_level="warning")

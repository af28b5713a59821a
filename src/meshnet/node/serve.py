"""Start a node process: load its shard, then serve `/forward` with uvicorn."""

from __future__ import annotations

import logging

import uvicorn

from meshnet.config import NodeConfig
from meshnet.models.loader import load_shard
from meshnet.models.source import resolve
from meshnet.node.app import create_app
from meshnet.node.torch_runner import TorchShardRunner
from meshnet.types import LayerSpan, ModelId

log = logging.getLogger(__name__)


def build_runner(config: NodeConfig) -> TorchShardRunner:
    source = resolve(config.model)
    span = LayerSpan.parse(config.layers) if config.layers else LayerSpan(0, source.spec.num_layers)
    shard = load_shard(source, span, config.quant)
    return TorchShardRunner(
        ModelId(source.model_id),
        shard,
        ttl_s=config.session_ttl_s,
        max_cache_bytes=config.max_cache_bytes,
    )


def serve(config: NodeConfig) -> None:
    """Load the shard, then serve until interrupted."""
    runner = build_runner(config)
    log.info(
        "serving %s layers %s (%s) on http://%s:%d",
        runner.model,
        runner.span,
        runner.shard.quant,
        config.host,
        config.port,
    )
    uvicorn.run(create_app(runner), host=config.host, port=config.port, log_level="warning")

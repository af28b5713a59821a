"""What a node process needs before it serves: its span loader, its budget, its registration.

Torch is imported only on the way to a torch span: a node whose spans are all ggml never
loads it (ADR-0052).
"""

from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from meshnet.config import NodeConfig
from meshnet.models import ggml_graphs
from meshnet.models.backend import Chosen, choose_backend
from meshnet.models.device import budget_bytes, measure_throughput, resolve_device
from meshnet.models.gguf_file import gguf_fields
from meshnet.models.quant.compute import default_quant
from meshnet.models.sizing import file_layer_bytes
from meshnet.models.source import resolve
from meshnet.node.agent import node_id
from meshnet.node.compute import compute_threads
from meshnet.node.span_runner import SpanRunner
from meshnet.tracker import messages as msg
from meshnet.types import LayerSpan, ModelId, Quant

if TYPE_CHECKING:
    from meshnet.node.app import NodeService
    from meshnet.node.runner import ShardRunner

log = logging.getLogger(__name__)


def node_backend(config: NodeConfig, source: str) -> Chosen:
    """What computes `source`'s layers on this node (`models.backend.choose_backend`)."""
    resolved = resolve(source)
    gguf = resolved.kind == "gguf"
    arch = str(gguf_fields(resolved.path).get("general.architecture")) if gguf else ""
    return choose_backend(
        config.backend,
        gguf=gguf,
        device=resolve_device(config.device),
        quant=config.quant,
        has_graph=gguf and ggml_graphs.has(arch),
    )


def node_quant(config: NodeConfig) -> Quant:
    """The weight format this node registers: gguf where ggml computes."""
    if node_backend(config, config.model) == "ggml":
        return "gguf"
    return config.quant or default_quant(resolve_device(config.device))


def node_layer_bytes(config: NodeConfig) -> int:
    """Bytes one layer of `config.model` holds on this node: the file's own where ggml
    computes, else at its quantization on its device."""
    source = resolve(config.model)
    if node_backend(config, config.model) == "ggml":
        return file_layer_bytes(source.path)
    from meshnet.models.quantize import local_layer_bytes

    device = resolve_device(config.device)
    return local_layer_bytes(source.spec, config.quant or default_quant(device), device)


def load_runner(config: NodeConfig, model_id: str, source: str, span: LayerSpan) -> SpanRunner:
    """Layers `span` of `source` on `config.device` (resolved), behind the runner seam."""
    if node_backend(config, source) == "ggml":
        from meshnet.node.ggml_runner import ggml_runner

        log.info("layers %s of %s run on ggml at the file's own types", span, model_id)
        return ggml_runner(
            ModelId(model_id),
            resolve(source).path,
            span,
            threads=config.threads or compute_threads(),
            ttl_s=config.session_ttl_s,
            max_cache_bytes=live_bytes(config, source, span),
            evict_idle_s=config.evict_idle_s,
            max_kept_bytes=kept_bytes(config),
        )
    from meshnet.models.loader import load_shard
    from meshnet.node.torch_runner import TorchShardRunner

    shard = load_shard(
        resolve(source),
        span,
        config.quant,
        fast=config.fast_path,
        compile=config.compile,
        device=resolve_device(config.device),
    )
    return TorchShardRunner(
        ModelId(model_id),
        shard,
        ttl_s=config.session_ttl_s,
        max_cache_bytes=live_bytes(config, source, span),
        evict_idle_s=config.evict_idle_s,
        max_kept_bytes=kept_bytes(config),
    )


def live_bytes(config: NodeConfig, source: str, span: LayerSpan) -> int:
    """What a span's sessions may hold together: what the node's budget leaves beside the
    span's weights, never under its KV reserve nor over `--max-kv-cache` (review K1: a node
    lending 300 MB could hold 1 GiB of caches)."""
    budget = config.budget_bytes or budget_bytes(resolve_device(config.device))
    weights = len(span) * node_layer_bytes(replace(config, model=source))
    reserve = int(budget * config.kv_reserve_fraction)
    return min(config.max_cache_bytes, max(reserve, budget - weights))


def kept_bytes(config: NodeConfig) -> int:
    """What a span's kept prefixes may hold together: the node's KV reserve (review K1: they
    filled the 1 GiB KV cap of a node lending 300 MB, after every answer had ended)."""
    budget = config.budget_bytes or budget_bytes(resolve_device(config.device))
    return min(config.max_cache_bytes, int(budget * config.kv_reserve_fraction))


class SpanRole:
    """What a `--no-entry` node does with the spans it loads: serves them, nothing more (no
    head, no API; the agent's `load`/`attach`/`detach`, as `assemble.entry.EntryRole` has)."""

    def __init__(self, config: NodeConfig, service: NodeService) -> None:
        self.node = config
        self.service = service

    def load(self, model_id: str, source: str, span: LayerSpan) -> SpanRunner:
        return load_runner(self.node, model_id, source, span)

    def attach(self, runner: ShardRunner) -> None:
        """Nothing to attach: the span serves `/forward` once in the shard table."""

    def detach(self, model_id: str, span: LayerSpan) -> None:
        """Nothing to detach."""


def data_dir(config: NodeConfig) -> Path:
    """Where a node keeps its id and membership token across restarts."""
    return Path(config.data_dir or Path.home() / ".meshnet" / f"node-{config.port}")


def registration(config: NodeConfig, scheme: str = "http") -> msg.RegisterRequest:
    """What this node tells the tracker: where it is, its budget, whether it may be an entry
    (and keeps an entry span given by hand: `--layers 0:K`)."""
    device = resolve_device(config.device)
    budget = config.budget_bytes or budget_bytes(device)
    pinned = LayerSpan.parse(config.layers) if config.layers else None
    return msg.RegisterRequest(
        node_id=node_id(data_dir(config)),
        address=config.public_address or f"{scheme}://{config.host}:{config.port}",
        budget_bytes=budget,
        kv_reserve_bytes=int(budget * config.kv_reserve_fraction),
        quant=node_quant(config),
        throughput=measure_throughput(device),
        entry=config.entry,
        keeps_entry=config.entry and pinned is not None and pinned.start == 0,
    )

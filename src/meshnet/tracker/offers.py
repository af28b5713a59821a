"""What the tracker offers: each model's depth and sizes from its config (no weights)."""

from __future__ import annotations

import logging
import time
from pathlib import Path

from meshnet.config import TrackerConfig
from meshnet.models.sizing import (
    entry_head_bytes,
    file_conversions,
    file_layer_bytes,
    layer_bytes,
)
from meshnet.models.source import resolve, source_kind
from meshnet.tracker.planner import ModelOffer
from meshnet.tracker.registry import Registry
from meshnet.types import CONVERSIONS, ModelId, is_valid_id
from meshnet.weights.store import WeightStore

log = logging.getLogger(__name__)


def offer(name: str) -> ModelOffer:
    """What the tracker offers for model `name`: its depth, per-layer and head bytes per quant."""
    source = resolve(name)
    spec = source.spec
    model_id = name if is_valid_id(name) else source.model_id.replace("/", "--")
    # a GGUF file: not served by copies that re-quantize its weights (ADR-0060)
    quants = file_conversions(source.path) if source.kind == "gguf" else CONVERSIONS
    layers: dict[str, int] = {q: layer_bytes(spec, q) for q in quants}
    heads: dict[str, int] = {q: entry_head_bytes(spec, q) for q in quants}
    if source.kind == "gguf":  # ggml nodes hold its layers as the file stores them
        layers["gguf"], heads["gguf"] = (
            file_layer_bytes(source.path),
            entry_head_bytes(spec, "gguf"),
        )
    return ModelOffer(ModelId(model_id), spec.num_layers, layers, heads)


def tracker_store(config: TrackerConfig) -> WeightStore:
    """Where the tracker keeps its models' manifests (made once per file)."""
    return WeightStore(Path(config.data_dir or Path.home() / ".meshnet" / "tracker"))


def known_by_content(name: str, store: WeightStore) -> str | None:
    """The digest of model `name` when it is a GGUF file, which the tracker then serves to
    members (ADR-0054); None for checkpoint folders and hub ids."""
    source = resolve(name)
    if source.kind != "gguf":
        return None
    manifest = store.manifest_of(source.path)
    store.offer_file(source.path, manifest)
    return manifest.digest


# a (re)started tracker waits this many heartbeat intervals before it plans: every live node
# registers again meanwhile, declaring its spans (a node refused as unknown does at once)
REJOIN_BEATS = 2.0


def build_registry(config: TrackerConfig, store: WeightStore | None = None) -> Registry:
    offers, sources, kinds, digests = [], {}, {}, {}
    for name in config.models:
        model = offer(name)
        offers.append(model)
        sources[model.model] = name
        kinds[model.model] = source_kind(name)
        digest = known_by_content(name, store) if store is not None else None
        if digest is not None:
            digests[model.model] = digest
        log.info(
            "offering %s: %d layers, %d bytes per layer at fp32",
            model.model,
            model.num_layers,
            model.layer_bytes["fp32"],
        )
    registry = Registry(
        offers,
        sources,
        dead_after_s=config.dead_after_s,
        clock=time.monotonic,
        heartbeat_interval_s=config.heartbeat_interval_s,
        suspect_s=config.suspect_s,
        max_nodes=config.max_nodes,
        max_per_address=config.max_nodes_per_address,
        rejoin_beats=REJOIN_BEATS,
    )
    registry.source_kinds = {m: k for m, k in kinds.items() if k is not None}
    registry.digests = digests
    return registry

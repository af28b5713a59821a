"""The entry role: a node holding a span from layer 0 also holds the head and answers clients.

Any node that may be an entry (`NodeConfig.entry`, on by default) takes it on for each model
whose span from layer 0 it loads, whether that span was given by hand (`--layers 0:K`, the
tracker-as-node) or by the tracker's planner (ADR-0029): the load brings the head and the
tokenizer, and the model's `Generator` joins the ones the node's API serves. Dropping the
span ends it. The entry's own span runs in-process; only the hops after it are HTTP calls.
"""

from __future__ import annotations

import logging
import math
import random
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch

from meshnet.config import EntryConfig, NodeConfig
from meshnet.entry.bans import Bans
from meshnet.entry.drafter import Drafter, LookupDrafter, ModelDrafter
from meshnet.entry.generation import Generator
from meshnet.entry.ggml_head import GgmlHeadModule
from meshnet.entry.outbox import Outbox
from meshnet.entry.pipeline import Pipeline
from meshnet.entry.routes import RouteSource
from meshnet.entry.spotcheck import SpotChecker
from meshnet.entry.transport import Transport
from meshnet.errors import ConfigError, ModelError
from meshnet.models import sizing
from meshnet.models.ggml_head import GgmlHead
from meshnet.models.loader import load_head, load_shard, load_tokenizer
from meshnet.models.products import int8_kernel_runs
from meshnet.models.quant import scheme_of
from meshnet.models.quant.compute import default_quant
from meshnet.models.quantize import head_dtype
from meshnet.models.source import resolve
from meshnet.node.app import NodeService
from meshnet.node.compute import compute_threads
from meshnet.node.runner import ShardRunner
from meshnet.node.span_runner import Span, SpanRunner
from meshnet.node.startup import load_runner, node_layer_bytes, node_quant
from meshnet.text.codec import HfCodec
from meshnet.tracker import messages as msg
from meshnet.types import LayerSpan

log = logging.getLogger(__name__)


@dataclass
class EntryModel:
    """What an entry node holds for one model besides the routes."""

    model_id: str
    runner: SpanRunner  # layers [0, k)
    head: object  # models.shard.Head
    codec: HfCodec
    num_layers: int
    max_context: int
    file_weights: bool = False  # a GGUF file: every copy computes its weights (ADR-0060)


def entry_span(config: NodeConfig) -> LayerSpan:
    """`--layers` as given, or as many layers from 0 as the budget holds after the head."""
    spec = resolve(config.model).spec
    if config.layers is not None:
        span = LayerSpan.parse(config.layers)
        if span.start != 0:
            raise ModelError(f"an entry node serves layers from 0; got {span}")
        return span
    if config.budget_bytes is None:
        return LayerSpan(0, spec.num_layers)
    quant = node_quant(config)
    usable = int(config.budget_bytes * (1 - config.kv_reserve_fraction))
    usable -= sizing.entry_head_bytes(spec, quant)
    count = sizing.layers_that_fit(spec, node_layer_bytes(config), usable)
    if count < 1:
        raise ModelError(f"a budget of {config.budget_bytes} bytes holds no layer besides the head")
    return LayerSpan(0, count)


def entry_budget(config: NodeConfig, span: LayerSpan) -> int:
    """The budget an entry with a span given by hand registers: `--budget`, which must hold
    the head and the span, or just that (so the tracker plans nothing more on it)."""
    spec = resolve(config.model).spec
    quant = node_quant(config)
    span_bytes = len(span) * node_layer_bytes(config)
    head = sizing.entry_head_bytes(spec, quant)
    needed = math.ceil((span_bytes + head) / (1 - config.kv_reserve_fraction)) + 1
    if config.budget_bytes is None:
        return needed
    if config.budget_bytes < needed:
        raise ModelError(
            f"a budget of {config.budget_bytes} bytes cannot hold the head ({head} bytes) and "
            f"layers {span} ({needed} bytes with the KV reserve)"
        )
    return config.budget_bytes


def int8_head(shard: Span) -> bool:
    """Whether an entry beside `shard` multiplies by an int8 LM head (ADR-0046): int8 weights
    on a device with the weight-only int8 kernel."""
    return scheme_of(shard.quant).int8_lm_head and int8_kernel_runs(torch.device(shard.device))


def load_entry_model(config: NodeConfig, model_id: str, source: str, span: LayerSpan) -> EntryModel:
    """Layers `span` (from 0) of `source`, its head and its tokenizer."""
    runner = load_runner(config, model_id, source, span)
    resolved = resolve(source)
    if scheme_of(runner.shard.quant).file_types:  # the file's own table and LM head, by ggml
        head: Any = GgmlHeadModule(GgmlHead(resolved.path, config.threads or compute_threads()))
    else:
        head = load_head(resolved, head_dtype(runner.shard.quant), device=runner.shard.device)
    if int8_head(runner.shard):
        head.quantize_lm_head(runner.shard.compute_dtype)  # type: ignore[attr-defined]
    codec = HfCodec(load_tokenizer(resolved))
    log.info("entry for %s: layers %s and the head loaded", model_id, span)
    spec = resolved.spec
    return EntryModel(
        model_id,
        runner,
        head,
        codec,
        spec.num_layers,
        spec.max_positions,
        file_weights=resolved.kind == "gguf",
    )


class EntryRole:
    """The generators of the models whose entry span a node holds, kept as spans come and go.

    `generators` is the mapping the node's API serves; `load` is the agent's loader (a span
    from layer 0 comes with its head), `attach`/`detach` run on the event loop after the
    agent added or dropped a span.
    """

    def __init__(
        self,
        node: NodeConfig,
        entry: EntryConfig,
        service: NodeService,
        routes: RouteSource,
        transport: Transport,
    ) -> None:
        self.node = node
        self.entry = entry
        self.service = service
        self.routes = routes
        self.transport = transport
        self.generators: dict[str, Generator] = {}
        self.finished = Outbox()  # every generator's finished requests...
        service.take_finished = self.finished.take  # ...for the agent's next heartbeat
        self._loaded: dict[tuple[str, LayerSpan], EntryModel] = {}  # loaded, not attached yet

    def load(self, model_id: str, source: str, span: LayerSpan) -> ShardRunner:
        """Load `span` (on the compute thread); from layer 0 with the head and tokenizer."""
        if span.start != 0 or not self.node.entry:
            return load_runner(self.node, model_id, source, span)
        model = load_entry_model(self.node, model_id, source, span)
        self._loaded[(model_id, span)] = model
        return model.runner

    def attach(self, runner: ShardRunner) -> None:
        """`runner` now serves: when it came with a head, its model gets an entry."""
        model = self._loaded.pop((runner.model, runner.span), None)
        if model is not None:
            self.add(model)

    def add(self, model: EntryModel) -> None:
        self.generators[model.model_id] = make_generator(
            model, self.service, self.routes, self.transport, self.entry, self.finished.append
        )
        log.info("serving the API for %s", model.model_id)

    def detach(self, model_id: str, span: LayerSpan) -> None:
        """The span `model_id` `span` was dropped: it no longer answers for that model."""
        generator = self.generators.get(model_id)
        if generator is not None and generator.pipeline.local.span == span:
            del self.generators[model_id]  # requests in flight keep their generator
            log.info("no longer an entry of %s", model_id)


def pushes(service: NodeService) -> bool:
    """Whether this entry's hops can push (ADR-0034): they refuse frames without the key."""
    if service.forwarder.signer.key is None:
        log.warning("--push needs the swarm key (hops refuse unsigned routes): relaying")
        return False
    return True


def make_generator(
    model: EntryModel,
    service: NodeService,
    routes: RouteSource,
    transport: Transport,
    entry: EntryConfig,
    on_end: Callable[[msg.RequestSummary], object] = lambda summary: None,
) -> Generator:
    """The generator loop over `model`: its span runs on `service`, hops via `transport`."""
    pipeline = Pipeline(
        model.runner.model,
        model.num_layers,
        model.head,  # type: ignore[arg-type]
        model.runner,
        service,
        routes,
        transport,
        service.wire,
        service.node_id,
        replace(entry, push=entry.push and pushes(service)),
        metrics=service.metrics,
        spot_checker=SpotChecker(
            entry.spot_check_rate,
            random.Random(entry.seed),
            Bans(entry.spot_check_ban_s),
            file_weights=model.file_weights,
        ),
    )
    return Generator(
        pipeline,
        model.codec,
        model.max_context,
        random.Random(entry.seed),
        metrics=service.metrics,
        on_end=on_end,  # a summary of each request: the role's outbox, for the tracker
        max_drafts=entry.max_draft_tokens if entry.draft != "none" else 0,
        drafter=make_drafter(entry, model),
    )


def make_drafter(entry: EntryConfig, model: EntryModel) -> Drafter:
    """The drafter `entry` asks for (ADR-0038); a draft model must share the vocabulary."""
    if entry.draft != "model":
        return LookupDrafter()
    source = resolve(entry.draft_model)
    device = model.runner.shard.device  # the draft runs beside the served model's entry span
    whole = LayerSpan(0, source.spec.num_layers)
    quant = model.runner.shard.quant
    quant = default_quant(device) if scheme_of(quant).file_types else quant  # drafts: torch
    shard = load_shard(source, whole, quant, device=device)
    vocab = model.head.embed.num_embeddings  # type: ignore[attr-defined]
    if source.spec.vocab_size != vocab:
        raise ConfigError(
            f"draft model {entry.draft_model!r} has {source.spec.vocab_size} tokens, the "
            f"served model {vocab}: a draft model must share its tokenizer"
        )
    log.info("draft model %s loaded for %s", entry.draft_model, model.model_id)
    return ModelDrafter(load_head(source, head_dtype(shard.quant), device=device), shard)

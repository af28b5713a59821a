"""Which span an entry node takes, and the budget it registers (torch-free arithmetic)."""

from __future__ import annotations

import pytest

from meshnet.assemble.entry import entry_budget, entry_span
from meshnet.config import NodeConfig
from meshnet.errors import ModelError
from meshnet.models.sizing import head_bytes, layer_bytes
from meshnet.models.source import resolve
from meshnet.types import LayerSpan

SPEC = resolve("default").spec
LAYER = layer_bytes(SPEC, "fp32")  # 14,160,384 bytes
HEAD = head_bytes(SPEC, 4)  # the tied 49152 x 576 embedding and the norm, fp32


def test_head_bytes_of_the_default_model() -> None:
    assert HEAD == (49152 + 1) * 576 * 4


@pytest.mark.parametrize(
    ("config", "span"),
    [
        (NodeConfig(layers="0:10"), LayerSpan(0, 10)),
        (NodeConfig(), LayerSpan(0, 30)),  # no budget, no layers: the whole model
        (NodeConfig(quant="fp32", budget_bytes=int((HEAD + 12.5 * LAYER) / 0.9)), LayerSpan(0, 12)),
        (NodeConfig(quant="fp32", budget_bytes=10**12), LayerSpan(0, 30)),
    ],
)
def test_entry_span(config: NodeConfig, span: LayerSpan) -> None:
    assert entry_span(config) == span


@pytest.mark.parametrize(
    "config",
    [
        NodeConfig(layers="5:10"),  # an entry starts at layer 0
        NodeConfig(quant="fp32", budget_bytes=HEAD),  # the head alone fills it
    ],
)
def test_entry_span_refusals(config: NodeConfig) -> None:
    with pytest.raises(ModelError):
        entry_span(config)


def test_registered_budget_is_just_the_span_and_head_without_a_budget() -> None:
    budget = entry_budget(NodeConfig(quant="fp32"), LayerSpan(0, 10))
    # the planner counts the head of an entry span: it gives this node nothing more
    assert HEAD + 10 * LAYER <= budget * 0.9 < HEAD + 11 * LAYER


def test_registered_budget_is_the_budget_given_and_must_hold_head_and_span() -> None:
    config = NodeConfig(quant="fp32", budget_bytes=HEAD + 20 * LAYER)
    assert entry_budget(config, LayerSpan(0, 10)) == HEAD + 20 * LAYER
    with pytest.raises(ModelError, match="cannot hold the head"):
        entry_budget(NodeConfig(quant="fp32", budget_bytes=HEAD), LayerSpan(0, 10))

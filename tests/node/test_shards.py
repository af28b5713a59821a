"""The parts `NodeService` binds besides the scheduler: the shard table and the outbox."""

from __future__ import annotations

import pytest

from meshnet.entry.outbox import Outbox
from meshnet.errors import WireError
from meshnet.node.runner import EchoRunner
from meshnet.node.shards import ShardTable
from meshnet.tracker import messages as msg
from meshnet.types import LayerSpan, ModelId


def test_the_shard_table_finds_runners_and_names_what_it_serves_otherwise() -> None:
    a, b = EchoRunner(ModelId("m"), LayerSpan(10, 20)), EchoRunner(ModelId("m"), LayerSpan(0, 10))
    table = ShardTable([a])
    table.add(b)
    assert list(table) == [("m", LayerSpan(0, 10)), ("m", LayerSpan(10, 20))]  # sorted
    assert table.get("m", LayerSpan(10, 20)) is a and ("m", LayerSpan(0, 10)) in table
    with pytest.raises(WireError, match=r"serves m 0:10, m 10:20, not m layers 5:9") as refused:
        table.get("m", LayerSpan(5, 9))
    assert refused.value.field == "X-Meshnet-Layers"
    assert table.remove("m", LayerSpan(0, 10)) and not table.remove("m", LayerSpan(0, 10))
    assert len(table) == 1 and table.session_count() == 0 and table.cache_bytes() == 0
    with pytest.raises(WireError, match="serves nothing yet"):
        ShardTable().get("m", LayerSpan(0, 1))


def summary(n: int) -> msg.RequestSummary:
    return msg.RequestSummary(
        session=f"s-{n}",
        model="m",
        outcome="stop",
        prompt_tokens=1,
        completion_tokens=1,
        duration_s=0.1,
        time_to_first_token_s=0.1,
        decode_tokens_per_s=1.0,
    )


def test_the_outbox_hands_out_each_summary_once_and_keeps_the_newest() -> None:
    outbox = Outbox()
    for n in range(msg.MAX_REQUESTS + 5):
        outbox.append(summary(n))
    taken = outbox.take()
    assert len(taken) == msg.MAX_REQUESTS and taken[0].session == "s-5"  # oldest dropped
    assert not outbox and outbox.take() == []

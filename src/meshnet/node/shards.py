"""The shard table: which runner serves which span of which model on this node."""

from __future__ import annotations

from collections.abc import Iterator

from meshnet.errors import WireError
from meshnet.node.runner import ShardRunner
from meshnet.node.sessions import PrefixStats
from meshnet.types import LayerSpan
from meshnet.wire import headers as h

ShardKey = tuple[str, LayerSpan]  # (model id, span)


class ShardTable:
    """The runners of one node, keyed by (model, span); iterates its keys, sorted."""

    def __init__(self, runners: list[ShardRunner] | None = None) -> None:
        self._runners: dict[ShardKey, ShardRunner] = {}
        for runner in runners or []:
            self.add(runner)

    def add(self, runner: ShardRunner) -> None:
        self._runners[(runner.model, runner.span)] = runner

    def remove(self, model: str, span: LayerSpan) -> bool:
        return self._runners.pop((model, span), None) is not None

    def get(self, model: str, span: LayerSpan) -> ShardRunner:
        """The runner of `model` layers `span`; a 400 naming what this node serves instead."""
        runner = self._runners.get((model, span))
        if runner is None:
            served = ", ".join(f"{m} {s}" for m, s in self) or "nothing yet"
            raise WireError(f"this node serves {served}, not {model} layers {span}", field=h.LAYERS)
        return runner

    def runners(self) -> list[ShardRunner]:
        return list(self._runners.values())  # a copy: loads and drops change the table

    def session_count(self) -> int:
        """Sessions of all shards together."""
        return sum(r.session_count() for r in self.runners())

    def cache_bytes(self) -> int:
        return sum(r.cache_bytes() for r in self.runners())

    def prefix_stats(self) -> PrefixStats:
        """Every shard's kept prefixes together."""
        total = PrefixStats()
        for stats in (r.prefix_stats() for r in self.runners()):
            total.hits += stats.hits
            total.tokens_reused += stats.tokens_reused
            total.kept += stats.kept
            total.kept_bytes += stats.kept_bytes
        return total

    def __contains__(self, key: object) -> bool:
        return key in self._runners

    def __iter__(self) -> Iterator[ShardKey]:
        return iter(sorted(self._runners))

    def __len__(self) -> int:
        return len(self._runners)

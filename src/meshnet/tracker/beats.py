"""Heartbeat timing: the interval a mesh's size asks for, and which nodes are overdue."""

from __future__ import annotations

from urllib.parse import urlsplit

from meshnet.types import NodeId

CHECK_AFTER_BEATS = 1.1  # this many intervals silent makes the tracker check a node listens
BEATS_PER_S = 500  # heartbeats a second the tracker takes at most (~0.5 core at ~1 ms each)


def beat_interval_s(nodes: int, base_s: float, beats_per_s: float) -> float:
    """Seconds between a node's heartbeats so that `nodes` nodes send at most `beats_per_s`
    a second together, and never less than `base_s`."""
    return max(base_s, nodes / beats_per_s)


def host_of(address: str) -> str:
    return urlsplit(address).hostname or address


def overdue(
    beats: dict[NodeId, tuple[float, float]], now_s: float, interval_s: float
) -> list[NodeId]:
    """Nodes to check: no heartbeat for `CHECK_AFTER_BEATS` intervals, and not checked since.

    `beats` maps each node to (its last heartbeat, its last check), both in clock seconds.
    """
    return [
        node
        for node, (seen_s, checked_s) in beats.items()
        if now_s - seen_s > CHECK_AFTER_BEATS * interval_s and checked_s <= seen_s
    ]

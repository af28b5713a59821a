"""Round-trip times a node measures: to the tracker, and to the peers it sends frames to.

A node learns its peers from the frames it sends (an entry's hops, a pushing hop's next
hop), pings each one now and then with `GET /health` (a few hundred bytes each way), and
reports the median of its last samples per peer with every heartbeat. The tracker then
counts a hop's round trip from the entry in its route choice (ADR-0035).
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from meshnet.security.swarm import TRACKER

MAX_PEERS = 64  # peers reported (the heartbeat's limit); the least recently used go first
SAMPLES = 5  # per peer, the median of the last ones is reported
FORGET_S = 600.0  # a peer no frame went to for this long is dropped
PING_EVERY_S = 10.0  # each peer at most this often


@dataclass
class Peer:
    address: str
    used_s: float  # when a frame last went to it
    pinged_s: float = float("-inf")
    samples: deque[float] = field(default_factory=lambda: deque(maxlen=SAMPLES))


class PeerTimes:
    """Measured round trips (seconds) by peer: node ids, and `tracker`."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.peers: dict[str, Peer] = {}

    def seen(self, node_id: str, address: str) -> None:
        """A frame went to `node_id` at `address`: ping it from time to time."""
        now = self.clock()
        peer = self.peers.get(node_id)
        if peer is None or peer.address != address:
            self.peers[node_id] = Peer(address, now)
        else:
            peer.used_s = now
        if len(self.peers) > MAX_PEERS:
            oldest = min(
                (p for p in self.peers if p != TRACKER), key=lambda n: self.peers[n].used_s
            )
            del self.peers[oldest]

    def record(self, node_id: str, rtt_s: float) -> None:
        """A round trip to `node_id` (or `tracker`) took `rtt_s`."""
        peer = self.peers.setdefault(node_id, Peer("", self.clock()))
        peer.samples.append(rtt_s)

    def due(self) -> list[tuple[str, str]]:
        """(node id, address) of the peers to ping now; each counts as pinged. Peers no
        frame went to for `FORGET_S` are forgotten."""
        now = self.clock()
        self.peers = {
            n: p for n, p in self.peers.items() if n == TRACKER or now - p.used_s < FORGET_S
        }
        due = [
            (n, p.address)
            for n, p in self.peers.items()
            if p.address and now - p.pinged_s >= PING_EVERY_S
        ]
        for node_id, _ in due:
            self.peers[node_id].pinged_s = now
        return due

    def report_ms(self) -> dict[str, float]:
        """The median round trip in ms per peer with samples: the heartbeat's `rtt_ms`."""
        return {
            n: round(1000 * statistics.median(p.samples), 3)
            for n, p in self.peers.items()
            if p.samples
        }

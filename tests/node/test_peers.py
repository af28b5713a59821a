"""Round trips a node measures to its peers: which to ping, when, and what it reports."""

from __future__ import annotations

from meshnet.node.peers import FORGET_S, MAX_PEERS, PING_EVERY_S, SAMPLES, PeerTimes


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_peers_frames_went_to_are_pinged_every_so_often() -> None:
    clock = Clock()
    times = PeerTimes(clock)
    times.seen("n-1", "http://a:1")
    assert times.due() == [("n-1", "http://a:1")]
    assert times.due() == []  # just pinged
    clock.now += PING_EVERY_S
    assert times.due() == [("n-1", "http://a:1")]


def test_the_median_of_the_last_samples_is_reported_in_ms() -> None:
    times = PeerTimes(Clock())
    for rtt_s in [0.5, 0.010, 0.012, 0.011, 0.013, 0.009]:  # the 0.5 s outlier is too old
        times.record("n-1", rtt_s)
    times.record("tracker", 0.002)
    assert times.report_ms() == {"n-1": 11.0, "tracker": 2.0}
    assert len(times.peers["n-1"].samples) == SAMPLES


def test_peers_no_frame_went_to_are_forgotten_but_not_the_tracker() -> None:
    clock = Clock()
    times = PeerTimes(clock)
    times.seen("n-1", "http://a:1")
    times.record("n-1", 0.01)
    times.record("tracker", 0.002)
    clock.now += FORGET_S
    times.due()
    assert times.report_ms() == {"tracker": 2.0}


def test_at_most_max_peers_are_kept_the_least_recently_used_go() -> None:
    clock = Clock()
    times = PeerTimes(clock)
    for i in range(MAX_PEERS + 5):
        clock.now += 1
        times.seen(f"n-{i}", f"http://h:{i}")
    assert len(times.peers) == MAX_PEERS
    assert "n-0" not in times.peers and f"n-{MAX_PEERS + 4}" in times.peers


def test_a_peer_at_a_new_address_starts_over() -> None:
    times = PeerTimes(Clock())
    times.seen("n-1", "http://a:1")
    times.record("n-1", 0.05)
    times.seen("n-1", "http://b:1")
    assert times.report_ms() == {}

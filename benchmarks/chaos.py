"""Chaos: greedy generations through the real mesh while a hop of each is SIGKILLed.

    python benchmarks/chaos.py            # 20 generations (the figure in docs/reliability.md)
    python benchmarks/chaos.py --tiny     # 2 generations
    python benchmarks/chaos.py --runs 50
    python benchmarks/chaos.py --push     # through an entry whose hops push (ADR-0034)

The mesh is `tests/e2e/mesh.py`'s: a tracker-as-entry-node (0:10) and four nodes, every span
after the entry's with two copies, all fp32, as separate processes on loopback. Each run
streams a 48-token greedy answer and, at a random token, SIGKILLs a random hop of its route
that has a spare copy, then restarts it (same port, same node id). A run is lost when its
text differs from the same prompt's answer without a kill. The test suite runs `chaos()` on
its shared mesh (`tests/e2e/test_failover_mesh.py`), 8 runs by default.
"""

from __future__ import annotations

import argparse
import random
import signal
import statistics
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from tests.e2e.mesh import API_KEY, Mesh  # noqa: E402
from tests.e2e.procs import wait_for  # noqa: E402
from tests.e2e.streams import TOKENS, busy_spare, chat, spare, stream  # noqa: E402

PROMPTS = [
    "Write a short story about a robot who learns to paint.",
    "Explain how a bicycle works to a child.",
    "Describe a walk through a forest in autumn.",
    "Write a letter to a friend about your holiday by the sea.",
]


@dataclass
class ChaosResult:
    runs: int = 0
    lost: int = 0  # answers that differ from the failure-free answer
    unkilled: int = 0  # runs that ended before their kill (none expected)
    pauses_s: list[float] = field(default_factory=list)  # the entry's failover pauses
    gaps_s: list[float] = field(default_factory=list)  # each run's longest wait between tokens


def kill_a_hop(mesh: Mesh, rng: random.Random) -> str:
    """SIGKILL a random hop of the running route that has a spare copy, and restart it."""
    candidates = busy_spare(mesh)
    assert candidates, "no hop of the route has a spare copy"
    victim = rng.choice(candidates)
    mesh.procs[victim].send_signal(signal.SIGKILL)
    mesh.procs[victim].wait()
    mesh.restart(victim)  # same port, same data folder: the same node id comes back
    return victim


def chaos(mesh: Mesh, runs: int, seed: int = 7, push: bool = False) -> ChaosResult:
    """`runs` generations, each with one hop SIGKILLed at a random token; with `push`,
    through the mesh's second entry, whose hops push (ADR-0034), else the tracker's."""
    rng, result = random.Random(seed), ChaosResult()
    url, headers = (
        (mesh.entry, {"Authorization": f"Bearer {API_KEY}"}) if push else (mesh.url, None)
    )
    used = PROMPTS[: min(runs, len(PROMPTS))]  # each run's prompt, without a kill
    expected = {p: stream(url, chat(p), headers=headers).text for p in used}
    for i in range(runs):
        # a route has a hop on each span; one of them needs a spare copy for the kill
        wait_for(lambda: bool(spare(mesh)), 60, "a spare copy of a span")
        prompt, at, killed = PROMPTS[i % len(PROMPTS)], rng.randrange(2, TOKENS - 2), []

        def on_token(n: int, at: int = at, killed: list[str] = killed) -> None:
            if n == at:
                killed.append(kill_a_hop(mesh, rng))

        answer = stream(url, chat(prompt), on_token, headers)
        result.runs += 1
        result.lost += answer.text != expected[prompt]
        result.unkilled += not killed
        result.pauses_s += answer.pauses_s
        result.gaps_s.append(answer.longest_gap_s())
    return result


def ms(values: list[float], q: float) -> str:
    if not values:
        return "-"
    ordered = sorted(values)
    return f"{ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000:.0f}"


def table(result: ChaosResult) -> str:
    """The result as a Markdown table (pauses and longest token gaps in ms)."""
    p, g = result.pauses_s, result.gaps_s
    median = f"{statistics.median(p) * 1000:.0f}" if p else "-"
    gap = f"{statistics.median(g) * 1000:.0f}" if g else "-"
    cells = [result.runs, result.lost, len(p), median, ms(p, 1), gap, ms(g, 1)]
    return "\n".join(
        [
            "| runs | lost | failovers | pause p50 ms | pause max ms | gap p50 ms | gap max ms |",
            "|---|---|---|---|---|---|---|",
            "| " + " | ".join(map(str, cells)) + " |",
        ]
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--tiny", action="store_true", help="2 runs")
    parser.add_argument("--push", action="store_true", help="through the entry whose hops push")
    args = parser.parse_args()
    runs = 2 if args.tiny else args.runs
    mesh = Mesh(Path(tempfile.mkdtemp(prefix="meshnet-chaos-")))
    try:
        mesh.start_all()
        mesh.start_nodes()
        mesh.wait_whole(300)
        result = chaos(mesh, runs, push=args.push)
    finally:
        mesh.stop_all()
    print(table(result))


if __name__ == "__main__":
    main()

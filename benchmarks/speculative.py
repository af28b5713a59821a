"""Speculative decoding over slow links (ADR-0038): prompt-lookup drafts against plain decoding.

    python benchmarks/speculative.py          # 0 and 25 ms one-way per link, int8, 3 prompts
    python benchmarks/speculative.py --tiny   # 0 ms, fp32, the quote only, short
    (the tests run the tiny table on the wan benchmark's mesh: `wan.py --compare all --tiny`)

The WAN harness of `benchmarks/wan.py`: a tracker-as-entry-node (0:10), two nodes (10:20,
20:30) and two entries of 0:10, one plain and one with `--draft lookup`, each process
reached by its peers through its own delaying proxy; real processes. For each prompt kind,
both entries answer the same greedy chat request, alternating, `--repeats` times. Decode tokens/s is
(completion tokens - 1) / (t(full answer) - t(first token)); a verify round gives its
accepted drafts plus one token; tokens per trip is (tokens - 1) / decode rounds (the answer's
`meshnet.decode_rounds`; the prompt's trip gives the first token).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from wan import Link, mesh

PARAGRAPH = (
    "The river rose slowly through the night, and by morning the low fields near the mill "
    "were under water. The miller and his sons carried the sacks of grain to the upper "
    "floor, while the neighbours came with carts to take the animals to higher ground."
)
CODE = (
    "def mean(values):\n    total = 0\n    count = 0\n    for value in values:\n"
    "        total += value\n        count += 1\n    if count == 0:\n        return 0\n"
    "    return total / count\n"
)
PROMPTS = {  # measured on the default model: what it copies (quote, code) and what it writes
    "quote": f"Copy the following text exactly, word for word:\n\n{PARAGRAPH}",
    "code edit": f"```python\n{CODE}```\nAdd a comment line above each line of this code. "
    "Output the whole code.",
    "free text": "Write a short story about a lighthouse keeper.",
}


def chat(client: httpx.Client, text: str, tokens: int) -> tuple[float, dict[str, Any]]:
    body = {
        "model": "default",
        "messages": [{"role": "user", "content": text}],
        "max_tokens": tokens,
        "temperature": 0,
    }
    start = time.perf_counter()
    answer = client.post("/v1/chat/completions", json=body).json()
    return time.perf_counter() - start, answer


def measure(
    urls: dict[str, str], text: str, tokens: int, repeats: int
) -> dict[str, dict[str, Any]]:
    """Per mode: median decode tokens/s, drafts and accepted ones (last run), the text."""
    clients = {mode: httpx.Client(base_url=url, timeout=600) for mode, url in urls.items()}
    runs: dict[str, list[float]] = {mode: [] for mode in urls}
    last: dict[str, dict[str, Any]] = {}
    try:
        for _ in range(repeats):
            for mode, client in clients.items():
                first_s, _ = chat(client, text, 1)
                full_s, answer = chat(client, text, tokens)
                n = answer["usage"]["completion_tokens"]
                runs[mode].append((n - 1) / max(full_s - first_s, 1e-6))
                last[mode] = answer
    finally:
        for client in clients.values():
            client.close()
    rows = {}
    for mode, answer in last.items():
        info, n = answer["meshnet"], answer["usage"]["completion_tokens"]
        rows[mode] = {
            "tokens_s": statistics.median(runs[mode]),
            "drafted": info["draft_tokens"],
            "accepted": info["accepted_draft_tokens"],
            "per_trip": (n - 1) / max(info["decode_rounds"], 1),
            "text": answer["choices"][0]["message"]["content"],
            "tokens": n,
        }
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quant", default="int8")
    parser.add_argument("--delays", default="0,25", help="one-way delays (ms) per link")
    parser.add_argument("--prompts", default=",".join(PROMPTS), help="of: " + ", ".join(PROMPTS))
    args = parser.parse_args()
    link = Link()
    with (
        tempfile.TemporaryDirectory(prefix="meshnet-spec-") as logs,
        mesh(Path(logs), "fp32" if args.tiny else args.quant, link, ("drafts",)) as (urls, _),
    ):
        if args.tiny:
            tiny_table(urls, link)
            return
        kinds = args.prompts.split(",")
        delays = [float(d) for d in args.delays.split(",")]
        table(urls, link, {k: PROMPTS[k] for k in kinds}, args.tokens, args.repeats, delays)


def tiny_table(urls: dict[str, str], link: Link) -> None:
    """0 ms, the quote only, short: what the tests run (`wan.py --compare all --tiny`)."""
    table(urls, link, {"quote": PROMPTS["quote"]}, 16, 1, [0.0])


def table(
    urls: dict[str, str],
    link: Link,
    prompts: dict[str, str],
    tokens: int,
    repeats: int,
    delays: list[float],
) -> None:
    """A row per prompt and delay: the plain and the lookup entry side by side."""
    print(
        "| prompt | one-way delay | plain tokens/s | lookup tokens/s | speedup | drafts "
        "accepted | tokens per trip | same text |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---|")
    for url in urls.values():  # warm-up: first passes, and the planner settling
        with httpx.Client(base_url=url, timeout=600) as client:
            for text in prompts.values():
                chat(client, text, 8)
    for delay in delays:
        link.delay_s = delay / 1000
        for kind, text in prompts.items():
            rows = measure(urls, text, tokens, repeats)
            plain, lookup = rows["plain"], rows["lookup"]
            print(
                f"| {kind} | {delay:.0f} ms | {plain['tokens_s']:.1f} | "
                f"{lookup['tokens_s']:.1f} | {lookup['tokens_s'] / plain['tokens_s']:.2f}x | "
                f"{lookup['accepted']} of {lookup['drafted']} | {lookup['per_trip']:.2f} | "
                f"{'yes' if lookup['text'] == plain['text'] else 'NO'} |",
                flush=True,
            )


if __name__ == "__main__":
    main()

"""Prompt prefixes reused across requests (ADR-0058): time to first token with and without.

    python benchmarks/prefix.py          # 10 turns of ~200 tokens, 8 users x 1,000 tokens
    python benchmarks/prefix.py --tiny   # 3 turns, 2 users x 128 tokens (what the tests run)

A tracker-as-entry-node (layers 0:10) and two nodes (10:20, 20:30), real processes on
loopback, the default model at its default quant (`--quant` to change), the entry started
with `--prefix-sharing all` (the users below are one loopback client). Every request is
greedy and non-streamed; TTFT is the answer's `meshnet.time_to_first_token_s` (the entry's
clock, from the request to the first sampled token). Each request with the cache is followed
by the same request with `cache_prompt: false` (no reuse, nothing kept), so both see the
same machine state; every run starts from text no earlier run used.

1. **A chat**: `--turns` turns, each a new user message of ~`--turn-tokens` tokens (English
   prose) plus the whole history, answered in `--answer-tokens` tokens. Per turn: prompt
   tokens, tokens reused, TTFT with and without the cache (medians of `--repeats` chats).
2. **Users sharing a system prompt**: `--users` requests at once, each the same system prompt
   of ~`--system-tokens` tokens and its own question; mean and slowest TTFT, and what each
   node's `meshnet_prefix_*` metrics say it reused.
3. **Nothing shared**: prompts with no common block, one by one: median TTFT and decode
   tokens/s with and without the cache (what keeping every request costs).
"""

from __future__ import annotations

import argparse
import re
import secrets
import statistics
import tempfile
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx

from pipeline import DATA, free_port, running, wait_routable
from wan import wait_answers

WORDS_PER_TOKEN = 0.75  # English prose in SmolLM2's tokenizer, roughly
SAME = (
    "(same text: with and without the cache, or at once and alone; a ggml span's floats "
    "depend on where a session's cells lie in its pool and on who shares its round, so "
    "greedy text may part at a near tie there, ADR-0058; torch spans answer the same)"
)


def mesh_commands(logs: Path, quant: list[str]) -> tuple[str, list[str], list[list[str]]]:
    """The tracker's URL, the nodes' URLs and every process's command."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    tracker = ["tracker", "--port", str(port), "--layers", "0:10", *quant]
    tracker += ["--prefix-sharing", "all", "--spot-check-rate", "0"]
    commands = [tracker + ["--data-dir", str(logs / "tracker")]]
    nodes = []
    for i, span in enumerate(("10:20", "20:30")):
        node_port = free_port()
        nodes.append(f"http://127.0.0.1:{node_port}")
        commands.append(
            ["node", "--tracker", url, "--port", str(node_port), "--layers", span, *quant]
            + ["--no-entry", "--data-dir", str(logs / f"node{i}")]
        )
    return url, nodes, commands


class Text:
    """Fresh English prose, a passage at a time (never the same twice in one run)."""

    def __init__(self) -> None:
        self.words = DATA.read_text().split()
        self.at = 0

    def take(self, tokens: int) -> str:
        count = int(tokens * WORDS_PER_TOKEN)
        if self.at + count > len(self.words):
            self.at = 0
        piece = self.words[self.at : self.at + count]
        self.at += count
        return f"[{secrets.token_hex(3)}] " + " ".join(piece)


def chat(client: httpx.Client, messages: list[dict[str, str]], tokens: int) -> dict[str, Any]:
    """Both answers to `messages`: with the cache, then without; raises when they differ."""
    body = {"model": "default", "messages": messages, "temperature": 0, "max_tokens": tokens}
    cached = client.post("/v1/chat/completions", json=body).json()
    fresh = client.post("/v1/chat/completions", json=body | {"cache_prompt": False}).json()
    text = cached["choices"][0]["message"]["content"]
    return {
        "text": text,
        "same": text == fresh["choices"][0]["message"]["content"],
        "prompt": cached["usage"]["prompt_tokens"],
        "reused": cached["usage"]["prompt_tokens_details"]["cached_tokens"],
        "cached_s": cached["meshnet"]["time_to_first_token_s"],
        "fresh_s": fresh["meshnet"]["time_to_first_token_s"],
        "cached_tps": cached["meshnet"]["decode_tokens_per_s"],
        "fresh_tps": fresh["meshnet"]["decode_tokens_per_s"],
    }


def conversation(client: httpx.Client, text: Text, args: argparse.Namespace) -> list[dict]:  # type: ignore[type-arg]
    messages = [{"role": "system", "content": "You are a careful reader. Answer briefly."}]
    turns = []
    for _ in range(args.turns):
        messages.append({"role": "user", "content": "Read on: " + text.take(args.turn_tokens)})
        turn = chat(client, messages, args.answer_tokens)
        turns.append(turn)
        messages.append({"role": "assistant", "content": turn["text"]})
    return turns


def chat_table(client: httpx.Client, text: Text, args: argparse.Namespace) -> None:
    runs = [conversation(client, text, args) for _ in range(args.repeats)]
    print(f"\n### A chat of {args.turns} turns (~{args.turn_tokens} new tokens each)\n")
    print("| turn | prompt tokens | reused | TTFT cached ms | TTFT uncached ms | uncached/cached "
          "| same text |")  # fmt: skip
    print("|---:|---:|---:|---:|---:|---:|---|")
    medians = []
    for turn in range(args.turns):
        rows = [run[turn] for run in runs]
        cached = statistics.median(r["cached_s"] for r in rows)
        fresh = statistics.median(r["fresh_s"] for r in rows)
        medians.append((cached, fresh))
        print(
            f"| {turn + 1} | {rows[0]['prompt']} | {rows[0]['reused']} | {cached * 1000:.0f} | "
            f"{fresh * 1000:.0f} | {fresh / cached:.2f}x | "
            f"{'yes' if all(r['same'] for r in rows) else 'NO'} |"
        )
    last, first = medians[-1], medians[0]
    print(
        f"\nturn {args.turns} / turn 1 TTFT: {last[0] / first[0]:.2f}x with the cache "
        f"(target 1.3x at most), {last[1] / first[1]:.2f}x without"
    )
    print(SAME)


def node_reuse(nodes: list[str]) -> list[tuple[int, int]]:
    """Each node's (prefix hits, tokens reused) so far."""
    found = []
    for url in nodes:
        text = httpx.get(f"{url}/metrics", timeout=10).text
        values = [
            re.search(rf"^meshnet_prefix_{name} (\S+)$", text, re.M)
            for name in ("hits", "tokens_reused")
        ]
        hits, tokens = (int(float(v.group(1))) if v else 0 for v in values)
        found.append((hits, tokens))
    return found


def users_table(
    client: httpx.Client, text: Text, nodes: list[str], args: argparse.Namespace
) -> None:
    system = "Instructions: " + text.take(args.system_tokens)
    questions = [f"Question {i}: what is the passage about?" for i in range(args.users)]
    print(f"\n### {args.users} users at once, one system prompt of ~{args.system_tokens} tokens\n")
    print("| cache | mean TTFT ms | slowest TTFT ms | reused (sum) | node hits | node tokens "
          "reused | same text |")  # fmt: skip
    print("|---|---:|---:|---:|---|---|---|")
    for cache in (True, False):
        before = node_reuse(nodes)
        system = "Instructions: " + text.take(args.system_tokens)  # new each time: cold

        def ask(question: str, system: str = system, cache: bool = cache) -> dict[str, Any]:
            messages = [
                {"role": "system", "content": system},
                {"role": "user", "content": question},
            ]
            body = {"model": "default", "messages": messages, "temperature": 0, "max_tokens": 8}
            return dict(
                client.post("/v1/chat/completions", json=body | {"cache_prompt": cache}).json()
            )

        with ThreadPoolExecutor(args.users) as pool:
            answers = list(pool.map(ask, questions))
        firsts = [a["meshnet"]["time_to_first_token_s"] for a in answers]
        reused = sum(a["usage"]["prompt_tokens_details"]["cached_tokens"] for a in answers)
        after = node_reuse(nodes)
        hits = [b[0] - a[0] for a, b in zip(before, after, strict=True)]
        tokens = [b[1] - a[1] for a, b in zip(before, after, strict=True)]
        alone = [ask(q, system, False)["choices"][0]["message"]["content"] for q in questions[:2]]
        same = all(
            a["choices"][0]["message"]["content"] == b for a, b in zip(answers, alone, strict=False)
        )
        print(
            f"| {'on' if cache else 'off'} | {statistics.mean(firsts) * 1000:.0f} | "
            f"{max(firsts) * 1000:.0f} | {reused} | {hits} | {tokens} | {'yes' if same else 'NO'} |"
        )


def unshared_table(client: httpx.Client, text: Text, args: argparse.Namespace) -> None:
    rows = []
    for _ in range(args.unshared):
        messages = [{"role": "user", "content": text.take(args.turn_tokens)}]
        rows.append(chat(client, messages, args.answer_tokens))
    cached = statistics.median(r["cached_s"] for r in rows)
    fresh = statistics.median(r["fresh_s"] for r in rows)
    cached_tps = statistics.median(r["cached_tps"] for r in rows)
    fresh_tps = statistics.median(r["fresh_tps"] for r in rows)
    print(f"\n### Nothing shared: {args.unshared} prompts of ~{args.turn_tokens} tokens\n")
    print("| cache | median TTFT ms | median decode tokens/s |")
    print("|---|---:|---:|")
    print(f"| on | {cached * 1000:.0f} | {cached_tps:.1f} |")
    print(f"| off | {fresh * 1000:.0f} | {fresh_tps:.1f} |")
    print(f"\ncost of keeping every request: TTFT {cached / fresh - 1:+.1%}, decode "
          f"{1 - cached_tps / fresh_tps:+.1%} (target within 3%)")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--quant", default=None, help="the mesh's --quant (default: the file's)")
    parser.add_argument("--turns", type=int, default=10)
    parser.add_argument("--turn-tokens", type=int, default=200)
    parser.add_argument("--answer-tokens", type=int, default=32)
    parser.add_argument("--users", type=int, default=8)
    parser.add_argument("--system-tokens", type=int, default=1000)
    parser.add_argument("--unshared", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    if args.tiny:
        args.turns, args.turn_tokens, args.answer_tokens, args.repeats = 3, 72, 4, 1
        args.users, args.system_tokens, args.unshared = 2, 128, 1
    quant = ["--quant", args.quant] if args.quant else []
    tables: list[Callable[[httpx.Client, Text, list[str]], None]] = [
        lambda c, t, n: chat_table(c, t, args),
        lambda c, t, n: users_table(c, t, n, args),
        lambda c, t, n: unshared_table(c, t, args),
    ]
    with tempfile.TemporaryDirectory(prefix="meshnet-prefix-") as logs:
        url, nodes, commands = mesh_commands(Path(logs), quant)
        with running(commands, Path(logs), "", {"MESHNET_SWARM_KEY": secrets.token_hex(32)}):
            wait_routable(url, 3)
            with httpx.Client(base_url=url, timeout=600) as client:
                wait_answers(client)
                chat(client, [{"role": "user", "content": "Hello."}], 4)  # warm-up
                text = Text()
                for table in tables:
                    table(client, text, nodes)


if __name__ == "__main__":
    main()

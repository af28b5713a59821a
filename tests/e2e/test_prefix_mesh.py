"""Prompt prefixes reused across requests (ADR-0058) in real processes: the shared mesh of
`tests/e2e/mesh.py` (fp32 layers, three hops; the `node --entry` process pushes). Every
answer with the cache equals the same request with `cache_prompt: false` (no reuse, nothing
kept), token for token; `usage.prompt_tokens_details.cached_tokens` says what was reused and
the hops' `meshnet_prefix_*` metrics that they forked it.
"""

from __future__ import annotations

import re
import secrets
import signal
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import openai
import pytest

from tests.e2e.mesh import API_KEY, Mesh

pytestmark = pytest.mark.slow
QUESTIONS = [
    "Tell me about the moon in two sentences.",
    "And what about the sun?",
    "Which one is bigger?",
    "How far apart are they?",
    "Thank you. Summarize what you said.",
]


def ask(url: str, body: dict[str, Any], key: str = "unused") -> dict[str, Any]:
    headers = {"Authorization": f"Bearer {key}"}
    answer = httpx.post(f"{url}/v1/chat/completions", json=body, headers=headers, timeout=120)
    assert answer.status_code == 200, answer.text
    return dict(answer.json())


def both(url: str, messages: list[dict[str, str]], key: str = "unused") -> tuple[str, str, int]:
    """The answer with the cache, the answer without it, and the tokens the first reused."""
    body = {"model": "default", "messages": messages, "temperature": 0, "max_tokens": 24}
    cached = ask(url, body, key)
    fresh = ask(url, body | {"cache_prompt": False}, key)
    assert fresh["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    text = cached["choices"][0]["message"]["content"]
    reused = cached["usage"]["prompt_tokens_details"]["cached_tokens"]
    return text, fresh["choices"][0]["message"]["content"], reused


def prefix_hits(mesh: Mesh) -> int:
    """Forks from kept prefixes on the four plain nodes together."""
    total = 0
    for address in mesh.addresses.values():
        try:
            text = httpx.get(f"{address}/metrics", timeout=5).text
        except httpx.HTTPError:
            continue  # a node a test killed
        found = re.search(r"^meshnet_prefix_hits (\S+)$", text, re.M)
        total += int(float(found.group(1))) if found else 0
    return total


def test_a_five_turn_conversation_reuses_its_history_and_answers_the_same(mesh: Mesh) -> None:
    nonce = secrets.token_hex(4)  # no other test's kept prefix matches this conversation
    messages = [{"role": "system", "content": f"Conversation {nonce}. Be brief. " * 8}]
    hits = prefix_hits(mesh)
    reused = []
    for question in QUESTIONS:
        messages.append({"role": "user", "content": question})
        cached, fresh, tokens = both(mesh.url, messages)
        assert cached == fresh, (question, cached, fresh)
        reused.append(tokens)
        messages.append({"role": "assistant", "content": cached})
    assert reused[0] == 0 and all(r >= 64 for r in reused[1:]), reused
    # in whole blocks (review P1): a short turn may add no block
    assert all(b >= a for a, b in zip(reused[1:], reused[2:], strict=False)), reused
    assert reused[-1] > reused[1], reused
    assert prefix_hits(mesh) >= hits + 2 * (len(QUESTIONS) - 1)  # both remote hops, each turn


def test_users_sharing_a_system_prompt_through_the_pushing_entry(mesh: Mesh) -> None:
    """Four requests at once with one API key (one scope) and one long system prompt: the
    answers equal the same requests without the cache, and the later ones reused it."""
    system = f"Shared instructions {secrets.token_hex(4)}: answer in one short line. " * 10
    users = ["Name a fruit.", "Name a river.", "Name a colour.", "Name a planet."]

    def one(question: str) -> tuple[str, str, int]:
        messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
        return both(mesh.entry, messages, API_KEY)

    greeting = [{"role": "system", "content": system}, {"role": "user", "content": "Hello."}]
    body = {"model": "default", "messages": greeting, "max_tokens": 4, "temperature": 0}
    ask(mesh.entry, body, API_KEY)  # the system prompt, kept for the others
    with ThreadPoolExecutor(len(users)) as pool:
        results = list(pool.map(one, users))
    for cached, fresh, reused in results:
        assert cached == fresh
        assert reused >= 100  # the system prompt (~150 tokens) at least, from the first one


def test_a_prompt_diverging_inside_a_block_reuses_exactly_the_common_tokens(
    mesh: Mesh, smollm_tokenizer: Any
) -> None:
    client = openai.OpenAI(base_url=f"{mesh.url}/v1", api_key="unused", timeout=120)
    head = f"Notes {secrets.token_hex(4)}. " + "The quick brown fox jumps over the lazy dog. " * 9
    first, second = head + "Then it rested.", head + "Later, the dog woke up."
    client.completions.create(model="default", prompt=first, max_tokens=4, temperature=0)
    answer = client.completions.create(model="default", prompt=second, max_tokens=16, temperature=0)
    fresh = client.completions.create(
        model="default", prompt=second, max_tokens=16, temperature=0,
        extra_body={"cache_prompt": False},
    )  # fmt: skip
    assert answer.choices[0].text == fresh.choices[0].text
    a = smollm_tokenizer.encode(first, add_special_tokens=False)
    b = smollm_tokenizer.encode(second, add_special_tokens=False)
    common = next(i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y)
    assert common % 64 != 0  # inside a block
    assert answer.usage is not None and answer.usage.prompt_tokens_details is not None
    # said in whole blocks (review P1): the exact count is an oracle of where prompts part
    assert answer.usage.prompt_tokens_details.cached_tokens == common // 64 * 64


def test_a_hop_killed_between_turns_is_replaced_and_the_answer_is_the_same(mesh: Mesh) -> None:
    """The kept prefix's route names a dead node: its fork frame fails, the entry replays
    the kept inputs into another copy of the span, and the turn answers as without cache."""
    messages = [{"role": "system", "content": f"Session {secrets.token_hex(4)}. " * 30}]
    messages.append({"role": "user", "content": QUESTIONS[0]})
    body = {"model": "default", "messages": messages, "temperature": 0, "max_tokens": 16}
    first = ask(mesh.url, body)
    hop = next(h for h in first["meshnet"]["route"] if h["span"] == "10:20")
    victim = next(n for n, a in mesh.addresses.items() if a == hop["address"])
    mesh.procs[victim].send_signal(signal.SIGKILL)
    mesh.procs[victim].wait()
    messages += [first["choices"][0]["message"], {"role": "user", "content": QUESTIONS[1]}]
    messages[-2] = {"role": "assistant", "content": messages[-2]["content"]}
    cached = ask(mesh.url, body | {"messages": messages})
    fresh = ask(mesh.url, body | {"messages": messages, "cache_prompt": False})
    assert cached["choices"][0]["message"] == fresh["choices"][0]["message"]
    assert cached["usage"]["prompt_tokens_details"]["cached_tokens"] > 64
    assert hop["address"] not in [h["address"] for h in cached["meshnet"]["route"]]
    assert len(cached["meshnet"]["failover_pauses_s"]) == 1

"""Streaming answers from the real mesh, with a hook on every token and its arrival time."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx
import torch

from tests.e2e.mesh import Mesh

TOKENS = 48


@dataclass
class Streamed:
    """One streamed answer: its text, the final event's `meshnet` field, token times (s)."""

    text: str = ""
    meshnet: dict[str, Any] = field(default_factory=dict)
    times_s: list[float] = field(default_factory=list)  # monotonic arrival of each token

    @property
    def pauses_s(self) -> list[float]:
        return list(self.meshnet.get("failover_pauses_s", []))

    def longest_gap_s(self) -> float:
        """The longest wait between two tokens (what a user sees of a failover)."""
        gaps = [b - a for a, b in zip(self.times_s, self.times_s[1:], strict=False)]
        return max(gaps, default=0.0)


def stream(
    url: str,
    body: dict[str, Any],
    on_token: Callable[[int], object] = lambda n: None,
    headers: dict[str, str] | None = None,
) -> Streamed:
    """POST a streaming chat (`messages`) or completion (`prompt`) request to `url`;
    `on_token(n)` runs after the n-th content chunk arrives."""
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    out, parts = Streamed(), []
    payload = {"model": "default", "temperature": 0, "max_tokens": TOKENS, **body, "stream": True}
    with httpx.stream("POST", f"{url}{path}", json=payload, headers=headers, timeout=120) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[len("data: ") :])
            assert "error" not in event, event
            for choice in event["choices"]:
                text = choice["delta"].get("content") if "delta" in choice else choice["text"]
                if text:
                    parts.append(text)
                    out.times_s.append(time.monotonic())
                    on_token(len(parts))
            out.meshnet = event.get("meshnet", out.meshnet)
    out.text = "".join(parts)
    return out


def reference_text(model: Any, tokenizer: Any, ids: list[int], tokens: int) -> str:
    """Monolithic transformers greedy `generate` (fp32): the text of `tokens` new tokens."""
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([ids]),
            max_new_tokens=tokens,
            do_sample=False,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.eos_token_id,
        )
    return str(tokenizer.decode(out[0, len(ids) :], skip_special_tokens=True))


def chat(prompt: str) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": prompt}]}


def spare(mesh: Mesh) -> set[str]:
    """Nodes whose every span has another live copy: killing one leaves a replacement."""
    coverage = mesh.coverage()
    layers = coverage["models"][0]["layers"]
    names = {a: n for n, a in mesh.addresses.items()}
    return {
        names[node["address"]]
        for node in coverage["nodes"]
        if node["address"] in names
        and node["loaded"]
        and not node["suspect"]
        and all(len(layers[s["span"]["start"]]["serving"]) >= 2 for s in node["loaded"])
    }


def busy_spare(mesh: Mesh) -> list[str]:
    """Spare-backed nodes holding a session right now (hops of a running route)."""
    candidates = spare(mesh)
    return [name for name in mesh.addresses if name in candidates and mesh.sessions(name) > 0]

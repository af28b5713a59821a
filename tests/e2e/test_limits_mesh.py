"""The API limits set by flag reach a real process: the shared mesh's `node --entry` runs with
`--max-prompt-tokens 1000 --max-tokens-limit 100 --max-body 64KB` (`ENTRY_LIMITS`), the
tracker-as-entry with the defaults. Each refusal names its limit and changes nothing."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
import torch

from tests.e2e.mesh import API_KEY, ENTRY_LIMITS, Mesh

pytestmark = pytest.mark.slow
BEARER = {"Authorization": f"Bearer {API_KEY}"}


def complete(url: str, **body: Any) -> httpx.Response:
    payload = {"model": "default", "temperature": 0, "max_tokens": 2, **body}
    return httpx.post(f"{url}/v1/completions", json=payload, headers=BEARER, timeout=120)


def test_limit_flags_reach_the_entry_process(
    mesh: Mesh, smollm_tokenizer: Any, english_ids: torch.Tensor
) -> None:
    assert ENTRY_LIMITS["--max-prompt-tokens"] == "1000"
    long_prompt = str(smollm_tokenizer.decode(english_ids[0, :1100]))
    refused = complete(mesh.entry, prompt=long_prompt)
    assert refused.status_code == 400, refused.text
    assert "at most 1000" in refused.json()["error"]["message"]
    assert complete(mesh.url, prompt=long_prompt).status_code == 200  # default: 8192

    too_many = complete(mesh.entry, prompt="Hello", max_tokens=101)
    assert too_many.status_code == 400
    assert too_many.json()["error"]["param"] == "max_tokens"
    assert "at most 100" in too_many.json()["error"]["message"]

    big = complete(mesh.entry, prompt="x" * 70_000)  # a JSON body over 64 KB
    assert big.status_code == 413 and big.json()["error"]["field"] == "body"

    fine = complete(mesh.entry, prompt="The capital of France is", max_tokens=100)
    assert fine.status_code == 200, fine.text
    # a chat naming no max_tokens gets the default (256) capped at the limit, not a 400
    question = {"model": "default", "messages": [{"role": "user", "content": "Hi!"}]}
    url = f"{mesh.entry}/v1/chat/completions"
    chat = httpx.post(url, json=question, headers=BEARER, timeout=120)
    assert chat.status_code == 200, chat.text
    assert chat.json()["usage"]["completion_tokens"] <= 100
    assert all(mesh.sessions(name) == 0 for name in mesh.addresses)  # refusals left nothing

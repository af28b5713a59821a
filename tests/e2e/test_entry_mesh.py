"""The whole system in real processes (the shared mesh of `tests/e2e/mesh.py`), default model.

Greedy output through the mesh (3 hops, bf16 activations on the wire, fp32 weights) must
equal monolithic transformers `generate` at fp32, through raw HTTP and the `openai` client,
streaming and not, with a prompt long enough for chunked prefill.
"""

from __future__ import annotations

import io
import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import openai
import pytest
import torch

from meshnet.terminal import GenerateOptions, run_chat
from tests.e2e.mesh import API_KEY, Mesh
from tests.e2e.procs import wait_for
from tests.e2e.streams import reference_text

pytestmark = pytest.mark.slow
NEW_TOKENS = 64
STORY = "Write a short story about a robot who learns to paint."


@pytest.fixture(scope="module")
def tokenizer(smollm_tokenizer: Any) -> Any:
    return smollm_tokenizer


def reference(model: Any, tokenizer: Any, ids: list[int]) -> str:
    """Monolithic transformers greedy `generate` at fp32: the text of the new tokens."""
    return reference_text(model, tokenizer, ids, NEW_TOKENS)


def chat_ids(tokenizer: Any, question: str) -> list[int]:
    messages = [{"role": "user", "content": question}]
    encoded = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=True
    )
    return [int(i) for i in encoded["input_ids"]]


@pytest.fixture(scope="module")
def long_prompt(tokenizer: Any, english_ids: torch.Tensor) -> str:
    return str(tokenizer.decode(english_ids[0, :330]))


def test_greedy_chat_equals_monolithic_generate(
    mesh: Mesh, smollm_reference: Any, tokenizer: Any
) -> None:
    expected = reference(smollm_reference, tokenizer, chat_ids(tokenizer, STORY))
    body = {
        "model": "default",
        "messages": [{"role": "user", "content": STORY}],
        "temperature": 0,
        "max_tokens": NEW_TOKENS,
    }
    answer = httpx.post(f"{mesh.url}/v1/chat/completions", json=body, timeout=120).json()
    assert answer["choices"][0]["message"]["content"] == expected
    assert answer["usage"]["completion_tokens"] == NEW_TOKENS
    assert [h["span"] for h in answer["meshnet"]["route"]] == ["0:10", "10:20", "20:30"]


def test_long_prompt_with_the_openai_client_streaming_and_not(
    mesh: Mesh, smollm_reference: Any, tokenizer: Any, long_prompt: str
) -> None:
    ids = tokenizer.encode(long_prompt, add_special_tokens=False)
    assert len(ids) > 300  # three 128-token prefill chunks
    expected = reference(smollm_reference, tokenizer, ids)
    client = openai.OpenAI(base_url=f"{mesh.url}/v1", api_key="unused", timeout=120)
    plain = client.completions.create(
        model="default", prompt=long_prompt, max_tokens=NEW_TOKENS, temperature=0
    )
    assert plain.choices[0].text == expected
    assert plain.usage is not None and plain.usage.prompt_tokens == len(ids)
    stream = client.completions.create(
        model="default", prompt=long_prompt, max_tokens=NEW_TOKENS, temperature=0, stream=True
    )
    assert "".join(c.choices[0].text for c in stream if c.choices) == expected


def test_openai_chat_streaming_answers_paris(mesh: Mesh) -> None:
    client = openai.OpenAI(base_url=f"{mesh.url}/v1", api_key="unused", timeout=120)
    assert [m.id for m in client.models.list().data] == ["default"]
    stream = client.chat.completions.create(
        model="default",
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        temperature=0,
        stream=True,
    )
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text == "The capital of France is Paris."


def test_parallel_requests_equal_the_same_requests_one_by_one(mesh: Mesh) -> None:
    questions = ["What is 2 + 2?", "Name a colour.", "What is the capital of Italy?"]

    def ask(question: str) -> str:
        body = {
            "model": "default",
            "messages": [{"role": "user", "content": question}],
            "temperature": 0,
            "max_tokens": 16,
        }
        answer = httpx.post(f"{mesh.url}/v1/chat/completions", json=body, timeout=120)
        return str(answer.json()["choices"][0]["message"]["content"])

    one_by_one = [ask(q) for q in questions]
    before = batched_steps(mesh.url)
    with ThreadPoolExecutor(len(questions)) as pool:
        assert list(pool.map(ask, questions)) == one_by_one
    assert all(mesh.sessions(name) == 0 for name in mesh.addresses)  # every session closed
    assert batched_steps(mesh.url) > before  # the entry ran decode steps of several at once


def test_openai_client_gets_several_answers_from_one_prefill(mesh: Mesh) -> None:
    """`n` (issue #25, ADR-0045): greedy answers all equal the single one, and the hops
    receive the prompt once (bytes received, every plain node together)."""
    client = openai.OpenAI(base_url=f"{mesh.url}/v1", api_key="unused", timeout=120)
    question = [{"role": "user", "content": "What is the capital of France?"}]

    def received(n: int) -> tuple[list[str | None], float]:
        before = sum(bytes_received(address) for address in mesh.addresses.values())
        chat = client.chat.completions.create(
            model="default", messages=question, temperature=0, n=n
        )
        after = sum(bytes_received(address) for address in mesh.addresses.values())
        return [c.message.content for c in chat.choices], after - before

    one, one_bytes = received(1)
    three, three_bytes = received(3)
    assert one == ["The capital of France is Paris."] and three == one * 3
    assert three_bytes < 1.8 * one_bytes  # three prefills would be about 3x
    assert all(mesh.sessions(name) == 0 for name in mesh.addresses)


def bytes_received(url: str) -> float:
    lines = httpx.get(f"{url}/metrics", timeout=5).text.splitlines()
    return sum(
        float(line.split()[-1]) for line in lines if line.startswith("meshnet_bytes_received_total")
    )


def batched_steps(url: str) -> float:
    """Decode passes of a process that held more than one session (`/metrics`)."""
    lines = httpx.get(f"{url}/metrics", timeout=5).text.splitlines()
    counts = {
        line.split('le="')[1].split('"')[0]: float(line.split()[-1])
        for line in lines
        if line.startswith("meshnet_decode_batch_rows_bucket")
    }
    return counts["+Inf"] - counts["1.0"]


def test_openai_client_gets_logprobs_and_sends_penalties(mesh: Mesh) -> None:
    """Through the 3-process mesh with the real `openai` package (issue #25)."""
    client = openai.OpenAI(base_url=f"{mesh.url}/v1", api_key="unused", timeout=120)
    question = [{"role": "user", "content": "What is the capital of France?"}]
    chat = client.chat.completions.create(
        model="default", messages=question, temperature=0, logprobs=True, top_logprobs=2
    )
    choice = chat.choices[0]
    assert choice.message.content == "The capital of France is Paris."
    assert choice.logprobs is not None and choice.logprobs.content is not None
    entries = choice.logprobs.content
    assert "".join(e.token for e in entries) == choice.message.content
    assert all(e.logprob <= 0 and e.top_logprobs[0].token == e.token for e in entries)
    text = client.completions.create(
        model="default",
        prompt="The capital of France is",
        max_tokens=4,
        temperature=0,
        logprobs=1,
        frequency_penalty=0.5,
        presence_penalty=0.5,
    )
    lists = text.choices[0].logprobs
    assert lists is not None and "".join(lists.tokens or []) == text.choices[0].text
    assert len(lists.token_logprobs or []) == 4 and lists.text_offset == sorted(
        lists.text_offset or []
    )


def test_openai_client_gets_json_matching_its_schema(mesh: Mesh) -> None:
    """Structured output through the 3-process mesh: the answer parses and matches."""
    client = openai.OpenAI(base_url=f"{mesh.url}/v1", api_key="unused", timeout=120)
    schema = {
        "type": "object",
        "properties": {
            "country": {"type": "string", "maxLength": 20},
            "capital": {"type": "string", "maxLength": 20},
        },
        "required": ["country", "capital"],
        "additionalProperties": False,
    }
    question = [{"role": "user", "content": "What is the capital of France? Answer in JSON."}]
    chat = client.chat.completions.create(
        model="default",
        messages=question,
        temperature=0,
        max_tokens=60,
        response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": schema}},
    )
    answer = json.loads(chat.choices[0].message.content or "")
    assert set(answer) == {"country", "capital"} and chat.choices[0].finish_reason == "stop"
    assert "Paris" in answer["capital"]


def test_openai_client_round_trip_with_a_tool(mesh: Mesh) -> None:
    """The default model calls the declared function (required), gets its result back as a
    `tool` message and answers (issue #25)."""
    client = openai.OpenAI(base_url=f"{mesh.url}/v1", api_key="unused", timeout=120)
    weather = {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Today's weather in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "maxLength": 20}},
                "required": ["city"],
                "additionalProperties": False,
            },
        },
    }
    messages: list[Any] = [{"role": "user", "content": "What is the weather in Paris?"}]
    first = client.chat.completions.create(
        model="default",
        messages=messages,
        tools=[weather],
        tool_choice="required",
        temperature=0,
        max_tokens=40,
    )
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
    call = choice.message.tool_calls[0]
    assert call.function.name == "get_weather"
    assert "Paris" in json.loads(call.function.arguments)["city"]
    messages += [
        choice.message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"},
    ]
    second = client.chat.completions.create(
        model="default", messages=messages, tools=[weather], temperature=0, max_tokens=40
    )
    after = second.choices[0]
    assert after.finish_reason in ("stop", "length", "tool_calls")
    assert (after.message.content or "").strip() or after.message.tool_calls
    assert second.usage and first.usage  # the call and its result were read into the prompt
    assert second.usage.prompt_tokens > first.usage.prompt_tokens + first.usage.completion_tokens
    streamed = client.chat.completions.create(
        model="default",
        messages=messages[:1],
        tools=[weather],
        tool_choice="required",
        temperature=0,
        max_tokens=40,
        stream=True,
    )
    pieces = [
        c for chunk in streamed if chunk.choices for c in chunk.choices[0].delta.tool_calls or []
    ]
    assert len(pieces) > 2 and pieces[0].function and pieces[0].function.name == "get_weather"
    arguments = "".join(p.function.arguments or "" for p in pieces if p.function)
    assert json.loads(arguments) == json.loads(call.function.arguments)  # as it was written


def test_generate_command_streams_to_stdout(mesh: Mesh) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "meshnet.cli", "generate", "--tracker", mesh.url]
        + ["--temperature", "0", "What is the capital of France?"],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    assert out.stdout.strip() == "The capital of France is Paris."


def test_bad_requests_get_openai_errors_and_change_nothing(mesh: Mesh) -> None:
    url = mesh.url
    refused = httpx.post(f"{url}/v1/chat/completions", json={"model": "default"}, timeout=10)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "messages"
    unknown = httpx.post(
        f"{url}/v1/completions", json={"model": "gpt-9", "prompt": "hi"}, timeout=10
    )
    assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "model_not_found"
    test_openai_chat_streaming_answers_paris(mesh)


def test_chat_loop_keeps_the_conversation(mesh: Mesh) -> None:
    lines = iter(["What is the capital of France?", "And of Germany?", ""])
    out = io.StringIO()
    options = GenerateOptions(temperature=0, max_tokens=24)
    assert run_chat(mesh.url, options, ask=lambda _: next(lines), out=out) == 0
    transcript = out.getvalue()
    assert "The capital of France is Paris." in transcript
    assert "Berlin" in transcript  # the second turn saw the first


def test_a_node_started_as_entry_answers_through_the_same_mesh(mesh: Mesh) -> None:
    """Its API has a key: the real `openai` client is refused without it, served with it."""
    messages: Any = [{"role": "user", "content": "What is the capital of France?"}]
    other = openai.OpenAI(base_url=f"{mesh.entry}/v1", api_key="wrong-key-1", timeout=60)
    with other, pytest.raises(openai.AuthenticationError):
        other.chat.completions.create(model="default", messages=messages)
    with openai.OpenAI(base_url=f"{mesh.entry}/v1", api_key=API_KEY, timeout=120) as client:
        raw = client.chat.completions.with_raw_response.create(
            model="default", messages=messages, temperature=0
        )
        # its hops push (ADR-0034): forked answers' first frames go on hop to hop too
        several = client.chat.completions.create(
            model="default", messages=messages, temperature=0, n=2
        )
    answer = raw.http_response.json()
    assert answer["choices"][0]["message"]["content"] == "The capital of France is Paris."
    route = answer["meshnet"]["route"]
    assert [h["span"] for h in route] == ["0:10", "10:20", "20:30"]
    assert route[0]["address"] == "local"  # its own span, in its own process
    assert [c.message.content for c in several.choices] == ["The capital of France is Paris."] * 2


def test_a_client_leaving_mid_stream_frees_its_session_on_every_hop(mesh: Mesh) -> None:
    body = {
        "model": "default",
        "messages": [{"role": "user", "content": STORY}],
        "temperature": 0,
        "max_tokens": 500,
        "stream": True,
    }
    with httpx.stream("POST", f"{mesh.url}/v1/chat/completions", json=body, timeout=60) as r:
        for count, _ in enumerate(r.iter_lines()):
            if count == 10:
                assert sum(mesh.sessions(name) for name in mesh.addresses) == 2  # two hops
                break  # leaving the block closes the connection mid-answer
    wait_for(
        lambda: all(mesh.sessions(name) == 0 for name in mesh.addresses),
        10,
        "every hop to drop the session",
    )


def test_the_tracker_lists_both_entry_processes_as_entries(mesh: Mesh) -> None:
    listed = httpx.get(f"{mesh.url}/v1/entries", params={"model": "default"}).json()
    addresses = {e["address"] for e in listed["entries"]}
    assert addresses == {mesh.url, mesh.entry}  # tracker-as-node and `node --entry`
    assert all(e["span"] == {"start": 0, "end": 10} for e in listed["entries"])


def spot_checks(url: str) -> dict[str, float]:
    """`meshnet_spot_checks_total` by result, and the bans (`/metrics`)."""
    lines = httpx.get(f"{url}/metrics", timeout=5).text.splitlines()
    found = {
        line.split('result="')[1].split('"')[0]: float(line.split()[-1])
        for line in lines
        if line.startswith("meshnet_spot_checks_total{")
    }
    bans = [
        float(line.split()[-1])
        for line in lines
        if line.startswith("meshnet_spot_check_bans_total")
    ]
    return found | {"bans": bans[0] if bans else 0.0}


@pytest.mark.slow
def test_an_entry_checking_every_answer_finds_honest_real_shards_agree(mesh: Mesh) -> None:
    """`--spot-check-rate 1`: every hop answer is re-run on another copy of its span (real
    processes, fp32 shards): all agree within tolerance, nobody is banned, the answer is
    the same, and the throwaway check sessions leave every hop."""
    mesh.launch_pinned("checker", "0:10", "--spot-check-rate", "1")
    try:
        url = mesh.extra["checker"]
        wait_for(lambda: mesh.loaded(["checker"]), 120, "the checking entry")
        messages = [{"role": "user", "content": "What is the capital of France?"}]
        body = {"model": "default", "messages": messages, "temperature": 0}
        answer = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120).json()
        assert answer["choices"][0]["message"]["content"] == "The capital of France is Paris."
        wait_for(lambda: spot_checks(url).get("match", 0) >= 2, 60, "spot checks to finish")
        checks = spot_checks(url)
        assert checks.get("mismatch", 0) == 0 and checks["bans"] == 0, checks
        wait_for(
            lambda: all(mesh.sessions(name) == 0 for name in mesh.addresses),
            20,
            "check sessions to close",
        )
    finally:
        mesh.stop_extra(["checker"])

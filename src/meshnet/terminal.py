"""`meshnet generate` and `meshnet chat`: terminal clients of an entry node's API.

They speak the OpenAI-compatible API over HTTP (server-sent events), like any other client;
`--tracker URL` is the address of the tracker-as-entry-node (or of any entry node).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, TextIO

import httpx


class ApiError(Exception):
    """The API refused or failed a request; the message is the server's own."""


@dataclass(frozen=True)
class GenerateOptions:
    model: str | None = None  # None = the first model the entry serves
    max_tokens: int = 256
    temperature: float = 0.7
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    raw: bool = False  # a plain completion of the prompt, without the chat template
    timeout_s: float = 300.0
    api_key: str | None = None  # sent as `Authorization: Bearer`


def api_client(url: str, options: GenerateOptions) -> httpx.Client:
    headers = {"Authorization": f"Bearer {options.api_key}"} if options.api_key else {}
    return httpx.Client(base_url=url, timeout=options.timeout_s, headers=headers)


def first_model(client: httpx.Client) -> str:
    response = client.get("/v1/models")
    check_response(response)
    return str(response.json()["data"][0]["id"])


def stream(client: httpx.Client, options: GenerateOptions, body: dict[str, Any]) -> Iterator[str]:
    """Text pieces as they arrive from `/v1/chat/completions` or, with `prompt`, completions."""
    path = "/v1/completions" if "prompt" in body else "/v1/chat/completions"
    body = body | {
        "model": options.model or first_model(client),
        "max_tokens": options.max_tokens,
        "temperature": options.temperature,
        "top_p": options.top_p,
        "top_k": options.top_k,
        "seed": options.seed,
        "stop": list(options.stop) or None,
        "stream": True,
    }
    for event in events(client, path, body):
        for choice in event.get("choices", []):
            yield choice.get("text") or choice.get("delta", {}).get("content") or ""


def events(client: httpx.Client, path: str, body: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """The JSON events of one server-sent event stream; raises `ApiError` on errors."""
    with client.stream("POST", path, json=body) as response:
        if response.status_code != 200:
            response.read()
            check_response(response)
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[len("data: ") :])
            if "error" in event:
                raise ApiError(event["error"]["message"])
            yield event


def check_response(response: httpx.Response) -> None:
    """Raise `ApiError` with the server's own message when `response` is an error."""
    if response.status_code >= 400:
        try:
            message = response.json()["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = response.text[:300]
        raise ApiError(f"{response.status_code}: {message}")


def run_generate(url: str, prompt: str, options: GenerateOptions, out: TextIO = sys.stdout) -> int:
    body: dict[str, Any] = (
        {"prompt": prompt} if options.raw else {"messages": [{"role": "user", "content": prompt}]}
    )
    with api_client(url, options) as client:
        try:
            for piece in stream(client, options, body):
                out.write(piece)
                out.flush()
        except (ApiError, httpx.HTTPError) as exc:
            print(f"\nerror: {exc}", file=sys.stderr)
            return 1
    out.write("\n")
    return 0


def run_chat(
    url: str, options: GenerateOptions, ask: Callable[[str], str] = input, out: TextIO = sys.stdout
) -> int:
    """Read a line, stream the answer, repeat; the whole conversation goes with each turn."""
    messages: list[dict[str, str]] = []
    print("meshnet chat: an empty line or Ctrl-D ends it", file=out)
    with api_client(url, options) as client:
        while True:
            try:
                line = ask("> ").strip()
            except (EOFError, KeyboardInterrupt):
                line = ""
            if not line:
                return 0
            messages.append({"role": "user", "content": line})
            try:
                answer = "".join(_echo(stream(client, options, {"messages": messages}), out))
            except (ApiError, httpx.HTTPError) as exc:
                print(f"error: {exc}", file=out)
                messages.pop()
                continue
            messages.append({"role": "assistant", "content": answer})
            print(file=out)


def _echo(pieces: Iterator[str], out: TextIO) -> Iterator[str]:
    for piece in pieces:
        out.write(piece)
        out.flush()
        yield piece

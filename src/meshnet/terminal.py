"""`meshnet generate` and `meshnet chat`: terminal clients of an entry node's API.

They speak the OpenAI-compatible API over HTTP (server-sent events), like any other client.
`--tracker URL` is a tracker (or any entry node; URL1,URL2,...: the first of a mesh's trackers
that answers): they ask it for the model's entries
(`/v1/entries`) and send each request to the least loaded one directly, so the answer does
not pass through the tracker; an entry that cannot be reached or refuses before answering
(401, 403, 5xx) is skipped, and the tracker itself is the last resort.
"""

from __future__ import annotations

import contextlib
import json
import ssl
import sys
from collections.abc import Callable, Generator, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, TextIO

import httpx

try:
    import termios
except ImportError:  # not a Unix terminal: keys are left alone
    termios = None  # type: ignore[assignment]


class ApiError(Exception):
    """The API refused or failed a request; the message is the server's own."""


@dataclass(frozen=True)
class GenerateOptions:
    model: str | None = None  # None = the first model the entry serves
    max_tokens: int = 256
    # llama.cpp's and Ollama's defaults, which their users know (the HTTP API keeps OpenAI's)
    temperature: float = 0.8
    top_p: float = 0.95
    top_k: int = 40
    repetition_penalty: float = 1.1
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    raw: bool = False  # a plain completion of the prompt, without the chat template
    timeout_s: float = 300.0
    api_key: str | None = None  # sent as `Authorization: Bearer`
    ca_file: str | None = None  # https entries: trust this CA (PEM); None = the system's


def api_client(url: str, options: GenerateOptions) -> httpx.Client:
    headers = {"Authorization": f"Bearer {options.api_key}"} if options.api_key else {}
    verify = ssl.create_default_context(cafile=options.ca_file)
    return httpx.Client(base_url=url, timeout=options.timeout_s, headers=headers, verify=verify)


def first_model(client: httpx.Client) -> str:
    response = client.get("/v1/models")
    check_response(response)
    return str(response.json()["data"][0]["id"])


SKIPPED = (401, 403, 500, 502, 503, 504)  # an entry answering these: try the next one


class Skip(Exception):
    """This entry refused before answering; the next one may not."""


def entry_urls(client: httpx.Client, model: str) -> list[str]:
    """The entries of `model` the tracker at `client` lists, least loaded first; none when
    it is not a tracker (an entry node has no `/v1/entries`) or cannot say."""
    try:
        response = client.get("/v1/entries", params={"model": model})
        listed = response.json()["entries"] if response.status_code == 200 else []
        return [str(e["address"]) for e in listed]
    except (httpx.HTTPError, ValueError, KeyError, TypeError):
        return []


def stream(
    client: httpx.Client, options: GenerateOptions, body: dict[str, Any]
) -> Generator[str, None, None]:
    """Text pieces as they arrive from `/v1/chat/completions` or, with `prompt`, completions:
    from the model's least loaded entry that answers, else from `client` itself."""
    model = options.model or first_model(client)
    for url in entry_urls(client, model):
        if url.rstrip("/") == str(client.base_url).rstrip("/"):
            continue  # the tracker-as-node itself: asked last anyway
        with api_client(url, options) as direct:
            try:
                yield from _stream(direct, options, body, model, skip=True)
                return
            except (Skip, httpx.ConnectError, httpx.ConnectTimeout):
                continue
    yield from _stream(client, options, body, model, skip=False)


def _stream(
    client: httpx.Client, options: GenerateOptions, body: dict[str, Any], model: str, skip: bool
) -> Iterator[str]:
    path = "/v1/completions" if "prompt" in body else "/v1/chat/completions"
    body = body | {
        "model": model,
        "max_tokens": options.max_tokens,
        "temperature": options.temperature,
        "top_p": options.top_p,
        "top_k": options.top_k,
        "repetition_penalty": options.repetition_penalty,
        "frequency_penalty": options.frequency_penalty,
        "presence_penalty": options.presence_penalty,
        "seed": options.seed,
        "stop": list(options.stop) or None,
        "stream": True,
    }
    for event in events(client, path, body, skip):
        for choice in event.get("choices", []):
            yield choice.get("text") or choice.get("delta", {}).get("content") or ""


def events(
    client: httpx.Client, path: str, body: dict[str, Any], skip: bool = False
) -> Iterator[dict[str, Any]]:
    """The JSON events of one server-sent event stream; raises `ApiError` on errors (`Skip`
    for a refusal in `SKIPPED`, when `skip`)."""
    with client.stream("POST", path, json=body) as response:
        if response.status_code != 200:
            response.read()
            if skip and response.status_code in SKIPPED:
                raise Skip(response.status_code)
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


def answering(urls: Sequence[str], ca_file: str | None = None, timeout_s: float = 3.0) -> str:
    """The first of a mesh's trackers (`urls`, in order) that answers `/health`; the others
    are named on stderr. None answering: the first (its error is what the user sees)."""
    verify = ssl.create_default_context(cafile=ca_file)
    with httpx.Client(timeout=timeout_s, verify=verify) as client:
        for url in urls:
            try:
                if client.get(url.rstrip("/") + "/health").status_code == 200:
                    return url
            except httpx.HTTPError as exc:
                print(f"tracker {url} does not answer ({exc}); trying the next", file=sys.stderr)
    return urls[0]


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
    url: str,
    options: GenerateOptions,
    ask: Callable[[str], str] = input,
    out: TextIO = sys.stdout,
    keys: TextIO = sys.stdin,
) -> int:
    """Read a line, stream the answer, repeat; the whole conversation goes with each turn.

    While an answer streams, what is typed on `keys` (a terminal) is neither echoed into it
    nor kept for the next question, and Ctrl-C stops that answer (its text so far stays in
    the conversation), not the chat."""
    messages: list[dict[str, str]] = []
    print("meshnet chat: an empty line or Ctrl-D ends it; Ctrl-C stops an answer", file=out)
    with api_client(url, options) as client:
        while True:
            try:
                line = ask("> ").strip()
            except (EOFError, KeyboardInterrupt):
                line = ""
            if not line:
                return 0
            messages.append({"role": "user", "content": line})
            pieces: list[str] = []
            answer = stream(client, options, {"messages": messages})
            try:
                with muted(keys):
                    for piece in _echo(answer, out):
                        pieces.append(piece)
            except KeyboardInterrupt:
                print(" [stopped]", end="", file=out)
            except (ApiError, httpx.HTTPError) as exc:
                print(f"error: {exc}", file=out)
                messages.pop()
                continue
            finally:
                answer.close()  # ends the HTTP stream: the entry closes the session
            messages.append({"role": "assistant", "content": "".join(pieces)})
            print(file=out)


@contextlib.contextmanager
def muted(keys: TextIO) -> Iterator[None]:
    """On a terminal: no echo of typed keys while inside, and what was typed is dropped on
    the way out (it was typed at an answer, not as the next question)."""
    if termios is None or not keys.isatty():
        yield
        return
    fd = keys.fileno()
    saved = termios.tcgetattr(fd)
    quiet = list(saved)
    quiet[3] &= ~termios.ECHO  # lflag
    termios.tcsetattr(fd, termios.TCSANOW, quiet)
    try:
        yield
    finally:
        termios.tcflush(fd, termios.TCIFLUSH)
        termios.tcsetattr(fd, termios.TCSANOW, saved)


def _echo(pieces: Iterator[str], out: TextIO) -> Iterator[str]:
    for piece in pieces:
        out.write(piece)
        out.flush()
        yield piece

"""`meshnet generate`, `chat` and `status`: clients of a running mesh."""

from __future__ import annotations

import argparse
import os
from typing import Any

from meshnet.cli.access import not_on_argv
from meshnet.cli.flags import url_list
from meshnet.errors import MeshError
from meshnet.security.keys import resolve_swarm_key
from meshnet.status import run_status
from meshnet.terminal import GenerateOptions, answering, run_chat, run_generate

DEFAULT_TRACKER = "http://127.0.0.1:8000"


def add_client_commands(sub: Any) -> None:
    """`generate`, `chat` and `status` on the `meshnet` subparsers `sub`."""
    for name, text in (("generate", "stream one answer to stdout"), ("chat", "chat in a loop")):
        client = sub.add_parser(name, help=text)
        add_client_flags(client)
        if name == "generate":
            client.add_argument("prompt", help="the prompt (a user message unless --raw)")
            client.add_argument("--raw", action="store_true", help="complete the prompt as text")
    status = sub.add_parser("status", help="show a tracker's coverage map and nodes")
    status.add_argument(
        "--tracker",
        type=url_list,
        default=(DEFAULT_TRACKER,),
        help="the tracker's URL (URL1,URL2,...: the first of them that answers)",
    )
    status.add_argument(
        "--api-key",
        type=not_on_argv("set MESHNET_API_KEY"),
        help="refused: the API key comes from $MESHNET_API_KEY (none needed on loopback)",
    )
    status.add_argument("--swarm-key-file", help="sign with this swarm key file instead")
    status.add_argument("--tls-ca", help="an https tracker: trust this CA file (PEM)")


def add_client_flags(parser: argparse.ArgumentParser) -> None:
    default = GenerateOptions()
    parser.add_argument(
        "--tracker",
        type=url_list,
        default=(DEFAULT_TRACKER,),
        help="the tracker-as-entry-node (or an entry node) to ask; URL1,URL2,...: the first "
        f"of a mesh's trackers that answers (default {DEFAULT_TRACKER})",
    )
    parser.add_argument("--model", help="model id (default: the first one served)")
    parser.add_argument("--max-tokens", type=int, default=default.max_tokens)
    parser.add_argument(
        "--temperature",
        type=float,
        default=default.temperature,
        help="0 = greedy (default %(default)s)",
    )
    parser.add_argument("--top-p", type=float, default=default.top_p, help="(default %(default)s)")
    parser.add_argument(
        "--top-k", type=int, default=default.top_k, help="0 = no limit (default %(default)s)"
    )
    parser.add_argument(
        "--repetition-penalty",
        type=float,
        default=default.repetition_penalty,
        help="divide the logits of the last 64 tokens by this (1 = off; default %(default)s)",
    )
    parser.add_argument(
        "--frequency-penalty", type=float, default=0.0, help="OpenAI's, -2 to 2 (default 0)"
    )
    parser.add_argument(
        "--presence-penalty", type=float, default=0.0, help="OpenAI's, -2 to 2 (default 0)"
    )
    parser.add_argument("--seed", type=int, help="reproducible sampling")
    parser.add_argument("--stop", action="append", default=[], help="stop sequence (repeatable)")
    parser.add_argument(
        "--api-key",
        type=not_on_argv("set MESHNET_API_KEY"),
        help="refused: the API key to send comes from $MESHNET_API_KEY",
    )
    parser.add_argument("--tls-ca", help="an https entry: trust this CA file (PEM)")


def api_key() -> str | None:
    """The client's API key: `$MESHNET_API_KEY` (never argv, where `ps` shows it)."""
    return os.environ.get("MESHNET_API_KEY") or None


def generate_options(args: argparse.Namespace) -> GenerateOptions:
    return GenerateOptions(
        model=args.model,
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        repetition_penalty=args.repetition_penalty,
        frequency_penalty=args.frequency_penalty,
        presence_penalty=args.presence_penalty,
        seed=args.seed,
        stop=tuple(args.stop),
        raw=getattr(args, "raw", False),
        api_key=api_key(),
        ca_file=args.tls_ca,
    )


def status_swarm_key(args: argparse.Namespace) -> str | None:
    """A swarm key to sign `status` with, when this machine has one (never created here)."""
    if api_key():
        return None
    try:
        key, _ = resolve_swarm_key(args.swarm_key_file, create=False)
    except MeshError:
        return None
    return key


def run_client(args: argparse.Namespace) -> int:
    url = answering(args.tracker, args.tls_ca) if len(args.tracker) > 1 else args.tracker[0]
    if args.command == "generate":
        return run_generate(url, args.prompt, generate_options(args))
    if args.command == "chat":
        return run_chat(url, generate_options(args))
    return run_status(url, api_key(), status_swarm_key(args), ca_file=args.tls_ca)

"""The `meshnet` command: maps flags onto config records and starts a role; holds no logic."""

from __future__ import annotations

import argparse
import logging
import os
import re
import socket
import sys
from collections.abc import Sequence
from typing import Any

from meshnet import __version__
from meshnet.config import AccessConfig, ApiLimits, EntryConfig, NodeConfig, TrackerConfig
from meshnet.errors import MeshError
from meshnet.observe.logs import configure as configure_logging
from meshnet.security.keys import join_command, resolve_api_keys, resolve_swarm_key
from meshnet.status import run_status
from meshnet.terminal import GenerateOptions, run_chat, run_generate


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="meshnet",
        description="Run language models too big for one machine across many machines.",
    )
    parser.add_argument("--version", action="version", version=f"meshnet {__version__}")
    add_log_flags(parser, defaults=True)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    demo = sub.add_parser("demo", help="run the demo on the embedded default model")
    demo.add_argument("--max-tokens", type=int, default=32, help="answer length limit")
    demo.add_argument(
        "--keep-running",
        action="store_true",
        help="after the answer, keep the mesh up (dashboard, chat) until Ctrl-C",
    )
    node = sub.add_parser("node", help="serve a span of a model's layers")
    node.add_argument(
        "--model",
        default="default",
        help="'default', a .gguf file, a checkpoint folder or a hub id",
    )
    node.add_argument("--layers", help="the span to serve, 'start:end' (default: all)")
    node.add_argument(
        "--quant",
        choices=["fp32", "bf16", "int8", "nf4"],
        help="weight format (default: bf16 where fast, else fp32)",
    )
    node.add_argument("--host", default="127.0.0.1")
    node.add_argument("--port", type=int, default=8001)
    node.add_argument("--tracker", help="join this tracker (URL) and serve what it assigns")
    node.add_argument("--public-address", help="address peers use, if not http://HOST:PORT")
    node.add_argument(
        "--budget",
        type=parse_bytes,
        help="memory for weights and KV cache, e.g. 4GiB (default: free GPU "
        "memory, or half the available RAM)",
    )
    node.add_argument("--data-dir", help="where the node keeps its id (default ~/.meshnet)")
    node.add_argument(
        "--entry",
        action="store_true",
        help="also hold the head and serve the OpenAI-compatible API (needs --layers 0:K)",
    )
    add_node_limit_flags(node)
    add_access_flags(node)
    tracker = sub.add_parser(
        "tracker", help="run the control plane (with --layers or --budget: also an entry node)"
    )
    tracker.add_argument(
        "--model",
        action="append",
        dest="models",
        help="a model to offer (repeatable; default: default)",
    )
    tracker.add_argument("--host", default="127.0.0.1")
    tracker.add_argument("--port", type=int, default=8000)
    tracker.add_argument("--heartbeat-interval", type=float, default=2.0, help="seconds")
    tracker.add_argument(
        "--dead-after",
        type=float,
        default=6.0,
        help="seconds without a heartbeat before a node counts as dead",
    )
    tracker.add_argument(
        "--layers", help="serve layers 'start:end' of the first model here (start must be 0)"
    )
    tracker.add_argument(
        "--budget", type=parse_bytes, help="memory for its own span and head (picks K)"
    )
    tracker.add_argument("--quant", choices=["fp32", "bf16", "int8", "nf4"])
    tracker.add_argument("--data-dir", help="where its node id is kept (default ~/.meshnet)")
    add_node_limit_flags(tracker)
    add_access_flags(tracker)
    for name, text in (("generate", "stream one answer to stdout"), ("chat", "chat in a loop")):
        client = sub.add_parser(name, help=text)
        add_client_flags(client)
        if name == "generate":
            client.add_argument("prompt", help="the prompt (a user message unless --raw)")
            client.add_argument("--raw", action="store_true", help="complete the prompt as text")
    status = sub.add_parser("status", help="show a tracker's coverage map and nodes")
    status.add_argument("--tracker", default="http://127.0.0.1:8000", help="the tracker's URL")
    status.add_argument(
        "--api-key",
        default=os.environ.get("MESHNET_API_KEY"),
        help="an API key of the tracker (default: $MESHNET_API_KEY; none needed on loopback)",
    )
    status.add_argument("--swarm-key-file", help="sign with this swarm key file instead")
    for command in sub.choices.values():
        add_log_flags(command, defaults=False)
    return parser


def add_log_flags(parser: argparse.ArgumentParser, defaults: bool) -> None:
    """Log flags, accepted before or after the command (after wins)."""
    level: Any = "INFO" if defaults else argparse.SUPPRESS
    fmt: Any = "text" if defaults else argparse.SUPPRESS
    group = parser.add_argument_group("logging")
    group.add_argument("--log-level", default=level, help="logging level (default INFO)")
    group.add_argument(
        "--log-format",
        choices=["text", "json"],
        default=fmt,
        help="text lines, or one JSON object a line for machines (default text)",
    )


def add_access_flags(parser: argparse.ArgumentParser) -> None:
    """Membership (swarm key), client API keys and the API's per-client limits."""
    group = parser.add_argument_group("access")
    group.add_argument(
        "--swarm-key",
        help="the mesh's shared secret (default: $MESHNET_SWARM_KEY, or the key file)",
    )
    group.add_argument(
        "--swarm-key-file",
        help="the key file (default ~/.meshnet/swarm.key; a tracker creates it on first start)",
    )
    group.add_argument(
        "--api-key", action="append", dest="api_keys", help="a client API key (repeatable)"
    )
    group.add_argument("--api-keys-file", help="client API keys, one per line")
    group.add_argument(
        "--allow-unauthenticated",
        action="store_true",
        help="with no API key configured, serve the API to non-loopback clients too",
    )
    limits = parser.add_argument_group("API limits (per client)")
    default = ApiLimits()
    limits.add_argument("--max-body", type=parse_bytes, default=default.max_body_bytes)
    limits.add_argument("--max-prompt-tokens", type=int, default=default.max_prompt_tokens)
    limits.add_argument("--max-tokens-limit", type=int, default=default.max_tokens)
    limits.add_argument("--max-concurrent", type=int, default=default.max_concurrent_per_client)
    limits.add_argument(
        "--rate-limit",
        type=float,
        default=default.requests_per_minute,
        help="requests per minute per client (0 = none)",
    )


def add_node_limit_flags(parser: argparse.ArgumentParser) -> None:
    default = NodeConfig()
    group = parser.add_argument_group("node limits")
    group.add_argument("--max-sessions", type=int, default=default.max_sessions)
    group.add_argument(
        "--max-kv-cache",
        type=parse_bytes,
        default=default.max_cache_bytes,
        help="KV-cache memory for all sessions of a shard",
    )
    group.add_argument(
        "--session-ttl", type=float, default=default.session_ttl_s, help="idle seconds"
    )
    parser.add_argument(
        "--no-fast-path",
        dest="fast_path",
        action="store_false",
        help="run transformers' own layers instead of the fast decode path (for debugging)",
    )
    parser.add_argument(
        "--no-compile",
        dest="compile",
        action="store_false",
        help="run the fast path's decode step eagerly, without torch.compile (for debugging)",
    )


def add_client_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--tracker",
        default="http://127.0.0.1:8000",
        help="the tracker-as-entry-node (or an entry node) to ask (default %(default)s)",
    )
    parser.add_argument("--model", help="model id (default: the first one served)")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--temperature", type=float, default=0.7, help="0 = greedy")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0, help="0 = no limit")
    parser.add_argument("--seed", type=int, help="reproducible sampling")
    parser.add_argument("--stop", action="append", default=[], help="stop sequence (repeatable)")
    parser.add_argument(
        "--api-key",
        default=os.environ.get("MESHNET_API_KEY"),
        help="the API key to send (default: $MESHNET_API_KEY)",
    )


_UNITS = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 1 << 10,
    "MIB": 1 << 20,
    "GIB": 1 << 30,
    "TIB": 1 << 40,
}


def parse_bytes(text: str) -> int:
    """`4GiB`, `512MB`, `1e9` -> bytes."""
    match = re.fullmatch(r"\s*([0-9.eE+]+)\s*([A-Za-z]*)\s*", text)
    unit = match.group(2).upper() if match else "?"
    if match is None or unit not in _UNITS:
        raise argparse.ArgumentTypeError(f"expected a size like 4GiB or 512MB, got {text!r}")
    try:
        return int(float(match.group(1)) * _UNITS[unit])
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a size like 4GiB, got {text!r}") from None


def node_config(args: argparse.Namespace) -> NodeConfig:
    return NodeConfig(
        model=args.model,
        layers=args.layers,
        quant=args.quant,
        host=args.host,
        port=args.port,
        tracker_url=args.tracker,
        public_address=args.public_address,
        budget_bytes=args.budget,
        data_dir=args.data_dir,
        entry=args.entry,
        **node_limits(args),
    )


def tracker_node_config(args: argparse.Namespace) -> NodeConfig:
    """The tracker's own entry-node part (host, port and model come from the tracker)."""
    return NodeConfig(
        layers=args.layers,
        quant=args.quant,
        budget_bytes=args.budget,
        data_dir=args.data_dir,
        **node_limits(args),
    )


def node_limits(args: argparse.Namespace) -> dict[str, Any]:
    """The flags nodes and the tracker's own span share (limits, fast path) as `NodeConfig`
    fields."""
    return {
        "max_sessions": args.max_sessions,
        "max_cache_bytes": args.max_kv_cache,
        "session_ttl_s": args.session_ttl,
        "fast_path": args.fast_path,
        "compile": args.compile,
    }


def access_config(args: argparse.Namespace, create_key: bool) -> tuple[AccessConfig, str]:
    """The access settings, and where the swarm key came from (in words)."""
    key, origin = resolve_swarm_key(args.swarm_key, args.swarm_key_file, create=create_key)
    keys = resolve_api_keys(args.api_keys, args.api_keys_file)
    return AccessConfig(key, keys, args.allow_unauthenticated), origin


def api_limits(args: argparse.Namespace) -> ApiLimits:
    return ApiLimits(
        max_body_bytes=args.max_body,
        max_prompt_tokens=args.max_prompt_tokens,
        max_tokens=args.max_tokens_limit,
        max_concurrent_per_client=args.max_concurrent,
        requests_per_minute=args.rate_limit,
    )


def announce_tracker(args: argparse.Namespace, key: str, origin: str) -> None:
    """Print how a node joins this tracker (the key travels in the environment, not argv)."""
    host = args.host if args.host not in ("0.0.0.0", "::", "") else socket.gethostname()
    command = join_command(f"http://{host}:{args.port}", key)
    print(f"meshnet tracker: swarm key {origin}", flush=True)
    print(f"meshnet tracker: join this mesh with:\n  {command}", flush=True)


def status_swarm_key(args: argparse.Namespace) -> str | None:
    """A swarm key to sign `status` with, when this machine has one (never created here)."""
    if args.api_key:
        return None
    try:
        key, _ = resolve_swarm_key(None, args.swarm_key_file, create=False)
    except MeshError:
        return None
    return key


def generate_options(args: argparse.Namespace) -> GenerateOptions:
    return GenerateOptions(
        model=args.model,
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        stop=tuple(args.stop),
        raw=getattr(args, "raw", False),
        api_key=args.api_key,
    )


def tracker_config(args: argparse.Namespace) -> TrackerConfig:
    return TrackerConfig(
        models=tuple(args.models or ["default"]),
        host=args.host,
        port=args.port,
        heartbeat_interval_s=args.heartbeat_interval,
        dead_after_s=args.dead_after,
    )


def main(argv: Sequence[str] | None = None) -> int:
    # Before torch loads libgomp: idle OpenMP threads spin ~10x shorter than its default.
    # Single-process decode is unchanged (23.0 vs 22.2 ms per 30-layer step); nodes that
    # share cores stop stealing them from each other between steps (ADR-0021).
    os.environ.setdefault("GOMP_SPINCOUNT", "30000")
    parser = build_parser()
    args = parser.parse_args(argv)
    configure_logging(args.log_level, args.log_format)
    if args.command is None:
        parser.print_help()
        return 0
    try:
        return run_command(args)
    except MeshError as exc:  # a refused configuration: say why, without a traceback
        print(f"meshnet {args.command}: {exc.message}", file=sys.stderr)
        return 2


def run_command(args: argparse.Namespace) -> int:
    if args.command == "demo":
        from meshnet.demo import run_demo

        return run_demo(max_tokens=args.max_tokens, keep_running=args.keep_running)
    if args.command == "generate":
        return run_generate(args.tracker, args.prompt, generate_options(args))
    if args.command == "chat":
        return run_chat(args.tracker, generate_options(args))
    if args.command == "status":
        return run_status(args.tracker, args.api_key, status_swarm_key(args))
    if args.command == "node":
        return run_node(args)
    access, origin = access_config(args, create_key=True)
    announce_tracker(args, access.swarm_key or "", origin)
    if not access.api_keys and not access.allow_unauthenticated:
        logging.getLogger(__name__).info("no API keys: the API answers loopback clients only")
    if args.layers is None and args.budget is None:
        from meshnet.tracker.serve import serve as serve_tracker

        serve_tracker(tracker_config(args), access)
        return 0
    from meshnet.node.entry import serve_tracker_node

    config = tracker_node_config(args)
    serve_tracker_node(tracker_config(args), config, EntryConfig(), access, api_limits(args))
    return 0


def run_node(args: argparse.Namespace) -> int:
    access, _ = access_config(args, create_key=args.tracker is None)
    if args.entry:
        from meshnet.node.entry import serve_entry

        serve_entry(node_config(args), EntryConfig(), access, api_limits(args))
        return 0
    from meshnet.node.serve import serve

    serve(node_config(args), access)
    return 0


if __name__ == "__main__":
    sys.exit(main())

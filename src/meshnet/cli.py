"""The `meshnet` command: maps flags onto config records and starts a role; holds no logic."""

from __future__ import annotations

import argparse
import logging
import re
import sys
from collections.abc import Sequence

from meshnet import __version__
from meshnet.config import NodeConfig, TrackerConfig


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="meshnet",
        description="Run language models too big for one machine across many machines.",
    )
    parser.add_argument("--version", action="version", version=f"meshnet {__version__}")
    parser.add_argument("--log-level", default="INFO", help="logging level (default INFO)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    demo = sub.add_parser("demo", help="run the demo on the embedded default model")
    demo.add_argument("--max-tokens", type=int, default=32, help="answer length limit")
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
    tracker = sub.add_parser("tracker", help="run the control plane")
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
    return parser


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
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    if args.command is None:
        parser.print_help()
        return 0
    if args.command == "demo":
        from meshnet.demo import run_demo

        return run_demo(max_tokens=args.max_tokens)
    if args.command == "node":
        from meshnet.node.serve import serve

        serve(node_config(args))
        return 0
    if args.command == "tracker":
        from meshnet.tracker.serve import serve as serve_tracker

        serve_tracker(tracker_config(args))
        return 0
    parser.error(f"unknown command {args.command}")  # pragma: no cover
    return 2


if __name__ == "__main__":
    sys.exit(main())

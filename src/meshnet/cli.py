"""The `meshnet` command: maps flags onto config records and starts a role; holds no logic."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

from meshnet import __version__
from meshnet.config import NodeConfig


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
    return parser


def node_config(args: argparse.Namespace) -> NodeConfig:
    return NodeConfig(
        model=args.model, layers=args.layers, quant=args.quant, host=args.host, port=args.port
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
    parser.error(f"unknown command {args.command}")  # pragma: no cover
    return 2


if __name__ == "__main__":
    sys.exit(main())

"""The `meshnet` command: maps flags onto config records and starts a role; holds no logic.

One module per command group: `serve` (node, tracker), `client` (generate, chat, status),
`access` (keys and API limits, shared by the serving commands), `flags` (shared parsers).
Every flag's default is read from the config record it fills.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from meshnet import __version__
from meshnet.cli.client import add_client_commands, run_client
from meshnet.cli.configs import node_config, tracker_node_config
from meshnet.cli.flags import add_log_flags, check_environment
from meshnet.cli.serve import add_serve_commands, run_node, run_tracker
from meshnet.errors import MeshError
from meshnet.observe.logs import configure as configure_logging

__all__ = ["build_parser", "main", "node_config", "tracker_node_config"]


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
    add_serve_commands(sub)
    add_client_commands(sub)
    for command in sub.choices.values():
        add_log_flags(command, defaults=False)
    return parser


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
        check_environment()
        return run_command(args)
    except MeshError as exc:  # a refused configuration: say why, without a traceback
        print(f"meshnet {args.command}: {exc.message}", file=sys.stderr)
        return 2


def run_command(args: argparse.Namespace) -> int:
    if args.command == "demo":
        from meshnet.demo import run_demo

        return run_demo(max_tokens=args.max_tokens, keep_running=args.keep_running)
    if args.command == "node":
        return run_node(args)
    if args.command == "tracker":
        return run_tracker(args)
    return run_client(args)

"""The `meshnet` command: maps flags onto config records and starts a role; holds no logic."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

from meshnet import __version__


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="meshnet",
        description="Run language models too big for one machine across many machines.",
    )
    parser.add_argument("--version", action="version", version=f"meshnet {__version__}")
    parser.add_argument("--log-level", default="INFO", help="logging level (default INFO)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    demo = sub.add_parser("demo", help="run the demo on the embedded default model")
    demo.add_argument("--tokens", type=int, default=128, help="prompt tokens to send")
    return parser


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
        from meshnet.demo import run_wire_demo

        return run_wire_demo(tokens=args.tokens)
    parser.error(f"unknown command {args.command}")  # pragma: no cover
    return 2


if __name__ == "__main__":
    sys.exit(main())

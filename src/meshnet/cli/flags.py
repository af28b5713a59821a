"""Flag parsers and flag groups more than one command shares."""

from __future__ import annotations

import argparse
import os
import re
from typing import Any

from meshnet.config import COMPUTE_DTYPE_ENV
from meshnet.errors import ConfigError
from meshnet.types import parse_compute, parse_device

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


def parse_fraction(text: str) -> float:
    """`0.01` -> 0.01; anything outside [0, 1] is refused."""
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"expected a fraction from 0 to 1, got {text!r}")
    return value


def parse_device_flag(text: str) -> str:
    """`--device`: auto, cpu, cuda or cuda:N (whether CUDA works is checked at start-up)."""
    try:
        return parse_device(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def parse_threads(text: str) -> int | None:
    """`auto` -> None (follow the free cores); `2` -> 2."""
    if text.strip().lower() == "auto":
        return None
    if not text.strip().isdigit() or not 1 <= int(text) <= 1024:
        raise argparse.ArgumentTypeError(f"expected auto or a whole number from 1, got {text!r}")
    return int(text)


def parse_draft_tokens(text: str) -> int:
    """`8` -> 8; a rewind drops at most 64 tokens, the last accepted one and 63 drafts."""
    if not text.strip().isdigit() or not 1 <= int(text) <= 63:
        raise argparse.ArgumentTypeError(f"expected a whole number from 1 to 63, got {text!r}")
    return int(text)


def url_list(text: str) -> tuple[str, ...]:
    """`http://a:8000,http://b:8000` -> both URLs (each http(s) with a host; at most 15)."""
    urls = tuple(u.strip().rstrip("/") for u in text.split(",") if u.strip())
    bad = [u for u in urls if not re.fullmatch(r"https?://[^/\s]+(/\S*)?", u)]
    if not urls or bad or len(urls) > 15:
        raise argparse.ArgumentTypeError(
            f"expected URL or URL1,URL2,... (http:// or https://, at most 15), got {text!r}"
        )
    return urls


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


def check_environment() -> None:
    """Refuse to start on a `$MESHNET_COMPUTE_DTYPE` that is not fp32 or bf16 (ADR-0024)."""
    value = os.environ.get(COMPUTE_DTYPE_ENV, "").strip()
    if value:
        try:
            parse_compute(value, f"${COMPUTE_DTYPE_ENV}")
        except ValueError as exc:
            raise ConfigError(str(exc)) from None


def add_weights_flags(group: Any) -> None:
    """How a member shares and keeps weights (ADR-0054)."""
    group.add_argument(
        "--weights-upload-limit",
        type=parse_bytes,
        metavar="SIZE",
        help="weights served to other members, per second at most, e.g. 12MB (default: no limit)",
    )
    group.add_argument(
        "--weights-cache",
        type=parse_bytes,
        metavar="SIZE",
        help="weights fetched from the mesh kept on disk at most, e.g. 20GiB; models no span "
        "uses go first, least recently used (default: no limit)",
    )

"""Flags for who may call a serving process (swarm key, API keys) and the API's limits."""

from __future__ import annotations

import argparse
from collections.abc import Callable

from meshnet.cli.flags import parse_bytes
from meshnet.config import AccessConfig, ApiLimits, TlsConfig
from meshnet.security.keys import resolve_api_keys, resolve_swarm_key
from meshnet.security.tls import check as check_tls


def not_on_argv(hint: str) -> Callable[[str], str]:
    """An argparse `type` refusing a secret on the command line, where every user of the
    machine sees it in `ps` (review finding 12)."""

    def refuse(_: str) -> str:
        raise argparse.ArgumentTypeError(f"secrets are not taken on the command line: {hint}")

    return refuse


def add_access_flags(parser: argparse.ArgumentParser) -> None:
    """Membership (swarm key), client API keys and the API's per-client limits."""
    group = parser.add_argument_group("access")
    group.add_argument(
        "--swarm-key",
        type=not_on_argv("set MESHNET_SWARM_KEY or pass --swarm-key-file"),
        help=argparse.SUPPRESS,
    )
    group.add_argument(
        "--swarm-key-file",
        help="the key file (default ~/.meshnet/swarm.key; a tracker creates it on first start)",
    )
    group.add_argument(
        "--api-key",
        dest="api_keys",
        type=not_on_argv("set MESHNET_API_KEYS=k1,k2 or pass --api-keys-file"),
        help=argparse.SUPPRESS,
    )
    group.add_argument(
        "--api-keys-file", help="client API keys, one per line (mode 0600; or $MESHNET_API_KEYS)"
    )
    group.add_argument("--tls-cert", help="serve https with this certificate (PEM)")
    group.add_argument("--tls-key", help="the certificate's private key (PEM)")
    group.add_argument(
        "--tls-ca", help="trust https members signed by this CA (PEM; default: the system's)"
    )
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
        "--max-generations",
        type=int,
        default=default.max_generations,
        help="generations in flight from all clients together",
    )
    limits.add_argument(
        "--write-timeout",
        type=float,
        default=default.write_timeout_s,
        help="seconds a streamed answer may wait for a client that stopped reading",
    )
    limits.add_argument(
        "--rate-limit",
        type=float,
        default=default.requests_per_minute,
        help="requests per minute per client (0 = none)",
    )


def access_config(args: argparse.Namespace, create_key: bool) -> tuple[AccessConfig, str]:
    """The access settings, and where the swarm key came from (in words)."""
    key, origin = resolve_swarm_key(args.swarm_key_file, create=create_key)
    keys = resolve_api_keys(args.api_keys_file)
    tls = TlsConfig(args.tls_cert, args.tls_key, args.tls_ca)
    check_tls(tls)
    return AccessConfig(key, keys, args.allow_unauthenticated, tls=tls), origin


def api_limits(args: argparse.Namespace) -> ApiLimits:
    return ApiLimits(
        max_body_bytes=args.max_body,
        max_prompt_tokens=args.max_prompt_tokens,
        max_tokens=args.max_tokens_limit,
        max_concurrent_per_client=args.max_concurrent,
        max_generations=args.max_generations,
        write_timeout_s=args.write_timeout,
        requests_per_minute=args.rate_limit,
    )

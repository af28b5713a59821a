"""`meshnet node` and `meshnet tracker`: flags onto `NodeConfig`, `TrackerConfig` and
`EntryConfig`, then the role's own `serve`."""

from __future__ import annotations

import argparse
import logging
import socket
from typing import Any

from meshnet.cli.access import access_config, add_access_flags, api_limits
from meshnet.cli.configs import (
    entry_config,
    node_config,
    tracker_config,
    tracker_node_config,
)
from meshnet.cli.flags import (
    add_weights_flags,
    parse_bytes,
    parse_device_flag,
    parse_draft_tokens,
    parse_fraction,
    parse_threads,
    url_list,
)
from meshnet.config import EntryConfig, NodeConfig, TrackerConfig
from meshnet.security.keys import join_command
from meshnet.types import BACKENDS, QUANTS

QUANT_HELP = (
    "weight format: gguf keeps a GGUF file's own (ggml computes); default: gguf for a GGUF "
    "file on the CPU, else bf16 where fast or $MESHNET_COMPUTE_DTYPE=bf16, else fp32"
)


def add_serve_commands(sub: Any) -> None:
    """`node` and `tracker` on the `meshnet` subparsers `sub`."""
    node, default = sub.add_parser("node", help="serve a span of a model's layers"), NodeConfig()
    node.add_argument(
        "--model",
        default=default.model,
        help="'default', a .gguf file, a checkpoint folder or a hub id",
    )
    node.add_argument("--layers", help="the span to serve, 'start:end' (default: all)")
    node.add_argument("--quant", choices=QUANTS, help=QUANT_HELP)
    node.add_argument("--host", default=default.host)
    node.add_argument("--port", type=int, default=default.port)
    node.add_argument(
        "--tracker",
        type=url_list,
        help="join this tracker (URL) and serve what it assigns; URL1,URL2,...: a mesh's "
        "trackers, every one of them",
    )
    node.add_argument("--public-address", help="address peers use, if not http://HOST:PORT")
    node.add_argument(
        "--budget",
        type=parse_bytes,
        help="memory for weights and KV cache, e.g. 4GiB (default: free VRAM less a margin "
        "on CUDA, or half the available RAM)",
    )
    node.add_argument("--data-dir", help="where the node keeps its id (default ~/.meshnet)")
    node.add_argument(
        "--entry",
        action=argparse.BooleanOptionalAction,
        default=default.entry,
        help="may serve as an entry: a span from layer 0 (by --layers 0:K or from the tracker) "
        "comes with the head, and the node answers the OpenAI-compatible API for its model "
        "(default: on; the tracker gives layer 0 only where the head fits the budget)",
    )
    add_node_flags(node)
    add_access_flags(node)
    add_tracker_command(sub)


def add_tracker_command(sub: Any) -> None:
    tracker = sub.add_parser(
        "tracker", help="run the control plane (with --layers or --budget: also an entry node)"
    )
    default = TrackerConfig()
    tracker.add_argument(
        "--model",
        action="append",
        dest="models",
        help=f"a model to offer (repeatable; default: {', '.join(default.models)})",
    )
    tracker.add_argument("--host", default=default.host)
    tracker.add_argument("--port", type=int, default=default.port)
    tracker.add_argument(
        "--heartbeat-interval",
        type=float,
        default=default.heartbeat_interval_s,
        help="seconds between a node's heartbeats; beyond 1,000 nodes the tracker stretches it "
        "to keep to 500 heartbeats a second (and the dead time with it)",
    )
    tracker.add_argument(
        "--dead-after",
        type=float,
        default=default.dead_after_s,
        help="seconds without a heartbeat before a node counts as dead (stretched with the "
        "interval in big meshes)",
    )
    tracker.add_argument(
        "--suspect-for",
        type=float,
        default=default.suspect_s,
        help="seconds a node that an entry reported failing stays out of routes",
    )
    tracker.add_argument(
        "--max-nodes",
        type=int,
        default=default.max_nodes,
        help="nodes the tracker holds at most; more registrations get 429",
    )
    tracker.add_argument(
        "--max-nodes-per-address",
        type=int,
        default=default.max_nodes_per_address,
        help="nodes registered from one address at most",
    )
    tracker.add_argument(
        "--layers", help="serve layers 'start:end' of the first model here (start must be 0)"
    )
    tracker.add_argument(
        "--budget", type=parse_bytes, help="memory for its own span and head (picks K)"
    )
    tracker.add_argument("--quant", choices=QUANTS, help=QUANT_HELP)
    tracker.add_argument("--data-dir", help="where its node id is kept (default ~/.meshnet)")
    tracker.add_argument(
        "--public-address",
        help="address other members use for its own span and pushed answers, if not "
        "http://HOST:PORT (nodes join at --host/--port all the same)",
    )
    tracker.add_argument(
        "--peers",
        type=url_list,
        default=(),
        help="the mesh's other trackers, URL1,URL2,...: every tracker takes every node, one "
        "plans at a time and another takes over when it dies (list the same trackers on each; "
        "--public-address is how they list this one)",
    )
    add_node_flags(tracker)
    add_access_flags(tracker)


def add_node_flags(parser: argparse.ArgumentParser) -> None:
    """Limits, speed switches and the entry's hop timeout: nodes and the tracker's own span."""
    default, entry = NodeConfig(), EntryConfig()
    parser.add_argument(
        "--device",
        type=parse_device_flag,
        default=default.device,
        help="where weights, KV caches and compute live: auto (CUDA when PyTorch sees a "
        "device, else the CPU), cpu, cuda or cuda:N (default: auto)",
    )
    parser.add_argument(
        "--backend",
        choices=BACKENDS,
        default=default.backend,
        help="what computes the layers: ggml over a GGUF file's own weights (CPU), torch, or "
        "auto: ggml for a GGUF file on the CPU unless --quant asks for a conversion",
    )
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
    _entry_flags(parser, group, default, entry)
    _sharing_flags(parser, group, default, entry)
    _speed_flags(parser, group, default, entry)


def _entry_flags(
    parser: argparse.ArgumentParser,
    group: argparse._ArgumentGroup,
    default: NodeConfig,
    entry: EntryConfig,
) -> None:
    """An entry's hops: their timeout, spot checks, pushed routes and drafts."""
    group.add_argument(
        "--hop-timeout",
        type=float,
        default=entry.hop_timeout_s,
        help="an entry gives up on a hop after this many seconds and fails over (a hung node)",
    )
    group.add_argument(
        "--spot-check-rate",
        type=parse_fraction,
        default=entry.spot_check_rate,
        help="the fraction of hop answers an entry re-runs on another copy (0 = none)",
    )
    group.add_argument(
        "--push",
        action=argparse.BooleanOptionalAction,
        default=entry.push,
        help="an entry's hops send activations on to the next hop themselves (ADR-0034); "
        "needs a swarm key and --spot-check-rate 0",
    )
    group.add_argument(
        "--draft",
        choices=["none", "lookup", "model"],
        default=entry.draft,
        help="speculative decoding (ADR-0038): lookup drafts tokens from the prompt and output "
        "so far, model from --draft-model run here; the mesh verifies several in one frame, "
        "output unchanged",
    )
    group.add_argument(
        "--draft-model",
        default=entry.draft_model,
        help="with --draft model: a small model with the served model's tokenizer ('default', "
        "a .gguf file or a checkpoint folder), run whole on the entry",
    )
    group.add_argument(
        "--max-draft-tokens",
        type=parse_draft_tokens,
        default=entry.max_draft_tokens,
        help="drafts verified in one frame at most (1-63); the entry adapts below it",
    )


def _sharing_flags(
    parser: argparse.ArgumentParser,
    group: argparse._ArgumentGroup,
    default: NodeConfig,
    entry: EntryConfig,
) -> None:
    """What an entry shares and how frames travel: prefill overlap, prefixes, bans, the
    wire's encoding; the weights a node serves."""
    group.add_argument(
        "--pipelined-prefill",
        action=argparse.BooleanOptionalAction,
        default=entry.pipelined_prefill,
        help="a long prompt's chunks overlap across the hops (ADR-0036); --no-pipelined-prefill "
        "sends them one at a time through every hop",
    )
    group.add_argument(
        "--prefix-sharing",
        choices=["client", "all", "off"],
        default=entry.prefix_sharing,
        help="a finished request's caches stay on its hops and later prompts starting with the "
        "same tokens reuse them (ADR-0058): within one client (API key), among all, or off; "
        "with all, any client can learn, block by block, how other clients' prompts begin "
        "(cached_tokens and the time to the first token say how much was reused)",
    )
    group.add_argument(
        "--spot-check-ban",
        type=float,
        default=entry.spot_check_ban_s,
        help="seconds a node whose answer failed a spot check stays out of this entry's routes",
    )
    group.add_argument(
        "--wire-encoding",
        choices=["auto", "none", "zstd", "zstd-shuffle"],  # wire.compression.SENDER_CHOICES
        default=default.wire_encoding,
        help="how frames this process sends are encoded; auto compresses prefill chunks over "
        "links measured slower than --auto-compress-below (ADR-0037)",
    )
    group.add_argument(
        "--auto-compress-below",
        type=float,
        default=default.auto_compress_below_mbit_s,
        metavar="MBIT_S",
        help="auto encoding: the link rate in Mbit/s under which prefill chunks are "
        "compressed (default %(default)s)",
    )
    add_weights_flags(group)


def _speed_flags(
    parser: argparse.ArgumentParser,
    group: argparse._ArgumentGroup,
    default: NodeConfig,
    entry: EntryConfig,
) -> None:
    """Threads, batching and the switches of the fast paths (debugging)."""
    group.add_argument(
        "--threads",
        type=parse_threads,
        default=None,
        metavar="N|auto",
        help="compute threads: auto (default) follows the cores other processes leave free; "
        "N pins them",
    )
    group.add_argument(
        "--max-batch",
        type=int,
        default=default.max_batch,
        help="decode steps of different sessions run as one pass, up to this many",
    )
    group.add_argument(
        "--max-batch-tokens",
        type=int,
        default=default.max_batch_tokens,
        help="prefill tokens of one pass at most (chunks of several prompts share a pass)",
    )
    group.add_argument(
        "--batch-wait",
        type=float,
        default=default.batch_wait_s,
        help="seconds a decode round waits at most for the sessions of the last one",
    )
    group.add_argument(
        "--step-wait",
        type=float,
        default=entry.step_wait_s,
        help="seconds an entry's own decode round waits at most for sessions still on their "
        "way through the hops, so that sessions out of step join one batch",
    )
    parser.add_argument(
        "--no-fast-path",
        dest="fast_path",
        action="store_false",
        help="run the layers module by module instead of the fast decode path (for debugging)",
    )
    parser.add_argument(
        "--no-host-turns",
        dest="host_turns",
        action="store_false",
        help="compute at once with other meshnet processes on this machine (default: take "
        "turns, each with every core; ADR-0026)",
    )
    parser.add_argument(
        "--no-compile",
        dest="compile",
        action="store_false",
        help="run the fast path's decode step eagerly, without torch.compile (for debugging)",
    )


def announce_tracker(args: argparse.Namespace, key: str, origin: str) -> None:
    """Print how a node joins this tracker. The key itself only when it was just created
    (review finding 12: logs and journals keep what a process prints); otherwise the join
    command names where the key is (the key travels in the environment, never argv)."""
    host = args.host if args.host not in ("0.0.0.0", "::", "") else socket.gethostname()
    url = (
        getattr(args, "public_address", None)
        or f"{'https' if args.tls_cert else 'http'}://{host}:{args.port}"
    )
    url = ",".join(sorted({url, *getattr(args, "peers", ())}))  # nodes join every tracker
    created = origin.startswith("created")
    command = join_command(url, key if created else f"<the key {origin}>")
    print(f"meshnet tracker: swarm key {origin}", flush=True)
    print(f"meshnet tracker: join this mesh with:\n  {command}", flush=True)


def run_tracker(args: argparse.Namespace) -> int:
    if args.layers is not None or args.budget is not None:
        from meshnet.assemble.node import on_device

        on_device(tracker_node_config(args))  # a bad --device stops it before the key is made
    access, origin = access_config(args, create_key=True)
    announce_tracker(args, access.swarm_key or "", origin)
    if not access.api_keys and not access.allow_unauthenticated:
        logging.getLogger(__name__).info("no API keys: the API answers loopback clients only")
    if args.layers is None and args.budget is None:
        from meshnet.assemble.tracker import serve_tracker

        serve_tracker(tracker_config(args), access)
        return 0
    from meshnet.assemble.tracker import serve_tracker_node

    config, entry = tracker_node_config(args), entry_config(args)
    serve_tracker_node(tracker_config(args), config, entry, access, api_limits(args))
    return 0


def run_node(args: argparse.Namespace) -> int:
    from meshnet.assemble.node import on_device, serve

    on_device(node_config(args))  # a bad --device stops it before a key is made
    access, _ = access_config(args, create_key=args.tracker is None)
    serve(node_config(args), access, entry_config(args), api_limits(args))
    return 0

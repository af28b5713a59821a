"""The serving commands' parsed flags as the frozen config dataclasses they map onto."""

from __future__ import annotations

import argparse
from typing import Any

from meshnet.config import EntryConfig, NodeConfig, TrackerConfig


def node_config(args: argparse.Namespace) -> NodeConfig:
    return NodeConfig(
        model=args.model,
        layers=args.layers,
        quant=args.quant,
        host=args.host,
        port=args.port,
        trackers=args.tracker or (),
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
        public_address=args.public_address,
        **node_limits(args),
    )


def node_limits(args: argparse.Namespace) -> dict[str, Any]:
    """The flags nodes and the tracker's own span share, as `NodeConfig` fields."""
    return {
        "device": args.device,
        "backend": args.backend,
        "max_sessions": args.max_sessions,
        "max_cache_bytes": args.max_kv_cache,
        "session_ttl_s": args.session_ttl,
        "fast_path": args.fast_path,
        "compile": args.compile,
        "host_turns": args.host_turns,
        "threads": args.threads,
        "weights_upload_bytes_s": args.weights_upload_limit,
        "weights_cache_bytes": args.weights_cache,
        "max_batch": args.max_batch,
        "wire_encoding": args.wire_encoding,
        "auto_compress_below_mbit_s": args.auto_compress_below,
        "max_batch_tokens": args.max_batch_tokens,
        "batch_wait_s": args.batch_wait,
    }


def entry_config(args: argparse.Namespace) -> EntryConfig:
    return EntryConfig(
        hop_timeout_s=args.hop_timeout,
        step_wait_s=args.step_wait,
        spot_check_rate=args.spot_check_rate,
        spot_check_ban_s=args.spot_check_ban,
        push=args.push,
        pipelined_prefill=args.pipelined_prefill,
        draft=args.draft,
        max_draft_tokens=args.max_draft_tokens,
        draft_model=args.draft_model,
        prefix_sharing=args.prefix_sharing,
    )


def tracker_config(args: argparse.Namespace) -> TrackerConfig:
    return TrackerConfig(
        models=tuple(args.models or TrackerConfig().models),
        host=args.host,
        port=args.port,
        heartbeat_interval_s=args.heartbeat_interval,
        dead_after_s=args.dead_after,
        suspect_s=args.suspect_for,
        max_nodes=args.max_nodes,
        max_nodes_per_address=args.max_nodes_per_address,
        data_dir=args.data_dir,
        weights_upload_bytes_s=args.weights_upload_limit,
        peers=args.peers,
        public_url=args.public_address,
    )

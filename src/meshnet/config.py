"""Frozen configuration records; units are part of every field name."""

from __future__ import annotations

from dataclasses import dataclass

from meshnet.types import Backend, Quant

MiB = 1 << 20
# fp32 | bf16: what int8/nf4 layers compute in and the default quantization follow,
# instead of what the hardware detection picks (ADR-0024)
COMPUTE_DTYPE_ENV = "MESHNET_COMPUTE_DTYPE"


@dataclass(frozen=True)
class WireLimits:
    """What a receiver of activation frames accepts before it reads a byte of payload."""

    max_body_bytes: int = 64 * MiB  # the HTTP body as sent (compressed or not); 413 above it
    max_tensor_bytes: int = 64 * MiB  # the decoded bf16 tensor; a 2048x16384 chunk is 64 MiB
    # batch x tokens of one frame: entries send [1, <=128, H] chunks; bytes alone let a small
    # model's frame carry [7, 8192, H] into one pass (review finding 10)
    max_frame_tokens: int = 2048


@dataclass(frozen=True)
class WireConfig:
    """How a sender encodes activation frames."""

    encoding: str = "auto"  # none | zstd | zstd-shuffle | auto
    chunk_tokens: int = 128  # prefill chunk length in tokens (ADR-0008)
    auto_min_bytes: int = 64 * 1024  # `auto` compresses only payloads at least this large
    # ...and only over links measured slower than this: zstd-shuffle saves 30% of the bytes
    # for ~3.6 ms of CPU per MB both ends together, worth it below ~670 Mbit/s (ADR-0037)
    auto_compress_below_mbit_s: float = 600.0


GiB = 1 << 30


@dataclass(frozen=True)
class NodeConfig:
    """A node serving one span of one model."""

    model: str = "default"  # "default", a .gguf file, a checkpoint folder or a hub id
    layers: str | None = None  # "start:end"; None = the whole model until the tracker assigns
    quant: Quant | None = None  # None = bf16 where fast (or $MESHNET_COMPUTE_DTYPE=bf16), else fp32
    # auto | cpu | cuda | cuda:N: where weights, KV caches and compute live (ADR-0039); the
    # node resolves "auto" once at start-up (CUDA when PyTorch sees a device)
    device: str = "auto"
    # auto: ggml for a GGUF file on the CPU at the file's own types, else torch (ADR-0051)
    backend: Backend = "auto"
    host: str = "127.0.0.1"
    port: int = 8001
    session_ttl_s: float = 600.0  # idle sessions' caches are dropped after this
    max_cache_bytes: int = 1 * GiB  # all sessions' KV caches together, per shard
    evict_idle_s: float = 10.0  # to make room, sessions idle this long may go; else 429
    max_sessions: int = 64  # sessions in flight on this node; a new one over it gets 429
    fast_path: bool = True  # the architecture's fast decode path where it applies (ADR-0021)
    compile: bool = True  # compile the fast path's decode step where allowed (ADR-0023)
    host_turns: bool = True  # on a CPU, take compute turns with co-located nodes (ADR-0026)
    # compute threads: None follows the cores other processes leave free (ADR-0053)
    threads: int | None = None
    weights_upload_bytes_s: float | None = None  # weights served to members; None: no cap
    weights_cache_bytes: int | None = None  # weights fetched and kept on disk; None: no cap
    max_batch: int = 32  # frames of different sessions run as one pass, up to this many
    max_batch_tokens: int = 512  # prefill tokens of one pass, at most (the oldest chunk goes)
    # a decode round waits this long at most for the sessions of the last one: they arrive
    # one HTTP request after another (ADR-0027)
    batch_wait_s: float = 0.01
    trackers: tuple[str, ...] = ()  # join the mesh of these trackers (URLs): serve what they assign
    public_address: str | None = None  # the address peers use, when not http://host:port
    budget_bytes: int | None = None  # memory for weights + KV cache; None = a safe default
    kv_reserve_fraction: float = 0.1  # share of the budget kept for KV caches
    data_dir: str | None = None  # keeps the node id across restarts; None = ~/.meshnet/node-PORT
    # may be an entry: a span from layer 0 (given by hand or by the tracker) comes with the
    # head and tokenizer, and the node serves the OpenAI-compatible API for that model
    entry: bool = True
    drain_timeout_s: float = 10.0  # on SIGTERM, calls in flight get this long to finish
    wire_encoding: str = "auto"  # frames this node sends: none | zstd | zstd-shuffle | auto
    auto_compress_below_mbit_s: float = 600.0  # `auto` compresses over links slower than this


@dataclass(frozen=True)
class RetryPolicy:
    """How an entry node retries after a hop fails: capped exponential backoff, bounded count."""

    max_attempts: int = 5  # replacement routes tried per failure before the request fails
    base_s: float = 0.1  # the first wait; doubled each attempt
    cap_s: float = 2.0  # no wait is longer than this

    def backoff_s(self, attempt: int) -> float:
        """Seconds to wait after failed attempt `attempt` (0-based)."""
        return float(min(self.cap_s, self.base_s * 2**attempt))


@dataclass(frozen=True)
class EntryConfig:
    """How an entry node drives requests through the mesh."""

    hop_timeout_s: float = 60.0  # one frame through one hop, prefill chunks included
    route_timeout_s: float = 10.0  # asking the tracker for a route
    default_max_tokens: int = 256  # chat requests that give no max_tokens
    seed: int | None = None  # seeds requests that give none; None = from the OS
    retry: RetryPolicy = RetryPolicy()
    # the entry's own decode round waits this long at most for sessions of the last one that
    # are still on their way through the hops: sessions out of step join one batch (ADR-0027)
    step_wait_s: float = 0.1
    # what one session's hops were sent, kept to replay into a replacement hop; a session
    # past it goes on without failover (8,192 tokens x H 576 x 2 B x 2 hops = 19 MB)
    max_replay_bytes: int = 256 * MiB
    # re-run this fraction of hop answers on another copy of the span (ADR-0032); a node
    # whose answer agrees with no other copy stays out of this entry's routes for ban_s
    spot_check_rate: float = 0.01
    spot_check_ban_s: float = 3600.0
    # hops send each frame on to the next hop themselves, the last one back here: k + 1
    # legs a token instead of 2k (ADR-0034); needs a swarm key, and is off while spot checks
    # run (they need every hop's answer)
    push: bool = False
    # a prompt of several wire chunks overlaps across the hops: chunk i+1 enters a hop while
    # chunk i is in the next (ADR-0036); the entry's span runs it in pieces of this many
    # tokens, each sent on as soon as it is done
    pipelined_prefill: bool = True
    prefill_piece_tokens: int = 512
    # speculative decoding (ADR-0038): `lookup` drafts tokens from the text so far and
    # verifies up to max_draft_tokens of them through the mesh in one frame; `none` decodes
    # one token a trip
    draft: str = "none"  # none | lookup | model
    max_draft_tokens: int = 8
    draft_model: str = "default"  # with draft="model": a model sharing the tokenizer
    # prompt prefixes (ADR-0058): a finished request's caches stay on its hops, and a later
    # prompt starting with the same tokens forks from them; shared within one `client` (an
    # API key, or an address where there are none), among `all`, or `off`
    prefix_sharing: str = "client"
    prefix_max_sessions: int = 64  # kept prefixes this entry remembers, per model
    prefix_max_bytes: int = 256 * MiB  # the replay inputs they keep for failover, together


@dataclass(frozen=True)
class TrackerConfig:
    """The control plane."""

    models: tuple[str, ...] = ("default",)  # offered: `default`, .gguf files, folders, hub ids
    host: str = "127.0.0.1"
    port: int = 8000
    heartbeat_interval_s: float = 2.0  # nodes heartbeat this often
    dead_after_s: float = 6.0  # a node silent this long is dead; its spans leave the map
    suspect_s: float = 30.0  # a node an entry reported failing stays out of routes this long
    route_seed: int | None = None  # fixes replica choice in tests; None = random
    max_nodes: int = 20_000  # registrations beyond this many nodes get 429
    max_nodes_per_address: int = 64  # ...and beyond this many from one address
    data_dir: str | None = None  # keeps its models' manifests; None = ~/.meshnet/tracker
    weights_upload_bytes_s: float | None = None  # weights served to members; None: no cap
    peers: tuple[str, ...] = ()  # the mesh's other trackers (URLs): one of them plans at a time
    public_url: str | None = None  # how its peers list this tracker; None: http(s)://HOST:PORT


@dataclass(frozen=True)
class TlsConfig:
    """How this process's links are encrypted (ADR-0033)."""

    cert_file: str | None = None  # serve https with this certificate (PEM) ...
    key_file: str | None = None  # ... and its private key
    ca_file: str | None = None  # trust servers signed by this CA (PEM); None = the system's

    @property
    def serves(self) -> bool:
        return self.cert_file is not None


@dataclass(frozen=True)
class AccessConfig:
    """Who may call a process (ADR-0017, ADR-0018)."""

    swarm_key: str | None = None  # members' shared secret; None = member calls unchecked (tests)
    api_keys: tuple[str, ...] = ()  # client keys for the OpenAI-compatible API
    allow_unauthenticated: bool = False  # no API keys: serve non-loopback clients anyway
    max_clock_skew_s: float = 30.0  # a signed call's timestamp may be this far off our clock
    tls: TlsConfig = TlsConfig()  # and how the calls travel
    # a caller refused this often in a minute (401) is answered 429 until the minute is over
    max_refusals_per_minute: int = 60


@dataclass(frozen=True)
class ApiLimits:
    """What one client may ask of an entry node; each refusal is a 4xx naming the limit."""

    max_body_bytes: int = 4 * MiB  # a JSON request body
    max_prompt_tokens: int = 8192  # after the chat template; the model's context also applies
    max_tokens: int = 4096  # `max_tokens` / `max_completion_tokens`
    max_concurrent_per_client: int = 8  # generations in flight per API key (or loopback IP)
    max_generations: int = 256  # generations in flight from all clients together
    write_timeout_s: float = 30.0  # a streamed answer the client stops reading is ended
    requests_per_minute: float = 600.0  # sustained rate per client; 0 = unlimited
    burst_requests: int = 60  # requests a quiet client may send at once

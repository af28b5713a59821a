"""Control-plane messages (JSON over HTTP), each a declared pydantic model.

Every model forbids unknown fields and is frozen; handlers receive these, never raw dicts.
"""

from __future__ import annotations

from typing import Annotated, Literal
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from meshnet.types import LayerSpan, Quant, SourceKind

ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$"
Op = Literal["LOAD_SHARD", "DROP_SHARD"]
MAX_BYTES = 1 << 60  # a budget beyond an exabyte is a typo or an attack
MAX_SHARDS = 256  # shards one node may list
MAX_REQUESTS = 64  # finished generations one heartbeat may report
MAX_PEERS = 64  # round trips one heartbeat may report
NodeState = Literal["ready", "loading", "idle", "late", "suspect"]
ModelName = Annotated[str, Field(pattern=ID_PATTERN)]
# the highest planner term whose directives a node took (ADR-0057); -1: none yet
SEEN_TERM = Field(default=-1, ge=-1, le=1 << 62)
PeerName = Annotated[str, Field(pattern=ID_PATTERN)]  # a node id, or `tracker`
RttMs = Annotated[float, Field(ge=0, le=60_000, allow_inf_nan=False)]


class Message(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ShardRef(Message):
    """One span of one model."""

    model: str = Field(pattern=ID_PATTERN)
    span: LayerSpan


class ShardFailure(Message):
    shard: ShardRef
    error: str = Field(max_length=2000)
    # its copy of the model differs from the offered one: give it no span of the model
    refuses_model: bool = False


Digest = Annotated[str, Field(pattern=r"^[0-9a-f]{64}$")]  # a model's manifest (ADR-0054)


class WeightHolder(Message):
    """A member a node may fetch a model's parts from: a node, or `tracker`."""

    node_id: PeerName
    address: str = Field(pattern=r"^https?://[^\s/]+$", max_length=300)


class FetchState(Message):
    """How far a node's fetch of a span's weights has come."""

    shard: ShardRef
    done_bytes: int = Field(ge=0, le=MAX_BYTES)
    total_bytes: int = Field(ge=0, le=MAX_BYTES)
    rate_bytes_s: float = Field(ge=0, le=1e13, allow_inf_nan=False)


class DirectiveMessage(Message):
    """A rebalance directive: load or drop one shard, and why."""

    op: Op
    model: str
    source: str  # what the node passes to the model loader (e.g. `default`, a hub id)
    # what the source is on the tracker's machine; a node finding another kind refuses it
    source_kind: SourceKind | None = None
    span: LayerSpan
    reason: str
    # the model's content (a GGUF file's manifest digest) and who holds its parts, least
    # loaded first: a node without the file fetches the span's parts from them
    digest: Digest | None = None
    holders: list[WeightHolder] = Field(default=[], max_length=16)


class RegisterRequest(Message):
    node_id: str = Field(pattern=ID_PATTERN)
    address: str = Field(pattern=r"^https?://[^\s/]+$", max_length=300)
    models: list[ModelName] | None = Field(default=None, max_length=64)  # None = any offered
    budget_bytes: int = Field(gt=0, le=MAX_BYTES)
    kv_reserve_bytes: int = Field(ge=0, le=MAX_BYTES, default=0)
    quant: Quant
    # measured at start-up (1024x1024 products a second: ~1e4 on a 2-core CPU); capped so
    # that no claim outweighs a thousand such nodes in route choice
    throughput: float = Field(gt=0, le=1e7, allow_inf_nan=False)
    loaded: list[ShardRef] = Field(default=[], max_length=MAX_SHARDS)
    # it may serve clients: its spans from layer 0 run with the head, and only such nodes
    # are given spans from layer 0
    entry: bool = True
    keeps_entry: bool = False  # its entry span was given by hand (`--layers 0:K`): never dropped
    # its membership token: a live id registers again only with it; a new node's becomes its
    # token (the same with each of a mesh's trackers); none: the tracker makes one
    token: str | None = Field(default=None, min_length=32, max_length=64)
    term: int = SEEN_TERM
    weights: list[Digest] = Field(default=[], max_length=64)  # models it holds parts of

    @field_validator("node_id")
    @classmethod
    def _not_the_tracker(cls, node_id: str) -> str:
        if node_id.lower() == "tracker":  # members address the tracker by this name
            raise ValueError("'tracker' is the tracker's own name, not a node id")
        return node_id

    @field_validator("address")
    @classmethod
    def _plain_address(cls, address: str) -> str:
        """scheme://host:port and nothing else: no user info, query or fragment (the probe
        and every hop append their own paths to it)."""
        parts = urlsplit(address)
        try:
            port = parts.port
        except ValueError:
            port = -1
        if parts.username is not None or parts.query or parts.fragment or "?" in address:
            raise ValueError("an address is scheme://host:port, with no user, query or fragment")
        if not parts.hostname or port == -1 or "#" in address:
            raise ValueError("an address needs a host and, if given, a port from 0 to 65535")
        return address

    @model_validator(mode="after")
    def _reserve_within_budget(self) -> RegisterRequest:
        if self.kv_reserve_bytes > self.budget_bytes:
            raise ValueError("kv_reserve_bytes exceeds budget_bytes")
        if self.keeps_entry and not self.entry:
            raise ValueError("keeps_entry needs entry: only an entry keeps an entry span")
        return self


class RegisterResponse(Message):
    node_id: str
    heartbeat_interval_s: float
    directives: list[DirectiveMessage]
    token: str = ""  # its membership token: heartbeats, leave and reports must carry it
    # the planner's term of these directives (ADR-0057); None: this tracker does not plan now
    term: int | None = 0
    # the tracker's public key: its vouch makes a forwarded call a client's (ADR-0059)
    tracker_key: str | None = Field(default=None, max_length=128)


class RequestSummary(Message):
    """One generation an entry node finished (or failed), for the dashboard."""

    session: str = Field(pattern=ID_PATTERN)
    model: str = Field(pattern=ID_PATTERN)
    outcome: Literal["stop", "length", "error"]
    prompt_tokens: int = Field(ge=0, le=1 << 31)
    completion_tokens: int = Field(ge=0, le=1 << 31)
    duration_s: float = Field(ge=0, le=1e7, allow_inf_nan=False)
    time_to_first_token_s: float = Field(ge=0, le=1e7, allow_inf_nan=False)
    decode_tokens_per_s: float = Field(ge=0, le=1e9, allow_inf_nan=False)
    failovers: int = Field(ge=0, le=1 << 20, default=0)
    error: str = Field(default="", max_length=500)


TOKEN = Field(default="", max_length=64)  # a membership token (from the registration)


class HeartbeatRequest(Message):
    node_id: str = Field(pattern=ID_PATTERN)
    token: str = TOKEN
    term: int = SEEN_TERM
    loaded: list[ShardRef] = Field(default=[], max_length=MAX_SHARDS)
    loading: list[ShardRef] = Field(default=[], max_length=MAX_SHARDS)
    failed: list[ShardFailure] = Field(default=[], max_length=MAX_SHARDS)
    sessions: int = Field(ge=0, le=1 << 31, default=0)
    queue_depth: int = Field(ge=0, le=1 << 31, default=0)  # jobs waiting for its compute thread
    step_s: float = Field(ge=0, le=3600, default=0.0, allow_inf_nan=False)  # median decode round
    threads: int = Field(ge=0, le=4096, default=0)  # compute threads in use (0: not said)
    requests: list[RequestSummary] = Field(default=[], max_length=MAX_REQUESTS)
    # median round trips it measured (ms) to the tracker and to peers it sends frames to
    rtt_ms: dict[PeerName, RttMs] = Field(default={}, max_length=MAX_PEERS)
    fetching: list[FetchState] = Field(default=[], max_length=MAX_SHARDS)
    weights: list[Digest] | None = Field(default=None, max_length=64)  # None: as registered


class HeartbeatResponse(Message):
    directives: list[DirectiveMessage]
    heartbeat_interval_s: float | None = None  # the interval from now on (None: unchanged)
    # the planner's term of these directives (ADR-0057); None: this tracker does not plan now
    term: int | None = 0


class LeaveRequest(Message):
    node_id: str = Field(pattern=ID_PATTERN)
    token: str = TOKEN


class ReportRequest(Message):
    """An entry node tells the tracker a hop failed it."""

    node_id: str = Field(pattern=ID_PATTERN)
    reason: str = Field(max_length=500)
    reporter: str = Field(default="", max_length=128)  # the entry node reporting it...
    token: str = TOKEN  # ...and its membership token


class LayerCoverage(Message):
    layer: int
    serving: list[str]  # node ids with the layer loaded (and not reported failing)
    loading: list[str]  # node ids told to load it


class ModelCoverage(Message):
    model: str
    num_layers: int
    layers: list[LayerCoverage]
    gaps: list[LayerSpan]  # layers no node serves (loaded)
    routable: bool  # a full chain of loaded spans exists
    digest: str | None = None  # its content, where the tracker knows it (ADR-0054)


class NodeSummary(Message):
    node_id: str
    address: str
    budget_bytes: int
    quant: Quant
    throughput: float
    loaded: list[ShardRef]
    loading: list[ShardRef]
    sessions: int
    queue_depth: int = 0
    step_s: float = 0.0
    threads: int = 0  # compute threads at its last heartbeat (ADR-0053)
    fetching: list[FetchState] = []  # spans whose weights it is fetching (ADR-0054)
    last_heartbeat_age_s: float
    suspect: bool = False  # reported failing by an entry node; out of routes until it beats
    state: NodeState = "ready"


class IssuedDirective(Message):
    """A directive the tracker issued, to whom, why, and how long ago."""

    node_id: str
    op: Op
    model: str
    span: LayerSpan
    reason: str
    age_s: float


class RecentRequest(RequestSummary):
    """A finished generation as the tracker shows it: which entry ran it, how long ago."""

    entry: str
    age_s: float


class CoverageResponse(Message):
    models: list[ModelCoverage]
    nodes: list[NodeSummary]
    recent_directives: list[IssuedDirective]
    recent_requests: list[RecentRequest] = []
    heartbeat_interval_s: float = 2.0
    planner: str | None = None  # of several trackers, the one that plans (ADR-0057)


class RouteHop(Message):
    node_id: str
    address: str
    span: LayerSpan
    quant: Quant | None = None  # its weights (the entry's spot checks allow for them)


class RouteResponse(Message):
    model: str
    hops: list[RouteHop]


class EntryInfo(Message):
    """A live entry node of a model: where its API is, its head span, how loaded it is."""

    node_id: str
    address: str
    span: LayerSpan  # its head span [0, k)
    sessions: int
    queue_depth: int = 0


class EntriesResponse(Message):
    model: str
    entries: list[EntryInfo]  # least loaded first


TrackerUrl = Annotated[str, Field(min_length=1, max_length=300)]


class TrackerHello(Message):
    """What a tracker tells its peers of itself: they must agree on all of it (ADR-0057)."""

    url: TrackerUrl  # the sender, as it is listed in `trackers`
    trackers: list[TrackerUrl] = Field(max_length=15)  # every tracker of the mesh (URLs)
    models: list[str] = Field(max_length=100)  # the model ids it offers
    key: str | None = Field(default=None, max_length=64)  # its Ed25519 public key (base64url)


class LeaseAsk(TrackerHello):
    """A candidate's ask for the planner's lease (or its renewal), signed with the key of
    the tracker at `url` (`peering.ask_statement`): a member cannot ask in its name."""

    term: int = Field(ge=1, le=1 << 62)
    signature: str = Field(default="", max_length=128)


class LeaseAnswer(Message):
    granted: bool
    term: int  # the highest term the answering tracker granted
    holder: str | None  # whom its vote is with (None: nobody)

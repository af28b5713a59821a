"""The `X-Meshnet-*` header names of the activation plane and their parsing.

Every value is parsed strictly: integers are plain decimal digits, ids use a bounded alphabet,
and each problem raises a `WireError` naming the header.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from meshnet.errors import WireError, WireVersionError
from meshnet.types import LayerSpan, ModelId, SessionId, is_valid_id

WIRE_VERSION = "1"

VERSION = "X-Meshnet-Wire-Version"
SHAPE = "X-Meshnet-Shape"
DTYPE = "X-Meshnet-Dtype"
ENCODING = "X-Meshnet-Encoding"
SESSION = "X-Meshnet-Session"
CHUNK_INDEX = "X-Meshnet-Chunk-Index"
CHUNK_TOTAL = "X-Meshnet-Chunk-Total"
MODEL = "X-Meshnet-Model"
LAYERS = "X-Meshnet-Layers"
POSITION = "X-Meshnet-Position"
HOLD = "X-Meshnet-Hold-Ms"  # answers: ms the receiver held the frame (ADR-0037)
REWIND = "X-Meshnet-Rewind"  # "1": drop the cache past the position first (ADR-0038)
FORK = "X-Meshnet-Fork"  # a new session starts as a copy of this one's first tokens (ADR-0045)
CONTENT_TYPE = "Content-Type"
OCTET_STREAM = "application/octet-stream"

DTYPE_BF16 = "bfloat16"
MAX_REWIND_TOKENS = 64  # a rewind drops at most this many tokens: rejected drafts, no more
_MAX_DIGITS = 12  # ints beyond 10^12 are never legitimate here and would cost big-int parsing


@dataclass(frozen=True)
class FrameMeta:
    """Everything an activation frame says besides its tensor."""

    session: SessionId
    model: ModelId
    span: LayerSpan  # the layers the frame is for (request) or came out of (response)
    position: int  # absolute position of the frame's first token in the session
    chunk_index: int = 0
    chunk_total: int = 1
    # the session's cache may hold tokens past `position` (rejected draft tokens): drop them
    # first; at most MAX_REWIND_TOKENS of them (ADR-0038)
    rewind: bool = False
    # a session new to the receiver starts as a copy of this session's first `position`
    # tokens (one prompt, several answers: ADR-0045); ignored by a receiver that has it
    fork: SessionId | None = None

    def __post_init__(self) -> None:
        if not is_valid_id(self.session):
            raise WireError(f"invalid session id {self.session!r}", field=SESSION)
        if self.fork is not None and (not is_valid_id(self.fork) or self.fork == self.session):
            raise WireError(
                f"invalid session id to fork from {self.fork!r} (another session's id)",
                field=FORK,
            )
        if not is_valid_id(self.model):
            raise WireError(f"invalid model id {self.model!r}", field=MODEL)
        if self.position < 0:
            raise WireError("position must be >= 0", field=POSITION)
        if not 0 <= self.chunk_index < self.chunk_total:
            raise WireError(
                f"chunk index {self.chunk_index} out of range for total {self.chunk_total}",
                field=CHUNK_INDEX,
            )

    def to_headers(self) -> dict[str, str]:
        headers = {
            SESSION: self.session,
            MODEL: self.model,
            LAYERS: str(self.span),
            POSITION: str(self.position),
            CHUNK_INDEX: str(self.chunk_index),
            CHUNK_TOTAL: str(self.chunk_total),
        }
        if self.rewind:
            headers[REWIND] = "1"
        if self.fork is not None:
            headers[FORK] = self.fork
        return headers


def lower_keys(headers: Mapping[str, str]) -> dict[str, str]:
    """HTTP header names are case-insensitive: compare them in lower case."""
    return {k.lower(): v for k, v in headers.items()}


_LOWER = {
    name: name.lower()
    for name in (
        VERSION,
        SHAPE,
        DTYPE,
        ENCODING,
        SESSION,
        CHUNK_INDEX,
        CHUNK_TOTAL,
        MODEL,
        LAYERS,
        POSITION,
        REWIND,
        FORK,
    )
}


def require(headers: Mapping[str, str], name: str) -> str:
    """The value of header `name` (headers keyed in lower case), or a `WireError`."""
    value = headers.get(_LOWER.get(name) or name.lower())
    if value is None:
        raise WireError(f"missing header {name}", field=name)
    return value.strip()


def parse_int(value: str, name: str, *, minimum: int = 0) -> int:
    if not value.isdigit() or not value.isascii() or len(value) > _MAX_DIGITS:
        raise WireError(
            f"{name} must be a non-negative decimal integer, got {value[:40]!r}", field=name
        )
    number = int(value)
    if number < minimum:
        raise WireError(f"{name} must be >= {minimum}, got {number}", field=name)
    return number


def parse_shape(value: str) -> tuple[int, int, int]:
    """`"1,128,576"` -> (batch, tokens, hidden), each >= 1."""
    parts = value.split(",")
    if len(parts) != 3:
        raise WireError(f"{SHAPE} must be 'batch,tokens,hidden', got {value[:60]!r}", field=SHAPE)
    b, t, h = (parse_int(p.strip(), SHAPE, minimum=1) for p in parts)
    return b, t, h


def check_version(headers: Mapping[str, str]) -> None:
    version = require(headers, VERSION)
    if version != WIRE_VERSION:
        raise WireVersionError(
            f"wire version {version[:20]!r} not supported; this receiver speaks {WIRE_VERSION}",
            field=VERSION,
        )


def parse_meta(headers: Mapping[str, str]) -> FrameMeta:
    """Read the frame's metadata from lower-cased headers."""
    try:
        span = LayerSpan.parse(require(headers, LAYERS))
    except ValueError as exc:
        raise WireError(str(exc), field=LAYERS) from None
    return FrameMeta(
        session=SessionId(require(headers, SESSION)),
        model=ModelId(require(headers, MODEL)),
        span=span,
        position=parse_int(require(headers, POSITION), POSITION),
        chunk_index=parse_int(require(headers, CHUNK_INDEX), CHUNK_INDEX),
        chunk_total=parse_int(require(headers, CHUNK_TOTAL), CHUNK_TOTAL, minimum=1),
        rewind=parse_rewind(headers.get(_LOWER[REWIND])),
        fork=parse_fork(headers.get(_LOWER[FORK])),
    )


def parse_rewind(value: str | None) -> bool:
    """`X-Meshnet-Rewind`: absent, or exactly `1`."""
    if value is None:
        return False
    if value.strip() != "1":
        raise WireError(f"{REWIND} must be 1 when present, got {value[:20]!r}", field=REWIND)
    return True


def parse_fork(value: str | None) -> SessionId | None:
    """`X-Meshnet-Fork`: absent, or a session id (checked by `FrameMeta`)."""
    return None if value is None else SessionId(value.strip())

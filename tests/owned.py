"""Sessions and frames as this process's entry makes them (ADR-0049): ids that name one of
its keys, and frames carrying the session proof a hop asks for."""

from __future__ import annotations

import torch

from meshnet.config import WireConfig
from meshnet.security.ownership import PROCESS_KEYS, PROOF, Body
from meshnet.types import LayerSpan, SessionId
from meshnet.wire import FrameMeta
from meshnet.wire import encode as plain_encode
from meshnet.wire.frame import Encoded, tensor_bytes


def new_session(kind: str = "s") -> SessionId:
    """A session id this process may sign for."""
    return PROCESS_KEYS.new_id(kind)


def proof(
    meta: FrameMeta, hidden: torch.Tensor, spans: tuple[LayerSpan, ...] | None = None
) -> dict[str, str]:
    """The proof header for `meta` carrying `hidden`, good at `spans` (its own layers unless
    given)."""
    body = Body.of(tensor_bytes(hidden), tuple(hidden.shape))
    return {PROOF: PROCESS_KEYS.frame_proof(meta, spans or (meta.span,), body)}


def close_proof(session: str, node_id: str) -> dict[str, str]:
    return {PROOF: PROCESS_KEYS.close_proof(session, node_id)}


def encode(
    tensor: torch.Tensor,
    meta: FrameMeta,
    config: WireConfig = WireConfig(),
    link_bytes_per_s: float | None = None,
) -> Encoded:
    """`wire.encode` with the frame's session proof among its headers."""
    frame = plain_encode(tensor, meta, config, link_bytes_per_s)
    return Encoded(frame.headers | proof(meta, tensor), frame.body)


class Sessions(dict[str, SessionId]):
    """Ids by a test's own names: `SID["s1"]` is one id all through a test module."""

    def __missing__(self, name: str) -> SessionId:
        self[name] = new_session()
        return self[name]

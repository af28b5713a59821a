"""Who may speak for a node id (review finding 2: an id was only a claim).

Registration through the tracker's app hands the node a random **membership token**; the
tracker keeps only its SHA-256. Heartbeats and `leave` must carry it, and a `report` the
token of the reporting node: holding the swarm key no longer lets one member speak for
another. A live id cannot be taken over from another address while the old one still
answers the probe as that id (409). A heartbeat may claim only spans the tracker assigned,
spans the node registered with, or spans it held before (400 otherwise), and a registration
only spans that fit its budget.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from collections.abc import Iterable, Mapping
from typing import Any

from meshnet.errors import MeshError
from meshnet.types import LayerSpan, ModelId, NodeId

Key = tuple[ModelId, LayerSpan]


class UnknownNodeError(MeshError):
    """A heartbeat from a node this tracker does not know (e.g. after a tracker restart)."""

    http_status = 404


class RegistrationError(MeshError):
    http_status = 400


class TooManyNodesError(MeshError):
    """The tracker holds as many nodes as it may (in all, or from one address)."""

    http_status = 429


class NotYourNodeError(MeshError):
    """A call for a node id without that node's membership token."""

    http_status = 403


class NodeConflictError(MeshError):
    """A registration for an id that is live at another address."""

    http_status = 409


class ClaimError(MeshError):
    """A node claims spans the tracker never gave it, or more than its budget holds."""

    http_status = 400


def new_token() -> str:
    return secrets.token_urlsafe(24)


def token_digest(token: str) -> bytes:
    return hashlib.sha256(token.encode()).digest()


def check_token(kept: bytes | None, token: str, node_id: str) -> None:
    """Refuse (403) a call for `node_id` whose token is not the one it registered with.
    `kept` None: registered in-process, with no token to check."""
    if kept is not None and not hmac.compare_digest(kept, token_digest(token)):
        raise NotYourNodeError(
            f"this call needs node {node_id}'s membership token (from its registration)",
            field="token",
        )


def check_claims(node_id: str, claimed: set[Key], allowed: set[Key], what: str) -> None:
    """Refuse (400) spans in `claimed` the tracker never let `node_id` hold."""
    foreign = sorted(claimed - allowed)
    if foreign:
        spans = ", ".join(f"{m} {s}" for m, s in foreign)
        raise ClaimError(
            f"node {node_id} {what} {spans}, which it was never assigned", field="loaded"
        )


def check_fits(
    node_id: str, spans: Iterable[Key], layer_bytes: Mapping[ModelId, int], budget_bytes: int
) -> None:
    """Refuse (400) spans whose layers alone pass the node's budget."""
    needed = sum(len(span) * layer_bytes.get(model, 0) for model, span in spans)
    if needed > budget_bytes:
        raise ClaimError(
            f"node {node_id} claims {needed} bytes of layers with a budget of {budget_bytes}",
            field="budget_bytes",
        )


def check_room(
    nodes: Mapping[NodeId, Any], node_id: NodeId, address: str, max_nodes: int, max_per_address: int
) -> None:
    """Refuse (429) a new node past the caps (`nodes`: node id -> record with a `peer`
    address); a node registering again is let in."""
    if node_id in nodes:
        return
    if len(nodes) >= max_nodes:
        raise TooManyNodesError(
            f"this tracker holds its limit of {max_nodes} nodes", field="node_id"
        )
    same = sum(1 for r in nodes.values() if r.peer == address)
    if same >= max_per_address:
        raise TooManyNodesError(
            f"{same} nodes already registered from {address}: the limit per address is "
            f"{max_per_address}",
            field="address",
        )

"""The meshnet error hierarchy and the HTTP status each error maps to.

    MeshError                       base of everything meshnet raises on purpose
    ├── WireError                   a malformed activation frame (400)
    │   ├── WireVersionError        the sender speaks another wire version (400)
    │   ├── PayloadTooLargeError    body or declared tensor over the receiver's limit (413)
    │   └── UnsupportedEncodingError  an X-Meshnet-Encoding the receiver does not know (415)
    ├── ModelError                  a model or checkpoint cannot be read or does not match (400)
    ├── SessionError                a session's cache cannot take this call (409)
    │   └── SessionNotFoundError    the session is unknown, expired or evicted (409)
    └── RouteError                  no chain of nodes can serve the request (503)
        └── MissingLayersError      some layers of a model have no node (503)

Apps turn a `MeshError` into a JSON body `{"error": {"type", "message", "field"}}` with
`http_status`; that mapping lives here and nowhere else.
"""

from __future__ import annotations


class MeshError(Exception):
    """Base class: a problem meshnet reports to its caller in words."""

    http_status = 500

    def __init__(self, message: str, *, field: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.field = field  # the header, parameter or JSON field at fault, when there is one

    def to_json(self) -> dict[str, object]:
        """The JSON error body every app answers with."""
        return {
            "error": {"type": type(self).__name__, "message": self.message, "field": self.field}
        }


class WireError(MeshError):
    http_status = 400


class WireVersionError(WireError):
    http_status = 400


class PayloadTooLargeError(WireError):
    http_status = 413


class UnsupportedEncodingError(WireError):
    http_status = 415


class ModelError(MeshError):
    http_status = 400


class SessionError(MeshError):
    http_status = 409


class SessionNotFoundError(SessionError):
    http_status = 409


class RouteError(MeshError):
    http_status = 503


class MissingLayersError(RouteError):
    http_status = 503

    def __init__(self, message: str, *, missing: list[tuple[int, int]]) -> None:
        super().__init__(message)
        self.missing = missing  # uncovered half-open ranges

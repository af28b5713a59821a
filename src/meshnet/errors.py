"""The meshnet error hierarchy and the HTTP status each error maps to.

    MeshError                       base of everything meshnet raises on purpose
    ├── WireError                   a malformed activation frame (400)
    │   ├── WireVersionError        the sender speaks another wire version (400)
    │   ├── PayloadTooLargeError    body or declared tensor over the receiver's limit (413)
    │   └── UnsupportedEncodingError  an X-Meshnet-Encoding the receiver does not know (415)
    ├── ModelError                  a model or checkpoint cannot be read or does not match (400)
    ├── SessionError                a session's cache cannot take this call (409)
    │   └── SessionNotFoundError    the session is unknown, expired or evicted (409)
    │       └── PrefixMissError     a kept prefix a fork names is gone on some hop (409)
    ├── RouteError                  no chain of nodes can serve the request (503)
    │   └── MissingLayersError      some layers of a model have no node (503)
    ├── HopError                    a hop of a route failed or refused a frame (502)
    ├── PushError                   a pushed frame could not go on past some hop (502)
    ├── UnavailableError            a draining node refuses new sessions (503)
    ├── RequestError                a client request the API cannot take (400)
    │   └── UnknownModelError       the request names a model this entry does not serve (404)
    ├── AuthError                   no valid swarm-key proof or API key (401)
    ├── SessionOwnerError           a session call its opening entry did not sign (403)
    ├── LimitError                  a configured limit refuses the call for now (429)
    ├── ConfigError                 a configuration meshnet refuses to start with
    └── WeightsError                weights that cannot be served, fetched or trusted (400)
        ├── NotHeldError            a model digest or part this member does not hold (404)
        ├── RangeError              bytes outside the part asked for (416)
        └── CopyDiffersError        a local copy that differs from the offered model (400)

Apps turn a `MeshError` into a JSON body with `http_status`; that mapping lives here and
nowhere else, and so does reading such a body back (`read_error`). The body is OpenAI's
error shape, `{"error": {"message", "type", "param", "code"}}`, plus `field` (the same as
`param`), so one shape serves every endpoint.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from dataclasses import field as dataclass_field
from typing import Any


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
            "error": {
                "message": self.message,
                "type": type(self).__name__,
                "param": self.field,
                "code": self.code,
                "field": self.field,
            }
        }

    @property
    def code(self) -> str | None:
        """A short machine-readable code (OpenAI's `code`), when the class has one."""
        return None

    def headers(self) -> dict[str, str]:
        """HTTP headers the answer carries besides the body (e.g. `Retry-After`)."""
        return {}


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


class PrefixMissError(SessionNotFoundError):
    """A hop no longer holds the kept prefix a new session forks from (ADR-0058): the entry
    prefills the prompt from nothing instead; no hop failed."""

    http_status = 409


class RouteError(MeshError):
    http_status = 503


class MissingLayersError(RouteError):
    http_status = 503

    def __init__(self, message: str, *, missing: list[tuple[int, int]]) -> None:
        super().__init__(message)
        self.missing = missing  # uncovered half-open ranges


class HopError(MeshError):
    """A node on the route failed (unreachable, timed out), refused a frame or sent a bad
    answer. The entry built the frame, so each is that hop's failure: another copy of its
    span takes the frame (ADR-0030); only 429 says the hop is healthy but full."""

    http_status = 502

    def __init__(self, message: str, *, status: int | None, hop: Any = None) -> None:
        super().__init__(message)
        self.status = status  # the hop's HTTP status; None when it never answered
        self.hop = hop  # the `types.Hop` that failed, when known
        self.stale = False  # the hop no longer serves those layers: our route was old
        self.reported = False  # the tracker was told already (a spot check's ban)
        if status == 429:  # a hop at its limits: the client should retry later, as with ours
            self.http_status = 429

    def headers(self) -> dict[str, str]:
        return {"Retry-After": "1"} if self.status == 429 else {}

    @property
    def busy(self) -> bool:
        """The hop is healthy but at one of its limits: try another copy, report nothing."""
        return self.status == 429


class PushError(MeshError):
    """A hop could not send a pushed frame on (ADR-0034): `failed` names the node that
    failed or refused it, `status` that node's HTTP status (None when it never answered).
    Each hop passes such an error back up unchanged, so the entry learns who failed."""

    http_status = 502

    def __init__(self, message: str, *, failed: str, status: int | None) -> None:
        super().__init__(message, field="X-Meshnet-Route")
        self.failed = failed
        self.status = status

    @property
    def code(self) -> str:
        return "push_failed"

    def to_json(self) -> dict[str, object]:
        body = super().to_json()
        body["error"] |= {"failed": self.failed, "status": self.status}  # type: ignore[operator]
        return body


class ComputeError(MeshError):
    """Finite activations gave NaN or Inf in this span: the session's cache is rolled back.
    Another copy of the span would compute the same, so it is not retried (422)."""

    http_status = 422


class UnavailableError(MeshError):
    """The node is shutting down and takes no new sessions."""

    http_status = 503


class SlowRequestError(MeshError):
    """The request's body did not arrive in time: the connection is given up."""

    http_status = 408


class RequestError(MeshError):
    http_status = 400

    @property
    def code(self) -> str | None:
        return "invalid_request_error"


class UnknownModelError(RequestError):
    http_status = 404

    @property
    def code(self) -> str | None:
        return "model_not_found"


class AuthError(MeshError):
    """The caller did not prove it may make this call; nothing was done."""

    http_status = 401

    @property
    def code(self) -> str | None:
        return "invalid_api_key" if self.field == "Authorization" else "unauthorized"

    def headers(self) -> dict[str, str]:
        scheme = "Bearer" if self.field == "Authorization" else "Meshnet-Swarm"
        return {"WWW-Authenticate": scheme}


class SessionOwnerError(MeshError):
    """A call on a session without its opening entry's signature (ADR-0049); nothing done."""

    http_status = 403

    @property
    def code(self) -> str | None:
        return "not_your_session"


class LimitError(MeshError):
    """A configured limit (sessions, KV memory, rate, concurrency) refuses the call for now."""

    http_status = 429

    def __init__(self, message: str, *, retry_after_s: float, field: str | None = None) -> None:
        super().__init__(message, field=field)
        self.retry_after_s = retry_after_s

    @property
    def code(self) -> str | None:
        return "rate_limit_exceeded"

    def headers(self) -> dict[str, str]:
        return {"Retry-After": str(max(1, round(self.retry_after_s)))}


class ConfigError(MeshError):
    """A configuration meshnet refuses to start with (bad key file, missing key...)."""

    http_status = 400


class WeightsError(MeshError):
    """Weights that cannot be served, fetched or trusted: a copy that differs from its
    model's manifest, a part no holder could give, a cache that cannot take it (ADR-0054)."""

    http_status = 400


class NotHeldError(WeightsError):
    """A weights call names a model digest or a part this member does not hold (404)."""

    http_status = 404


class RangeError(WeightsError):
    """A weights call asks for bytes outside the part it names (416)."""

    http_status = 416


class WeightsBusyError(WeightsError):
    """A holder already sends as many weight bytes as it allows at once (503: try later)."""

    http_status = 503


class CopyDiffersError(WeightsError):
    """A member's own copy of a model differs from the offered one (the part named): it
    serves no span of that model."""


@dataclass(frozen=True)
class ErrorBody:
    """An error as another member's JSON answer carried it (`MeshError.to_json`'s shape).
    Remote words: callers decide how much of `message` they pass on."""

    message: str
    type: str = ""
    field: str | None = None
    code: str | None = None
    raw: dict[str, Any] = dataclass_field(default_factory=dict)  # the whole `error` object


def read_error(body: bytes | str) -> ErrorBody | None:
    """The `error` object of a JSON error body, or None when `body` is not one."""
    try:
        error = json.loads(body)["error"]
        message = str(error["message"])
    except (ValueError, KeyError, TypeError):
        return None
    field, code = error.get("field"), error.get("code")
    return ErrorBody(
        message,
        str(error.get("type") or ""),
        field if isinstance(field, str) else None,
        code if isinstance(code, str) else None,
        error,
    )

"""The calling side of swarm-key proofs: headers for aiohttp, an `httpx.Auth` for httpx, and
the check of a member's signed answer (ADR-0017, ADR-0031)."""

from __future__ import annotations

import hashlib
import hmac
import time
from collections.abc import Callable, Generator, Iterable, Mapping

import httpx

from meshnet.errors import AuthError
from meshnet.security.swarm import ANSWER_HEADER, HEADER, SwarmKey, answer_mac, parse, sign


class AnswerNotSigned(httpx.RemoteProtocolError):
    """A member's 2xx answer without a valid `X-Meshnet-Answer`: dropped like a broken
    connection (its directives, routes or activations are never used)."""


class Signer:
    """Signs outgoing member calls with the swarm key and checks their answers (no key:
    signs and checks nothing)."""

    def __init__(self, key: str | None, clock: Callable[[], float] = time.time) -> None:
        self.key = SwarmKey.from_text(key) if key else None
        self.clock = clock

    def headers(
        self,
        method: str,
        target: str,
        body: bytes = b"",
        *,
        to: str,
        headers: Mapping[str, str] | None = None,
    ) -> dict[str, str]:
        """`{X-Meshnet-Auth: ...}` for a call to the member `to` at `target` (path and query)
        that also sends `headers`; `{}` without a key."""
        if self.key is None:
            return {}
        items = (headers or {}).items()
        return {HEADER: sign(self.key, method, target.encode(), body, self.clock(), to, items)}

    def check_answer(
        self,
        sent: Mapping[str, str],
        status: int,
        headers: Iterable[tuple[str, str]],
        body: bytes,
    ) -> None:
        """Accept the answer to a call sent with headers `sent`, or `AuthError`: a 2xx answer
        must carry the answering member's MAC over our nonce, its headers and its body."""
        if self.key is None or not 200 <= status < 300:
            return  # refusals carry no directives or activations; a guard's 401 is unsigned
        if not self.signed(sent, status, headers, body):
            raise AuthError(f"{ANSWER_HEADER} is missing or wrong", field=ANSWER_HEADER)

    def signed(
        self,
        sent: Mapping[str, str],
        status: int,
        headers: Iterable[tuple[str, str]],
        body: bytes,
    ) -> bool:
        """Whether the answering member signed this answer, whatever its status (True
        without a key). An app's refusals are signed; only the guard's own are not."""
        if self.key is None:
            return True
        headers = list(headers)
        given = next((v for k, v in headers if k.lower() == ANSWER_HEADER.lower()), "")
        nonce = parse(_get(sent, HEADER)).nonce
        mac = answer_mac(self.key, nonce, status, headers, hashlib.sha256(body).hexdigest())
        return hmac.compare_digest(f"v2 s={mac}", given.strip())

    def auth(self, to: str, *, answers: bool = True) -> httpx.Auth | None:
        """httpx auth for calls to the member `to`; `answers`: check 2xx answers are signed
        (reads each answer whole before handing it over)."""
        if self.key is None:
            return None
        return CheckedSwarmAuth(self, to) if answers else SwarmAuth(self, to)


def _get(headers: Mapping[str, str], name: str) -> str | None:
    return next((v for k, v in headers.items() if k.lower() == name.lower()), None)


class SwarmAuth(httpx.Auth):
    """httpx authentication that adds a swarm-key proof to every request."""

    requires_request_body = True

    def __init__(self, signer: Signer, to: str) -> None:
        self.signer = signer
        self.to = to

    def auth_flow(self, request: httpx.Request) -> Generator[httpx.Request, httpx.Response, None]:
        self.sign(request)
        yield request

    def sign(self, request: httpx.Request) -> None:
        target = request.url.raw_path.decode("ascii")
        sent = dict(request.headers.multi_items())
        signer = self.signer
        request.headers.update(
            signer.headers(request.method, target, request.content, to=self.to, headers=sent)
        )


class CheckedSwarmAuth(SwarmAuth):
    """`SwarmAuth` that also refuses a 2xx answer the member did not sign (`AnswerNotSigned`)."""

    requires_response_body = True

    def auth_flow(self, request: httpx.Request) -> Generator[httpx.Request, httpx.Response, None]:
        self.sign(request)
        response = yield request
        try:
            items = response.headers.multi_items()
            self.signer.check_answer(request.headers, response.status_code, items, response.content)
        except AuthError as exc:
            raise AnswerNotSigned(f"{request.url}: {exc.message}", request=request) from exc

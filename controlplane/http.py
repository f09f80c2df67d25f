"""The operator side's HTTP: one client library (httpx), one way to make its clients, one bounded
reader of answers and the one-line description of a request that failed.

* :func:`async_client` and :func:`sync_client` make every client the operator side talks to
  replicas with: no proxies from the environment, no cookies kept, no redirects followed, every
  phase of a request (connect, write, each read, the wait for a pooled connection) bounded by
  the timeout. :class:`controlplane.replica_http.PollingClient` adds its cap of connections per
  replica (:data:`MAX_CONNECTIONS_PER_HOST`) and a bound on the whole request.
* :func:`read_answer` and :func:`read_answer_sync` read an answer streamed, with a cap on its size:
  a declared Content-Length past the cap is refused before any of the body is read, and an
  answer that never ends (a broken or hostile replica) costs at most the cap in memory, however
  long the timeout, instead of growing until the timeout ends it. The cap counts the decoded
  bytes (a compressed answer is capped as it unpacks).
* :func:`describe_http_error` names what failed in a few words (``state: timeout after 2 s``,
  ``metrics: down (...)``), which the TUI, ``tailpilot status`` and the recorder's log show.

When a request is asked again is :mod:`controlplane.retry`'s one policy.
"""

from __future__ import annotations

import asyncio
import functools
import ssl
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from http.cookiejar import CookieJar, DefaultCookiePolicy
from typing import Any

import httpx

#: The most connections the collector's client holds to one replica (its control API or its vLLM
#: API server) at a time: a replica's polls never overlap, so this is room for a settings change
#: or an autopilot read beside a poll, never a flood of connections to a slow replica.
MAX_CONNECTIONS_PER_HOST = 4

#: What a request that fails as a transport (connection refused or lost, a timeout, a malformed
#: URL or answer) raises; everything else a caller meets is a bug, not the replica's doing.
TRANSPORT_ERRORS: tuple[type[BaseException], ...] = (
    httpx.HTTPError,
    httpx.InvalidURL,
    TimeoutError,
    OSError,
)


@dataclass(slots=True)
class Answer:
    """An HTTP answer read whole (within its cap): status, body, reason phrase and headers."""

    status_code: int
    content: bytes
    reason_phrase: str = ""
    headers: Mapping[str, str] = field(default_factory=dict)

    @property
    def text(self) -> str:
        return self.content.decode("utf-8", "replace")


class AnswerTooLarge(ValueError):
    """An answer longer than the cap for its kind; nothing of it is used."""


def _mib(n: int) -> str:
    return f"{n / (1024 * 1024):g} MiB"


def too_large(what: str, limit: int) -> AnswerTooLarge:
    """The error for an answer to ``what`` past ``limit`` bytes (its message is shown as is)."""
    return AnswerTooLarge(
        f"{what}: answer larger than {_mib(limit)} (the collector reads at most that much)"
    )


def _refuse_declared(response: httpx.Response, limit: int, what: str) -> None:
    """:class:`AnswerTooLarge` when the answer declares a Content-Length past ``limit``."""
    declared = response.headers.get("content-length")
    if declared is not None and declared.strip().isdigit() and int(declared) > limit:
        raise too_large(what, limit)


def bounded_body(chunks: Iterable[bytes], limit: int, what: str) -> bytes:
    """The bytes of ``chunks`` (a body read streamed), or :class:`AnswerTooLarge` as soon as they
    pass ``limit``."""
    body = bytearray()
    for chunk in chunks:
        body += chunk
        if len(body) > limit:
            raise too_large(what, limit)
    return bytes(body)


async def read_answer(response: httpx.Response, limit: int, what: str) -> Answer:
    """A streamed answer's body (``client.send(..., stream=True)``), :class:`AnswerTooLarge` past
    ``limit`` bytes; the caller closes the response."""
    _refuse_declared(response, limit, what)
    body = bytearray()
    async for chunk in response.aiter_bytes():  # decoded bytes, if the answer is compressed
        body += chunk
        if len(body) > limit:
            raise too_large(what, limit)
    return Answer(response.status_code, bytes(body), response.reason_phrase, response.headers)


def read_answer_sync(response: httpx.Response, limit: int, what: str) -> Answer:
    """:func:`read_answer` for a synchronous client's streamed answer."""
    _refuse_declared(response, limit, what)
    body = bounded_body(response.iter_bytes(), limit, what)
    return Answer(response.status_code, body, response.reason_phrase, response.headers)


def get_sync(
    client: httpx.Client, url: str, limit: int, what: str, params: dict[str, Any] | None = None
) -> Answer:
    """GET ``url`` (``params`` as its query) with a synchronous client, the answer read with
    :func:`read_answer_sync`."""
    with client.stream("GET", url, params=params) as response:
        return read_answer_sync(response, limit, what)


def _no_cookies() -> CookieJar:
    """A cookie jar that keeps nothing a replica sets (no domain is allowed to set one)."""
    return CookieJar(policy=DefaultCookiePolicy(allowed_domains=[]))


def request_timeout(timeout_s: float) -> httpx.Timeout:
    """Every phase of a request (connect, write, each read, the wait for a pooled connection)
    bounded by ``timeout_s``; a client's default, or one request's own."""
    return httpx.Timeout(timeout_s)


@functools.cache
def tls_context() -> ssl.SSLContext:
    """What every client verifies a replica's certificate against: the system's trust store
    (``ssl.create_default_context``), loaded once per process (it takes tens of milliseconds)."""
    return ssl.create_default_context()


def async_client(timeout_s: float, *, keepalive: bool = True) -> httpx.AsyncClient:
    """The operator side's async client: every phase of a request bounded by ``timeout_s``, no
    proxies from the environment, no cookies, no redirects, certificates checked against
    :func:`tls_context`; idle connections kept for the next poll (none with ``keepalive=False``:
    every request opens its own). Making one may load the trust store: on an event loop, make it
    on a worker thread (``asyncio.to_thread``); it binds to the event loop it is first used on."""
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None if keepalive else 0)
    return httpx.AsyncClient(
        timeout=request_timeout(timeout_s),
        limits=limits,
        trust_env=False,
        cookies=_no_cookies(),
        follow_redirects=False,
        verify=tls_context(),
    )


def sync_client(timeout_s: float) -> httpx.Client:
    """:func:`async_client`'s synchronous twin (``tailpilot calibrate``, the ``set`` preview)."""
    return httpx.Client(
        timeout=request_timeout(timeout_s),
        trust_env=False,
        cookies=_no_cookies(),
        follow_redirects=False,
        verify=tls_context(),
    )


def describe_http_error(err: BaseException, what: str, timeout_s: float) -> str:
    """A failed request to ``what`` as one line: a timeout, a replica down (connection refused),
    a connection lost mid-answer, or the error's type and message."""
    if isinstance(err, (TimeoutError, asyncio.TimeoutError, httpx.TimeoutException)):
        return f"{what}: timeout after {timeout_s:g} s"
    if isinstance(err, httpx.ConnectError):
        return f"{what}: down ({err or 'connection refused'})"
    if isinstance(err, (httpx.NetworkError, httpx.RemoteProtocolError, httpx.DecodingError)):
        return f"{what}: connection lost ({type(err).__name__}: {err})"
    return f"{what}: {type(err).__name__}: {err}"

"""The operator side's HTTP: one client library (aiohttp), one way to make its sessions, one
bounded reader of answers and the one-line description of a request that failed.

aiohttp, not httpx: its C HTTP parser on plain asyncio transports costs the collector (the hot
path: every replica polled every second) ~2.7 times less CPU than httpx's pure-Python stack —
``benchmarks/collector_cpu.py --replicas 32``, back to back: 16–17.5% of a core against 42–48%.

* :func:`async_client` makes every session the operator side talks to replicas with: no proxies
  or ``.netrc`` from the environment, no cookies kept, no redirects followed (every request goes
  through :func:`request`), at most :data:`MAX_CONNECTIONS_PER_HOST` connections to one replica,
  each phase of a request (the wait for a pooled connection and the connect, each read) bounded by
  the timeout; certificates checked against the system's trust store (:func:`tls_context`).
  :class:`controlplane.replica_http.PollingClient` adds a bound on the whole request.
* :func:`sync_client` and :func:`get_sync` are the synchronous face of the same path (``tailpilot
  calibrate``, the ``set`` preview): each request runs the async one to completion on the client's
  own event loop (``asyncio.Runner``: ``asyncio.run`` kept for the next request, so its
  connections are too). Never called from a running event loop (a coroutine uses the async path;
  a worker thread, ``asyncio.to_thread``, may call it).
* :func:`read_answer` reads an answer streamed, with a cap on its size: a declared Content-Length
  past the cap is refused before any of the body is read, and an answer that never ends (a broken
  or hostile replica) costs at most the cap in memory, however long the timeout, instead of
  growing until the timeout ends it. The cap counts the decoded bytes (a compressed answer is
  capped as it unpacks).
* :func:`describe_http_error` names what failed in a few words (``state: timeout after 2 s``,
  ``metrics: down (...)``), which the TUI, ``tailpilot status`` and the recorder's log show.

When a request is asked again is :mod:`controlplane.retry`'s one policy.
"""

from __future__ import annotations

import asyncio
import functools
import ssl
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

import aiohttp

from scheduler.errors import FAILED, TailpilotError

#: The most connections a session holds to one replica (its control API or its vLLM API server) at
#: a time: a replica's polls never overlap, so this is room for a settings change or an autopilot
#: read beside a poll, never a flood of connections to a slow replica.
MAX_CONNECTIONS_PER_HOST = 4

#: What a request that fails as a transport (connection refused or lost, a timeout, a malformed
#: URL or answer) raises; everything else a caller meets is a bug, not the replica's doing.
#: (``aiohttp.InvalidURL`` is a ClientError; ``asyncio.TimeoutError`` is TimeoutError.)
TRANSPORT_ERRORS: tuple[type[BaseException], ...] = (
    aiohttp.ClientError,
    TimeoutError,
    OSError,
)

#: The size of the pieces an answer's body is read in (the cap is checked after each).
_READ_CHUNK = 64 * 1024


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


class AnswerTooLarge(TailpilotError, ValueError):
    """An answer longer than the cap for its kind; nothing of it is used."""

    exit_code = FAILED


def _mib(n: int) -> str:
    return f"{n / (1024 * 1024):g} MiB"


def too_large(what: str, limit: int) -> AnswerTooLarge:
    """The error for an answer to ``what`` past ``limit`` bytes (its message is shown as is)."""
    return AnswerTooLarge(
        f"{what}: answer larger than {_mib(limit)} (the collector reads at most that much)"
    )


async def read_answer(response: aiohttp.ClientResponse, limit: int, what: str) -> Answer:
    """An answer's body read streamed, :class:`AnswerTooLarge` past ``limit`` bytes (a declared
    Content-Length past it is refused before any of the body is read); the caller releases the
    response (an answer left unread closes its connection: nothing more of it is read)."""
    declared = response.content_length
    if declared is not None and declared > limit:
        raise too_large(what, limit)
    body = bytearray()
    async for chunk in response.content.iter_chunked(_READ_CHUNK):  # decoded, if compressed
        body += chunk
        if len(body) > limit:
            raise too_large(what, limit)
    return Answer(response.status, bytes(body), response.reason or "", response.headers)


def request_timeout(timeout_s: float) -> aiohttp.ClientTimeout:
    """Every phase of a request bounded by ``timeout_s``: the wait for a pooled connection and the
    connect (``connect``, ``sock_connect``) and each read of the answer (``sock_read``); a
    session's default, or one request's own. The whole request is its caller's bound
    (``asyncio.timeout``), as a trickling answer may take longer than any one phase."""
    return aiohttp.ClientTimeout(
        total=None, connect=timeout_s, sock_connect=timeout_s, sock_read=timeout_s
    )


@functools.cache
def tls_context() -> ssl.SSLContext:
    """What every session verifies a replica's certificate against: the system's trust store
    (``ssl.create_default_context``), loaded once per process (it takes tens of milliseconds)."""
    return ssl.create_default_context()


def async_client(timeout_s: float, *, keepalive: bool = True) -> aiohttp.ClientSession:
    """The operator side's session: every phase of a request bounded by ``timeout_s``
    (:func:`request_timeout`), no proxies from the environment, no cookies, at most
    :data:`MAX_CONNECTIONS_PER_HOST` connections to one replica, certificates checked against
    :func:`tls_context`; idle connections kept for the next poll (none with ``keepalive=False``:
    every request opens its own). Make it on the event loop it is used on (aiohttp binds it
    there); the trust store it loads the first time may be loaded ahead on a worker thread
    (``asyncio.to_thread(tls_context)``). Requests go through :func:`request` (no redirects)."""
    connector = aiohttp.TCPConnector(
        limit=0,  # no bound across replicas: the collector polls them all at once
        limit_per_host=MAX_CONNECTIONS_PER_HOST,
        force_close=not keepalive,
        ssl=tls_context(),
    )
    return aiohttp.ClientSession(
        connector=connector,
        timeout=request_timeout(timeout_s),
        trust_env=False,
        cookie_jar=aiohttp.DummyCookieJar(),
    )


async def request(
    session: aiohttp.ClientSession,
    method: str,
    url: str,
    limit: int,
    what: str,
    *,
    params: Mapping[str, Any] | None = None,
    headers: Mapping[str, str] | None = None,
    body: bytes | None = None,
    timeout_s: float | None = None,
) -> Answer:
    """One request on ``session`` (:func:`async_client`), no redirect followed, its answer read
    with :func:`read_answer` (``limit`` bytes at most); ``timeout_s`` bounds its phases in place
    of the session's own."""
    options: dict[str, Any] = {}
    if timeout_s is not None:
        options["timeout"] = request_timeout(timeout_s)
    async with session.request(
        method,
        url,
        params=params,
        headers=headers,
        data=body,
        allow_redirects=False,
        **options,
    ) as response:
        return await read_answer(response, limit, what)


class SyncClient:
    """:func:`async_client`'s synchronous face (:func:`sync_client`): each request runs the async
    path on this client's own event loop, kept with its session (and their idle connections)
    until :meth:`close`. A context manager; for one thread, never one running an event loop."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._runner: asyncio.Runner | None = None
        self._session: aiohttp.ClientSession | None = None

    async def _get(
        self, url: str, limit: int, what: str, params: Mapping[str, Any] | None
    ) -> Answer:
        if self._session is None:
            self._session = async_client(self.timeout_s)
        return await request(self._session, "GET", url, limit, what, params=params)

    def get(
        self, url: str, limit: int, what: str, params: Mapping[str, Any] | None = None
    ) -> Answer:
        """GET ``url`` (``params`` as its query), the answer read with :func:`read_answer`."""
        if self._runner is None:
            self._runner = asyncio.Runner()
        return self._runner.run(self._get(url, limit, what, params))

    def close(self) -> None:
        """Close the session (its connections) and the event loop."""
        runner, session = self._runner, self._session
        self._runner = self._session = None
        if runner is None:
            return
        try:
            if session is not None:
                runner.run(session.close())
        finally:
            runner.close()

    def __enter__(self) -> SyncClient:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


def sync_client(timeout_s: float) -> SyncClient:
    """:func:`async_client`'s synchronous twin (``tailpilot calibrate``, the ``set`` preview)."""
    return SyncClient(timeout_s)


def get_sync(
    client: SyncClient, url: str, limit: int, what: str, params: dict[str, Any] | None = None
) -> Answer:
    """GET ``url`` (``params`` as its query) with a synchronous client, the answer read with
    :func:`read_answer`."""
    return client.get(url, limit, what, params)


def describe_http_error(err: BaseException, what: str, timeout_s: float) -> str:
    """A failed request to ``what`` as one line: a timeout, a replica down (connection refused),
    a connection lost mid-answer, or the error's type and message."""
    if isinstance(err, TimeoutError):  # asyncio's, and aiohttp's connect and read timeouts
        return f"{what}: timeout after {timeout_s:g} s"
    if isinstance(err, aiohttp.ClientConnectorError):
        return f"{what}: down ({err.os_error or 'connection refused'})"
    if isinstance(
        err,
        (
            aiohttp.ServerDisconnectedError,
            aiohttp.ClientPayloadError,
            aiohttp.ClientResponseError,
            aiohttp.ClientOSError,
        ),
    ):
        return f"{what}: connection lost ({type(err).__name__}: {err})"
    return f"{what}: {type(err).__name__}: {err}"

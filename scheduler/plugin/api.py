"""The replica control API (docs/control-api.md), served on a daemon thread next to the scheduler.

    GET /tailpilot/v1/state[?cursor=N]   queue, KV, live γ/β, counters; with a cursor also the
                                         completions since N (at most a page; ``more``,
                                         ``next_cursor``)
    GET /tailpilot/v1/settings           the active (or staged) settings document and its version
    PUT /tailpilot/v1/settings           validate + stage a document; If-Match: <version> for CAS
    GET /tailpilot/v1/steps?cursor=N     the step log (duration and batch composition per step),
                                         paged
    GET /tailpilot/v1/inflight[?limit=N] the oldest requests in flight (no output lengths), at
                                         most 1,000
    GET /tailpilot/v1/health

A target that also plays a vLLM server (the simulated twin replicas) may define any of
``api_metrics() -> (body bytes, content type)``, ``api_models() -> dict`` and
``api_health() -> bool``; the server then also answers ``GET /metrics``, ``GET /v1/models`` and
``GET /health`` (200, or 503 when unhealthy) on the same port, as vLLM's API server does.

Loopback by default; writes need ``Authorization: Bearer <token>`` with the token from
``$TAILPILOT_TOKEN`` or the file named by ``$TAILPILOT_TOKEN_FILE``. Without a configured token
(unset, empty or whitespace) every write is refused: an operator must opt in to remote control.

This server lives in vLLM's engine-core process, so everything it does is bounded (``Limits``):
the token is checked from the headers before any body is read; a write must declare one
``Content-Length`` no larger than ``max_body``; request line and headers share a byte budget; a
connection that is silent, trickles or reads its answer too slowly is closed by a reaper thread;
each connection, each client address and all of them together are rate-limited, and a client over
its rate gets 429 with ``Retry-After`` after a short pause that costs the engine nothing (a sleeping
thread does not hold the GIL). Admission is fair to the operator: a request carrying the bearer
token (reads included) is a token holder's, and a share of the connections and of the request rate
(``token_reserve``) is kept for token holders, so unauthenticated clients cannot lock the collector
out; when connections run short, the idlest unauthenticated one is closed early; a refused
connection gets its 503 after the same pause, held without a thread. Every request gets
an HTTP answer: malformed ones a 4xx JSON error naming the problem, the server's own failures a
500 (logged once per kind, briefly). Only standard-library parts: nothing heavy enters vLLM's
process.

The pieces: this module answers requests (``ControlHandler``, its route table ``ROUTES``) and
starts the server (``ControlServer``); ``scheduler.plugin.request`` reads a request's headers,
query and body within their budgets (``HTTPError`` for what cannot be answered as asked);
``scheduler.plugin.admission`` admits, times and refuses connections and requests (``Limits``);
``scheduler.plugin.wire`` reads and writes strict JSON.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hmac
import http.client
import logging
import math
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler
from typing import Any, NoReturn, Protocol, cast
from urllib.parse import urlsplit

from pydantic import ValidationError

from scheduler.plugin.admission import CLOSED_EARLY, BoundedHTTPServer, Limits, TokenBucket
from scheduler.plugin.core import SettingsConflict
from scheduler.plugin.env import DEFAULT_PORT, TOKEN_ENV, TOKEN_FILE_ENV, PluginEnv
from scheduler.plugin.lease import LEASE_HEADER, LeaseConflict, parse_lease_header
from scheduler.plugin.request import (
    HeaderBudgetReader,
    HTTPError,
    has_body,
    header_problem,
    parse_cursor,
    parse_if_match,
    parse_limit,
    parse_query,
    read_settings_document,
)
from scheduler.plugin.wire import encode_json
from scheduler.settings import describe_error

PREFIX = "/tailpilot/v1"
log = logging.getLogger("tailpilot.control")

LINGER_S = 0.5  # at most this long reading what a refused client still sends before closing


def token_from_env(env: PluginEnv | None = None) -> str | None:
    """The write token; an empty or whitespace-only one is no token (writes stay refused)."""
    env = env or PluginEnv.read()
    token = env.token
    if not token and (path := env.token_file):
        try:
            token = path.read_text(encoding="utf-8").strip()
        except (OSError, UnicodeDecodeError) as err:
            log.warning(
                "tailpilot control API: cannot read %s=%s (%s): writes are disabled",
                TOKEN_FILE_ENV,
                path,
                type(err).__name__,
            )
            return None
    return token or None


class ControlTarget(Protocol):
    """What the control endpoints answer from (the plugin's replica, a twin, the recorder's
    page)."""

    def api_state(self, cursor: int | None) -> dict[str, Any]: ...
    def api_settings(self) -> dict[str, Any]: ...
    def api_put_settings(
        self, doc: dict[str, Any], if_match: int | None, lease: tuple[str, str] | None = None
    ) -> dict[str, Any]: ...
    def api_steps(self, cursor: int) -> dict[str, Any]: ...


class OptionalEndpoints(Protocol):
    """What a target may also define; each endpoint exists only on a target that does
    (``Route.needs``)."""

    def api_inflight(self, limit: int) -> dict[str, Any]: ...
    def api_metrics(self) -> tuple[bytes, str]: ...  # (body, content type)
    def api_models(self) -> dict[str, Any]: ...
    def api_health(self) -> bool: ...
    def api_lease(self, doc: dict[str, Any]) -> dict[str, Any]: ...


class ControlHTTPServer(BoundedHTTPServer):
    """The bounded server with what its handlers answer from: the target and the write token."""

    def __init__(
        self, address: tuple[str, int], target: ControlTarget, token: str | None, limits: Limits
    ) -> None:
        self.target = target
        self.token = token.encode() if token else None  # compared as bytes, in constant time
        super().__init__(address, ControlHandler, limits)


class ControlHandler(BaseHTTPRequestHandler):
    """One connection's requests, each read top to bottom: its headers are framed, authenticated
    and admitted to a connection slot (``parse_request``); then it is admitted to the rate budgets,
    routed (``ROUTES``) and answered (``_serve``). Every request gets an HTTP answer."""

    server_version = "tailpilot-control/1"
    protocol_version = "HTTP/1.1"
    # Headers and body go out in separate writes: with Nagle's algorithm the body waits for
    # the client's delayed ACK (~40 ms per request on Linux).
    disable_nagle_algorithm = True
    server: ControlHTTPServer

    def setup(self) -> None:
        super().setup()
        limits = self.server.limits
        # Per socket operation; the reaper bounds the total.
        self.connection.settimeout(limits.request_timeout_s)
        self.reader = HeaderBudgetReader(self.rfile, limits.max_header_bytes)
        # http.server reads rfile by readline and read only; typeshed's BufferedIOBase is stricter.
        self.rfile = self.reader  # type: ignore[assignment]
        self.bucket = TokenBucket(limits.rate_per_connection, limits.clock)
        # Whose per-address budget anonymous requests draw on.
        self.address = str(self.client_address[0])
        self.authenticated = False  # the current request carries this replica's token
        self.linger = False  # closing on unread input: drain a little so the answer is not reset

    def finish(self) -> None:
        super().finish()
        if self.linger:
            # Closing a socket with unread input sends a reset, which can destroy the answer
            # still in flight to the client; stop writing and discard a bounded amount first.
            with contextlib.suppress(OSError):
                self.request.shutdown(socket.SHUT_WR)
                self.request.settimeout(LINGER_S)
                drained = 0
                while drained < self.server.limits.max_body and (chunk := self.request.recv(16384)):
                    drained += len(chunk)

    def log_message(self, fmt: str, *args: Any) -> None:
        pass  # quiet: the engine's log is not ours to flood

    # --- the request cycle: framed, authenticated, admitted (from the headers) --------------------
    def handle_one_request(self) -> None:
        self.reader.new_request()
        self.command, self.requestline, self.request_version = "", "", self.default_request_version
        try:
            super().handle_one_request()
        except http.client.LineTooLong as err:
            self.close_connection = True
            self.send_error(431, str(err))
        self.server.end_request(self.request, keep_alive=not self.close_connection)

    def parse_request(self) -> bool:
        """True to answer the request; False when it has been answered or refused already."""
        # The request line is in: the rest of this request has ``request_timeout_s``.
        self.server.set_deadline(self.request, self.server.limits.request_timeout_s)
        if not super().parse_request() or not self._framed():
            return False
        self.authenticated = self._authenticate()
        return self._admit_connection()

    def _framed(self) -> bool:
        """Refuse (400) what cannot be answered safely: an HTTP/0.9 request, a header block that
        another reader could read otherwise (``header_problem``)."""
        if self.request_version == "HTTP/0.9":  # no headers, no status line: nothing to answer with
            self.send_error(400, "HTTP/0.9 requests are not supported")
            return False
        if (problem := header_problem(self.headers)) is not None:
            self.send_error(400, problem)
            return False
        return True

    def _authenticate(self) -> bool:
        """Whether the request carries this replica's token, compared as bytes in constant time
        whatever was sent."""
        given, token = self._bearer(), self.server.token
        return (
            given is not None
            and token is not None
            and hmac.compare_digest(given.encode("latin-1", "replace"), token)
        )

    def _admit_connection(self) -> bool:
        """Whether the server lets this connection carry the request
        (``BoundedHTTPServer.begin_request``); a refused one is answered 503 and closed."""
        refusal = self.server.begin_request(self.request, self.authenticated)
        if refusal is None:
            return True
        self.close_connection = True
        if (
            refusal is CLOSED_EARLY
        ):  # closed to make room while its request arrived: nobody to answer
            return False
        # Unread input: answer now and drain it (closing later would reset it).
        if has_body(self.headers):
            self.linger = True
            with contextlib.suppress(OSError):
                self._send(503, {"error": refusal, "status": 503}, {"Retry-After": "1"})
        else:  # the server answers after the pause, without this thread
            self.server.refuse_on_close(self.request, refusal)
        return False

    def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
        """http.server's own errors (bad request line, headers, method) as JSON, connection
        closed."""
        self.close_connection = self.linger = True
        self.request_version = (
            "HTTP/1.1"  # an HTTP/0.9-looking request line still gets a status line
        )
        with contextlib.suppress(OSError):
            self._send(code, {"error": message or explain or "bad request", "status": code})

    # --- the request cycle: rate-admitted, routed, answered ---------------------------------------
    def _serve(self) -> None:
        try:
            self._admit_rate()
            self._route()
        except HTTPError as err:
            if err.close:
                self.close_connection = self.linger = True
            self._send(err.status, {"error": str(err), "status": err.status}, err.headers)
        except (ConnectionError, TimeoutError):
            self.close_connection = True
        except Exception as err:  # ours, not the client's: answer, log once per kind, carry on
            self.close_connection = True
            self.server.log_failure(err)
            with contextlib.suppress(OSError):
                self._send(500, {"error": f"internal error ({type(err).__name__})", "status": 500})

    # Methods http.server does not find here get its own 501; these are all routed (404/405 when
    # the route table has no answer).
    do_GET = do_PUT = do_HEAD = do_POST = do_DELETE = do_PATCH = do_OPTIONS = _serve

    def _admit_rate(self) -> None:
        """Draw on this connection's rate budget, then on the shared ones; over them, 429."""
        limits = self.server.limits
        # The shared budgets only for requests this connection's own budget lets through.
        wait = self.bucket.take() or self.server.rates.take(self.address, self.authenticated)
        if wait > 0:
            # No GIL held while asleep: the engine runs on. An anonymous client waits the
            # whole pause, so one that ignores Retry-After costs a request per pause, not
            # one per refill of its budget.
            time.sleep(
                min(wait, limits.max_penalty_s) if self.authenticated else limits.max_penalty_s
            )
            raise HTTPError(
                429,
                "too many requests: slow down",
                headers={"Retry-After": str(max(1, math.ceil(wait)))},
            )

    def _route(self) -> None:
        path = urlsplit(self.path).path
        # A GET with a body: we do not read it, so the connection cannot carry another request.
        if self.command == "GET" and has_body(self.headers):
            self.close_connection = True
        route = ROUTES.get((self.command, path))
        if route is None or not route.served_by(self.server.target):
            self._no_route(path)
        route.answer(self)

    def _no_route(self, path: str) -> NoReturn:
        """No answer for this method on ``path``: 405 naming the methods that have one, else 404."""
        allowed = _allowed(path, self.server.target)
        if allowed is None and self.command == "GET":
            parse_query(self.path, ())  # a GET's query is checked before its path is looked up
            raise HTTPError(
                404, f"no such endpoint: {path[:200]}"
            )  # nothing unread: the connection stays
        if allowed is None:
            raise HTTPError(404, f"no such endpoint: {path[:200]}", close=True)
        raise HTTPError(
            405,
            f"method {self.command} not allowed on {path[:200]}; allowed: {allowed}",
            close=True,
            headers={"Allow": allowed},
        )

    # --- answers ----------------------------------------------------------------------------------
    def _send(
        self, status: int, body: dict[str, Any], headers: dict[str, str] | None = None
    ) -> None:
        data = encode_json(body)
        limits = self.server.limits
        if len(data) >= limits.bytes_per_token:
            cost = len(data) / limits.bytes_per_token
            self.bucket.charge(cost)
            self.server.rates.charge(self.address, self.authenticated, cost)
        self._send_raw(status, data, "application/json", headers)

    def _send_raw(
        self, status: int, data: bytes, content_type: str, headers: dict[str, str] | None = None
    ) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        if self.close_connection:
            self.send_header("Connection", "close")
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)

    # --- GET --------------------------------------------------------------------------------------
    def get_state(self) -> None:
        cursor = parse_cursor(parse_query(self.path, ("cursor",)))
        self._send(200, self.server.target.api_state(cursor))

    def get_steps(self) -> None:
        cursor = parse_cursor(parse_query(self.path, ("cursor",)))
        self._send(200, self.server.target.api_steps(cursor or 0))

    def get_inflight(self) -> None:
        limit = parse_limit(parse_query(self.path, ("limit",)))
        self._send(200, self._optional().api_inflight(limit))

    def get_settings(self) -> None:
        parse_query(self.path, ())
        doc = self.server.target.api_settings()
        self._send(200, doc, {"ETag": str(doc["version"])})

    def get_health(self) -> None:
        parse_query(self.path, ())
        self._send(200, {"ok": True})

    def get_metrics(self) -> None:
        parse_query(self.path, ())
        data, content_type = self._optional().api_metrics()
        self._send_raw(200, data, content_type)

    def get_models(self) -> None:
        parse_query(self.path, ())
        self._send(200, self._optional().api_models())

    def get_server_health(self) -> None:
        """vLLM's ``GET /health``: an empty 200, or 503 when the target is unhealthy."""
        parse_query(self.path, ())
        self._send_raw(200 if self._optional().api_health() else 503, b"", "text/plain")

    def _optional(self) -> OptionalEndpoints:
        """The target as one defining the optional endpoint being answered (its route exists only
        then)."""
        return cast(OptionalEndpoints, self.server.target)

    # --- PUT --------------------------------------------------------------------------------------
    def put_settings(self) -> None:
        parse_query(self.path, ())
        self._authorize()
        version = parse_if_match(self.headers)
        try:
            lease = parse_lease_header(self.headers.get(LEASE_HEADER))
        except ValueError as err:
            raise HTTPError(400, f"{LEASE_HEADER}: {err}") from None
        doc = read_settings_document(self.headers, self.reader, self.server.limits)
        try:
            result = self.server.target.api_put_settings(doc, version, lease)
        except (SettingsConflict, LeaseConflict) as err:
            raise HTTPError(409, str(err)) from None
        except (ValidationError, ValueError, TypeError) as err:
            raise HTTPError(400, describe_error(err)) from None
        self._send(200, result, {"ETag": str(result["version"])})

    def put_lease(self) -> None:
        """Take, renew or (``ttl_s`` 0) release a controller's lease (scheduler.plugin.lease)."""
        parse_query(self.path, ())
        self._authorize()
        doc = read_settings_document(self.headers, self.reader, self.server.limits)
        try:
            result = self._optional().api_lease(doc)
        except LeaseConflict as err:
            raise HTTPError(409, str(err)) from None
        except ValueError as err:
            raise HTTPError(400, str(err)) from None
        self._send(200, result)

    def _bearer(self) -> str | None:
        """The credentials of ``Authorization: Bearer <token>``, the scheme in any case (RFC 7235).

        Headers arrive as latin-1 text; the caller compares their bytes in constant time."""
        scheme, _, given = self.headers.get("Authorization", "").strip().partition(" ")
        return (given.strip() or None) if scheme.lower() == "bearer" else None

    def _authorize(self) -> None:
        """Decided from the headers alone (``parse_request`` compared the token): an unauthorised
        body is never read."""
        if self.server.token is None:
            raise HTTPError(
                403,
                "writes are disabled: no token configured on this replica "
                f"(set {TOKEN_ENV} or {TOKEN_FILE_ENV})",
                close=True,
            )
        if self._bearer() is None:
            raise HTTPError(401, "missing bearer token (Authorization: Bearer <token>)", close=True)
        if not self.authenticated:
            raise HTTPError(401, "wrong bearer token", close=True)


@dataclass(frozen=True, slots=True)
class Route:
    """One endpoint's answer for one method, and the target method without which it does not
    exist."""

    answer: Callable[[ControlHandler], None]
    needs: str | None = None  # an ``OptionalEndpoints`` method

    def served_by(self, target: ControlTarget) -> bool:
        return self.needs is None or hasattr(target, self.needs)


# (method, path) → its answer. A path's methods in the order ``Allow`` lists them (405).
ROUTES: dict[tuple[str, str], Route] = {
    ("GET", f"{PREFIX}/state"): Route(ControlHandler.get_state),
    ("GET", f"{PREFIX}/settings"): Route(ControlHandler.get_settings),
    ("PUT", f"{PREFIX}/settings"): Route(ControlHandler.put_settings),
    ("PUT", f"{PREFIX}/lease"): Route(ControlHandler.put_lease, needs="api_lease"),
    ("GET", f"{PREFIX}/steps"): Route(ControlHandler.get_steps),
    ("GET", f"{PREFIX}/health"): Route(ControlHandler.get_health),
    # A replica's in-flight listing (the plugin and the twins; not the recorder's metrics page).
    ("GET", f"{PREFIX}/inflight"): Route(ControlHandler.get_inflight, needs="api_inflight"),
    # A twin playing a vLLM server; the recorder's metrics page.
    ("GET", "/metrics"): Route(ControlHandler.get_metrics, needs="api_metrics"),
    ("GET", "/v1/models"): Route(ControlHandler.get_models, needs="api_models"),
    ("GET", "/health"): Route(ControlHandler.get_server_health, needs="api_health"),
}


def _allowed(path: str, target: ControlTarget) -> str | None:
    """The methods ``path`` answers on ``target`` (405's ``Allow``), None for no such endpoint."""
    methods = [
        method
        for (method, route_path), route in ROUTES.items()
        if route_path == path and route.served_by(target)
    ]
    return ", ".join(methods) or None


class ControlServer:
    """The HTTP server on a daemon thread; ``port=0`` picks a free port."""

    def __init__(
        self,
        target: ControlTarget,
        host: str = "127.0.0.1",
        port: int = DEFAULT_PORT,
        token: str | None = None,
        limits: Limits | None = None,
    ) -> None:
        self.limits = limits or Limits()
        token = (token or "").strip() or None
        if token is None:
            log.warning(
                "tailpilot control API: no token configured (%s / %s): settings writes are refused",
                TOKEN_ENV,
                TOKEN_FILE_ENV,
            )
            self.limits = dataclasses.replace(
                self.limits, token_reserve=0.0
            )  # nobody could use the reserve
        self.httpd = ControlHTTPServer((host, port), target, token, self.limits)
        self.thread = threading.Thread(
            target=self.httpd.serve_forever, name="tailpilot-control", daemon=True
        )
        self.reaper = threading.Thread(
            target=self.httpd.reap_forever, name="tailpilot-control-reaper", daemon=True
        )

    @property
    def port(self) -> int:
        return self.httpd.server_address[1]

    @property
    def base_url(self) -> str:
        """``http://host:port``: where ``/metrics`` and ``/v1/models`` live on a vLLM-like
        target."""
        host = self.httpd.server_address[0]
        if isinstance(host, bytes):  # an AF_UNIX-style address; never for TCP, which this serves
            host = host.decode()
        return f"http://{host}:{self.port}"

    @property
    def url(self) -> str:
        return f"{self.base_url}{PREFIX}"

    def start(self) -> ControlServer:
        self.thread.start()
        self.reaper.start()
        return self

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self.httpd.close_open_connections()

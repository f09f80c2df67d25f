"""The replica control API (docs/control-api.md), served on a daemon thread next to the scheduler.

    GET /tailpilot/v1/state[?cursor=N]   queue, KV, live γ/β, counters; with a cursor also the
                                         completions since N (at most a page; ``more``, ``next_cursor``)
    GET /tailpilot/v1/settings           the active (or staged) settings document and its version
    PUT /tailpilot/v1/settings           validate + stage a document; If-Match: <version> for CAS
    GET /tailpilot/v1/steps?cursor=N     the step log (duration and batch composition per step), paged
    GET /tailpilot/v1/inflight[?limit=N] the oldest requests in flight (no output lengths), at most 1,000
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
500 (logged once per kind, briefly). Only standard-library parts: nothing heavy enters vLLM's process.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hmac
import http.client
import json
import logging
import math
import re
import socket
import threading
import time
from collections import Counter, OrderedDict, deque
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable, Protocol
from urllib.parse import parse_qs, urlsplit

import pydantic_core  # pydantic's own core (Rust): strict JSON without a hand-written encoder
from pydantic import ValidationError

from scheduler.contract import INFLIGHT_LIMIT
from scheduler.plugin.core import SettingsConflict
from scheduler.plugin.env import DEFAULT_PORT, HOST_ENV, PORT_ENV, TOKEN_ENV, TOKEN_FILE_ENV, PluginEnv  # noqa: F401 (re-exported)
from scheduler.settings import describe_error

PREFIX = "/tailpilot/v1"
log = logging.getLogger("tailpilot.control")

_DIGITS = re.compile(r"[0-9]{1,18}", re.ASCII)  # cursors, versions, lengths: ASCII digits, < 2**63
_VERSION = re.compile(r'"?([0-9]{1,18})"?', re.ASCII)  # If-Match, bare or as an ETag
LINGER_S = 0.5  # at most this long reading what a refused client still sends before closing
LINGER_BYTES = 64 * 1024  # what a refused connection may have sent already, read before closing
# Endpoints served only when the target defines the method: a replica's in-flight listing (the
# plugin and the twins; not the recorder's metrics page), and a twin playing a vLLM server.
_TARGET_PATHS = ((f"{PREFIX}/inflight", "api_inflight"), ("/metrics", "api_metrics"), ("/v1/models", "api_models"),
                 ("/health", "api_health"))


@dataclass(frozen=True, slots=True)
class Limits:
    """What one control server may cost its host process, and how it is shared out.

    A request is a token holder's when it carries ``Authorization: Bearer <token>`` with this
    replica's token (checked from the headers, reads included); any other is anonymous.
    ``token_reserve`` of ``max_connections`` and of ``rate_total`` is kept for token holders:
    anonymous connections may hold at most ``anonymous_connections`` slots and anonymous requests
    share ``rate_anonymous`` requests/s, each client address at most ``rate_per_address`` of it.
    """

    max_connections: int = 32  # concurrent; more get an immediate 503 from the accept thread
    backlog: int = 128  # listen queue: a burst of pollers waits in the kernel, not in a reset
    max_body: int = 64 * 1024  # a settings document is ~1 KiB
    max_header_bytes: int = 16 * 1024  # request line + headers
    request_timeout_s: float = 10.0  # from a request's first line to the last byte of its answer
    first_request_s: float = 5.0  # a new connection must send its request line within this
    idle_timeout_s: float = 30.0  # a keep-alive connection idle longer is closed
    rate_per_connection: float = 20.0  # requests/s, with a burst of the same size
    rate_total: float = 200.0  # requests/s over all connections, with a burst of the same size
    # Kept for token holders (a collector keeps up to 4 connections per replica: 8 slots serve two
    # of them; 50 requests/s are 50 times a collector's 1 Hz poll).
    token_reserve: float = 0.25
    # Anonymous requests/s from one client address (burst the same): what one connection gets, so
    # opening more connections or reconnecting buys an unauthenticated client nothing.
    rate_per_address: float = 20.0
    max_addresses: int = 1024  # client addresses whose rate is remembered; the least recent is forgotten
    # An unauthenticated connection idle (or silent since accepted) this long may be closed early
    # to make room; a younger one is left alone, so a fresh connection can send its request.
    evict_idle_s: float = 1.0
    max_penalty_s: float = 1.0  # a rate-limited request waits up to this long before its 429
    # A refused connection gets its 503 after about max_penalty_s, held without a thread (a socket
    # each), so a client retrying in a loop costs a refusal a second, not thousands; more are
    # answered at once.
    max_parked: int = 128
    # A large answer costs its serialisation: one more request's worth per this many bytes, so a
    # client re-reading full pages gets proportionally fewer of them (a page of 1,000 completions
    # is ~340 KB: ~6 requests' worth).
    bytes_per_token: int = 64 * 1024
    grace_s: float = 1.0  # after a deadline cuts a connection's input, until it is closed both ways
    clock: Callable[[], float] = field(default=time.monotonic, compare=False)  # rates and idle ages

    def __post_init__(self) -> None:
        if not 0.0 <= self.token_reserve < 1.0:
            raise ValueError(f"Limits.token_reserve: expected a share in [0, 1), got {self.token_reserve!r}")
        if self.max_connections < 1 or self.max_addresses < 1:
            raise ValueError("Limits.max_connections and Limits.max_addresses: expected at least 1")

    @property
    def reserved_connections(self) -> int:
        """Connection slots anonymous connections may not hold (8 of 32)."""
        return int(self.max_connections * self.token_reserve)

    @property
    def anonymous_connections(self) -> int:
        """Connection slots anonymous connections may hold at once (24 of 32)."""
        return self.max_connections - self.reserved_connections

    @property
    def rate_anonymous(self) -> float:
        """Requests/s all anonymous requests share (150 of 200)."""
        return self.rate_total * (1.0 - self.token_reserve)


def token_from_env(env: PluginEnv | None = None) -> str | None:
    """The write token; an empty or whitespace-only one is no token (writes stay refused)."""
    env = env or PluginEnv.read()
    token = env.token
    if not token and (path := env.token_file):
        try:
            token = path.read_text(encoding="utf-8").strip()
        except (OSError, UnicodeDecodeError) as err:
            log.warning("tailpilot control API: cannot read %s=%s (%s): writes are disabled",
                        TOKEN_FILE_ENV, path, type(err).__name__)
            return None
    return token or None


class ControlTarget(Protocol):
    def api_state(self, cursor: int | None) -> dict[str, Any]: ...
    def api_settings(self) -> dict[str, Any]: ...
    def api_put_settings(self, doc: dict[str, Any], if_match: int | None) -> dict[str, Any]: ...
    def api_steps(self, cursor: int) -> dict[str, Any]: ...


class HTTPError(Exception):
    """Answer ``status`` with ``message``; ``close`` when unread bytes make the connection unusable."""

    def __init__(self, status: int, message: str, *, close: bool = False, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.close, self.headers = status, close, headers or {}


class TokenBucket:
    """``rate`` tokens per second up to ``rate`` banked; ``take`` returns 0 or the wait for a token."""

    __slots__ = ("rate", "tokens", "stamp", "clock")

    def __init__(self, rate: float, clock: Callable[[], float]) -> None:
        self.rate, self.tokens, self.clock = rate, rate, clock
        self.stamp = clock()

    def charge(self, tokens: float) -> None:
        """Take ``tokens`` more for work already done: into debt, at most a second's worth (so a
        well-behaved reader paging through a backlog waits briefly, never long)."""
        self.tokens = max(self.tokens - tokens, -self.rate)

    def take(self) -> float:
        now = self.clock()
        self.tokens = min(self.rate, self.tokens + (now - self.stamp) * self.rate)
        self.stamp = now
        if self.tokens >= 1.0:
            self.tokens -= 1.0
            return 0.0
        return (1.0 - self.tokens) / self.rate


def _reject_constant(name: str) -> Any:
    raise ValueError(f"non-finite number {name} (JSON has no NaN or Infinity)")


def _reject_big_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"number {text[:40]} is out of range")
    return value


def parse_json_body(body: bytes) -> Any:
    """Strict JSON: UTF-8, finite numbers, bounded nesting; ValueError naming the problem."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as err:
        raise ValueError(f"body: not UTF-8 (byte {err.start})") from None
    try:
        return json.loads(text, parse_constant=_reject_constant, parse_float=_reject_big_float)
    except RecursionError:
        raise ValueError("body: JSON nested too deeply") from None
    except json.JSONDecodeError as err:
        raise ValueError(f"body: not JSON ({err})") from None
    except ValueError as err:
        raise ValueError(f"body: {err}") from None


def encode_json(doc: Any) -> bytes:
    """Strict JSON out (NaN/Infinity as null): readers such as PostgreSQL's jsonb refuse them."""
    return pydantic_core.to_json(doc, inf_nan_mode="null", fallback=float)  # fallback: numpy scalars


class _Reader:
    """A connection's input with a byte budget for each request's line and headers."""

    def __init__(self, raw, budget: int) -> None:
        self.raw, self.budget, self.left = raw, budget, budget

    def new_request(self) -> None:
        self.left = self.budget

    def readline(self, size: int = -1) -> bytes:
        if self.left <= 0:
            raise http.client.LineTooLong("request line and headers over the size limit")
        line = self.raw.readline(self.left if size < 0 else min(size, self.left))
        self.left -= len(line)
        return line

    def read(self, size: int = -1) -> bytes:
        return self.raw.read(size)

    def close(self) -> None:
        self.raw.close()


def _make_handler(target: ControlTarget, token: str | None, limits: Limits):
    token_bytes = token.encode() if token else None

    class Handler(BaseHTTPRequestHandler):
        server_version = "tailpilot-control/1"
        protocol_version = "HTTP/1.1"
        # Headers and body go out in separate writes: with Nagle's algorithm the body waits for
        # the client's delayed ACK (~40 ms per request on Linux).
        disable_nagle_algorithm = True
        timeout = limits.request_timeout_s  # per socket operation; the reaper bounds the total
        server: "_HTTPServer"

        def setup(self) -> None:
            super().setup()
            self.rfile = _Reader(self.rfile, limits.max_header_bytes)  # type: ignore[assignment]
            self.bucket = TokenBucket(limits.rate_per_connection, limits.clock)
            self.address = str(self.client_address[0])  # whose per-address budget anonymous requests draw on
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
                    while drained < limits.max_body and (chunk := self.request.recv(16384)):
                        drained += len(chunk)

        def log_message(self, fmt, *args):  # quiet: the engine's log is not ours to flood
            pass

        # --- the request cycle ------------------------------------------------------------
        def handle_one_request(self) -> None:
            self.rfile.new_request()  # type: ignore[attr-defined]  # our _Reader (setup)
            self.command, self.requestline, self.request_version = "", "", self.default_request_version
            try:
                super().handle_one_request()
            except http.client.LineTooLong as err:
                self.close_connection = True
                self.send_error(431, str(err))
            self.server.end_request(self.request, keep_alive=not self.close_connection)

        def parse_request(self) -> bool:
            # The request line is in: the rest of this request has ``request_timeout_s``.
            self.server.set_deadline(self.request, limits.request_timeout_s)
            if not super().parse_request():
                return False
            if self.request_version == "HTTP/0.9":  # no headers, no status line: nothing to answer with
                self.send_error(400, "HTTP/0.9 requests are not supported")
                return False
            lengths = self.headers.get_all("Content-Length") or []
            if len(lengths) > 1:  # which one frames the body is ambiguous: the rest could be a smuggled request
                shown = ", ".join(repr(v[:20]) for v in lengths[:4])
                self.send_error(400, f"Content-Length: given {len(lengths)} times ({shown}); send it once")
                return False
            given = self._bearer()  # compared as bytes, in constant time whatever was sent
            self.authenticated = given is not None and token_bytes is not None and hmac.compare_digest(
                given.encode("latin-1", "replace"), token_bytes)
            refusal = self.server.begin_request(self.request, self.authenticated)
            if refusal is None:
                return True
            self.close_connection = True
            if refusal is _CLOSED_EARLY:  # closed to make room while its request arrived: nobody to answer
                return False
            if self._has_body():  # unread input: answer now and drain it (closing later would reset it)
                self.linger = True
                with contextlib.suppress(OSError):
                    self._send(503, {"error": refusal, "status": 503}, {"Retry-After": "1"})
            else:  # the server answers after the pause, without this thread
                self.server.refuse_on_close(self.request, refusal)
            return False

        def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
            """http.server's own errors (bad request line, headers, method) as JSON, connection closed."""
            self.close_connection = self.linger = True
            self.request_version = "HTTP/1.1"  # an HTTP/0.9-looking request line still gets a status line
            with contextlib.suppress(OSError):
                self._send(code, {"error": message or explain or "bad request", "status": code})

        def _dispatch(self, handler: Callable[[], None]) -> None:
            try:
                # The shared budgets only for requests this connection's own budget lets through.
                wait = self.bucket.take() or self.server.take(self.address, self.authenticated)
                if wait > 0:
                    # No GIL held while asleep: the engine runs on. An anonymous client waits the
                    # whole pause, so one that ignores Retry-After costs a request per pause, not
                    # one per refill of its budget.
                    time.sleep(min(wait, limits.max_penalty_s) if self.authenticated else limits.max_penalty_s)
                    raise HTTPError(429, "too many requests: slow down", headers={
                        "Retry-After": str(max(1, math.ceil(wait)))})
                handler()
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

        def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
            self._dispatch(self._get)

        def do_PUT(self) -> None:  # noqa: N802
            self._dispatch(self._put)

        def do_HEAD(self) -> None:  # noqa: N802
            self._dispatch(self._not_allowed)

        do_POST = do_DELETE = do_PATCH = do_OPTIONS = do_HEAD  # noqa: N815

        # --- answers ----------------------------------------------------------------------
        def _send(self, status: int, body: dict[str, Any], headers: dict[str, str] | None = None) -> None:
            data = encode_json(body)
            if len(data) >= limits.bytes_per_token:
                cost = len(data) / limits.bytes_per_token
                self.bucket.charge(cost)
                self.server.charge(self.address, self.authenticated, cost)
            self._send_raw(status, data, "application/json", headers)

        def _send_raw(self, status: int, data: bytes, content_type: str,
                      headers: dict[str, str] | None = None) -> None:
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

        # --- GET ----------------------------------------------------------------------------
        def _query(self, allowed: tuple[str, ...]) -> dict[str, str]:
            url = urlsplit(self.path)
            if not url.query:
                return {}
            try:
                query = parse_qs(url.query, keep_blank_values=True, strict_parsing=True,
                                 max_num_fields=len(allowed) + 1)
            except ValueError as err:
                raise HTTPError(400, f"query: {err}") from None
            for name, values in query.items():
                if name not in allowed:
                    raise HTTPError(400, f"query: unknown parameter {name!r} (known: {', '.join(allowed) or 'none'})")
                if len(values) > 1:
                    raise HTTPError(400, f"query: {name} given {len(values)} times")
            return {name: values[0] for name, values in query.items()}

        def _cursor(self, query: dict[str, str]) -> int | None:
            raw = query.get("cursor")
            if raw is None:
                return None
            if not _DIGITS.fullmatch(raw):
                raise HTTPError(400, f"cursor: expected a non-negative integer, got {raw[:40]!r}")
            return int(raw)

        def _limit(self, query: dict[str, str]) -> int:
            raw = query.get("limit")
            if raw is None:
                return INFLIGHT_LIMIT
            if not _DIGITS.fullmatch(raw) or not 1 <= int(raw) <= INFLIGHT_LIMIT:
                raise HTTPError(400, f"limit: expected an integer from 1 to {INFLIGHT_LIMIT}, got {raw[:40]!r}")
            return int(raw)

        def _has_body(self) -> bool:
            return self.headers.get("Content-Length", "0").strip() not in ("", "0") or \
                bool(self.headers.get("Transfer-Encoding"))

        def _refuse_body(self) -> None:
            """A GET with a body: we do not read it, so the connection cannot carry another request."""
            if self._has_body():
                self.close_connection = True

        def _allowed(self, path: str) -> str | None:
            """The methods ``path`` answers (for 405's ``Allow``), None for no such endpoint."""
            if path == f"{PREFIX}/settings":
                return "GET, PUT"
            if path in (f"{PREFIX}/state", f"{PREFIX}/steps", f"{PREFIX}/health") or any(
                    path == p and hasattr(target, attr) for p, attr in _TARGET_PATHS):
                return "GET"
            return None

        def _not_allowed(self) -> None:
            path = urlsplit(self.path).path
            allowed = self._allowed(path)
            if allowed is None:
                raise HTTPError(404, f"no such endpoint: {path[:200]}", close=True)
            raise HTTPError(405, f"method {self.command} not allowed on {path[:200]}; allowed: {allowed}",
                            close=True, headers={"Allow": allowed})

        def _get(self) -> None:
            self._refuse_body()
            path = urlsplit(self.path).path
            if path == f"{PREFIX}/state":
                return self._send(200, target.api_state(self._cursor(self._query(("cursor",)))))
            if path == f"{PREFIX}/steps":
                return self._send(200, target.api_steps(self._cursor(self._query(("cursor",))) or 0))
            if path == f"{PREFIX}/inflight" and hasattr(target, "api_inflight"):
                return self._send(200, target.api_inflight(self._limit(self._query(("limit",)))))
            self._query(())
            if path == f"{PREFIX}/settings":
                doc = target.api_settings()
                return self._send(200, doc, {"ETag": str(doc["version"])})
            if path == f"{PREFIX}/health":
                return self._send(200, {"ok": True})
            if path == "/metrics" and hasattr(target, "api_metrics"):
                data, content_type = target.api_metrics()
                return self._send_raw(200, data, content_type)
            if path == "/v1/models" and hasattr(target, "api_models"):
                return self._send(200, target.api_models())
            if path == "/health" and hasattr(target, "api_health"):
                return self._send_raw(200 if target.api_health() else 503, b"", "text/plain")
            raise HTTPError(404, f"no such endpoint: {path[:200]}")

        # --- PUT ----------------------------------------------------------------------------
        def _bearer(self) -> str | None:
            """The credentials of ``Authorization: Bearer <token>``, the scheme in any case (RFC 7235).

            Headers arrive as latin-1 text; the caller compares their bytes in constant time."""
            scheme, _, given = self.headers.get("Authorization", "").strip().partition(" ")
            return (given.strip() or None) if scheme.lower() == "bearer" else None

        def _authorize(self) -> None:
            """Decided from the headers alone (``parse_request`` compared the token): an unauthorised
            body is never read."""
            if token_bytes is None:
                raise HTTPError(403, "writes are disabled: no token configured on this replica "
                                     f"(set {TOKEN_ENV} or {TOKEN_FILE_ENV})", close=True)
            if self._bearer() is None:
                raise HTTPError(401, "missing bearer token (Authorization: Bearer <token>)", close=True)
            if not self.authenticated:
                raise HTTPError(401, "wrong bearer token", close=True)

        def _body(self) -> bytes:
            if self.headers.get("Transfer-Encoding"):
                raise HTTPError(411, "Transfer-Encoding is not accepted: send Content-Length", close=True)
            raw = self.headers.get("Content-Length")
            if raw is None:
                raise HTTPError(411, "Content-Length: required", close=True)
            if not _DIGITS.fullmatch(raw.strip()):
                raise HTTPError(400, f"Content-Length: expected a byte count, got {raw[:40]!r}", close=True)
            length = int(raw)
            if length > limits.max_body:
                raise HTTPError(413, f"body: {length} bytes, over the limit of {limits.max_body}", close=True)
            try:
                body = self.rfile.read(length)
            except TimeoutError:
                raise HTTPError(408, f"body: not received within {limits.request_timeout_s:g} s", close=True) from None
            if len(body) < length:  # the client closed, or the reaper cut a trickle off
                raise HTTPError(408, f"body: {len(body)} of {length} bytes arrived in time", close=True)
            return body

        def _put(self) -> None:
            if urlsplit(self.path).path != f"{PREFIX}/settings":
                self._not_allowed()
            self._query(())
            self._authorize()
            if_match = self.headers.get("If-Match")
            version = None
            if if_match is not None:
                m = _VERSION.fullmatch(if_match.strip())
                if m is None:
                    raise HTTPError(400, f"If-Match: expected a settings version number, got {if_match[:40]!r}",
                                    close=True)
                version = int(m.group(1))
            body = self._body()
            try:
                doc = parse_json_body(body)
            except ValueError as err:
                raise HTTPError(400, str(err)) from None
            if not isinstance(doc, dict):
                raise HTTPError(400, f"body: expected a settings object, got {type(doc).__name__}")
            try:
                result = target.api_put_settings(doc, version)
            except SettingsConflict as err:
                raise HTTPError(409, str(err)) from None
            except (ValidationError, ValueError, TypeError) as err:
                raise HTTPError(400, describe_error(err)) from None
            self._send(200, result, {"ETag": str(result["version"])})

    return Handler


# What the server knows a connection by: new until its first request's headers are in, then the
# kind of its last request (anonymous, or carrying this replica's token).
NEW, ANONYMOUS, TOKEN = "new", "anonymous", "token"
_CLOSED_EARLY = "closed early to make room"  # begin_request's answer for a connection being closed


def _refusal(message: str) -> bytes:
    """A whole 503 answer that closes the connection, to send without a handler."""
    body = encode_json({"error": message, "status": 503})
    return (b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nConnection: close\r\n"
            b"Retry-After: 1\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))


@dataclass(slots=True)
class _Conn:
    """One open connection as the server sees it (read and written under the server's lock)."""

    deadline: float  # time.monotonic() past which the reaper cuts it off
    idle_since: float  # Limits.clock() when it last began waiting for a request line
    kind: str = NEW
    busy: bool = False  # from its request's headers to the end of its answer
    closing: bool = False  # closed early to make room; its thread is finishing


class _HTTPServer(ThreadingHTTPServer):
    """Counts, sorts and times connections. Over the cap a connection is answered 503 and closed
    without a thread, unless an unauthenticated connection has been idle long enough to be closed
    early for it (the idlest first); anonymous connections may hold only their share of the slots.
    A reaper closes connections past their deadline; ``stop`` closes keep-alive ones, so a stopped
    server looks down to a client holding a pooled connection. Every decision is constant work: the
    idle unauthenticated connections wait in two queues ordered by idle time."""

    daemon_threads = True
    BUSY = _refusal("too many connections to the control API")

    def __init__(self, address, handler, limits: Limits) -> None:
        self.request_queue_size = limits.backlog
        self.limits = limits
        # Shared by the handler threads, under _rate_lock: every request draws on ``total``;
        # anonymous ones also on ``anonymous`` and on their address's bucket.
        self.total = TokenBucket(limits.rate_total, limits.clock)
        self.anonymous = TokenBucket(limits.rate_anonymous, limits.clock)
        self._addresses: OrderedDict[str, TokenBucket] = OrderedDict()  # least recently seen first
        self._rate_lock = threading.Lock()
        self._conns: dict[socket.socket, _Conn] = {}
        self._idle_new: OrderedDict[socket.socket, None] = OrderedDict()  # silent since accepted, oldest first
        self._idle_anonymous: OrderedDict[socket.socket, None] = OrderedDict()  # between requests, idlest first
        self._anonymous = 0  # connections whose last request was anonymous
        self._closing = 0  # closed early, their threads finishing: at most max_closing at once
        self._max_closing = max(1, limits.reserved_connections)
        self._cut: set[socket.socket] = set()  # connections whose input the reaper has shut
        self._refusing: dict[socket.socket, bytes] = {}  # handlers done: refuse instead of closing
        self._parked: deque[tuple[float, socket.socket, bytes]] = deque()  # (due, socket, answer), due first
        self._lock = threading.Lock()
        self._failures: dict[str, int] = {}
        self._stop = threading.Event()
        super().__init__(address, handler)

    # --- admission ------------------------------------------------------------------------------
    def process_request(self, request, client_address) -> None:
        now, victim = self.limits.clock(), None
        with self._lock:
            admitted = len(self._conns) - self._closing < self.limits.max_connections
            if not admitted and self._closing < self._max_closing:
                victim = self._close_idlest(now, self._idle_anonymous, self._idle_new)
                admitted = victim is not None
            if admitted:
                self._conns[request] = _Conn(time.monotonic() + self.limits.first_request_s, now)
                self._idle_new[request] = None
        if victim is not None:
            self._shut(victim)
        if not admitted:
            self._refuse(request, self.BUSY)
            return
        super().process_request(request, client_address)

    def refuse_on_close(self, request, message: str) -> None:
        """When its handler is done, answer ``request`` 503 with ``message`` instead of closing it."""
        answer = _refusal(message)
        with self._lock:
            self._refusing[request] = answer

    def _refuse(self, request, answer: bytes) -> None:
        """Answer ``answer`` and close: after the pause from the reaper thread, or at once when
        there is no pause or the parking lot is full."""
        with self._lock:
            park = self.limits.max_penalty_s > 0 and len(self._parked) < self.limits.max_parked
            if park:
                self._parked.append((self.limits.clock() + self.limits.max_penalty_s, request, answer))
        if not park:
            self._answer_and_close(request, answer)

    def release_parked(self) -> int:
        """Answer and close the parked connections whose pause is over; how many."""
        now, due = self.limits.clock(), []
        with self._lock:
            while self._parked and self._parked[0][0] <= now:
                due.append(self._parked.popleft())
        for _, request, answer in due:
            self._answer_and_close(request, answer)
        return len(due)

    def _answer_and_close(self, request, answer: bytes) -> None:
        with contextlib.suppress(OSError):
            request.setblocking(False)  # never wait on a client from the accept or reaper thread
            with contextlib.suppress(BlockingIOError):  # what it sent already: unread, it would reset the answer
                request.recv(LINGER_BYTES)
            request.send(answer)
        super().shutdown_request(request)

    def begin_request(self, request, token: bool) -> str | None:
        """A request's headers are in: None to serve it, else why it is refused (the connection is
        then closed). An anonymous request on a connection not yet counted as anonymous needs an
        anonymous slot: a free one, or the idlest idle anonymous connection's, closed early."""
        now, victim = self.limits.clock(), None
        with self._lock:
            conn = self._conns.get(request)
            if conn is None or conn.closing:
                return _CLOSED_EARLY
            self._idle_new.pop(request, None)
            self._idle_anonymous.pop(request, None)
            conn.busy = True
            conn.deadline = time.monotonic() + self.limits.request_timeout_s
            if token:
                self._anonymous -= conn.kind == ANONYMOUS
                conn.kind = TOKEN
            elif conn.kind != ANONYMOUS:
                if self._anonymous >= self.limits.anonymous_connections:
                    if self._closing < self._max_closing:
                        victim = self._close_idlest(now, self._idle_anonymous)
                    if victim is None:
                        return ("too many unauthenticated connections to the control API "
                                f"({self.limits.reserved_connections} of {self.limits.max_connections} "
                                "are kept for requests with the bearer token)")
                conn.kind = ANONYMOUS
                self._anonymous += 1
        if victim is not None:
            self._shut(victim)
        return None

    def end_request(self, request, keep_alive: bool) -> None:
        """A request is answered (or its connection is leaving): idle until the next one."""
        with self._lock:
            conn = self._conns.get(request)
            if conn is None or conn.closing:
                return
            conn.deadline = time.monotonic() + self.limits.idle_timeout_s
            if conn.busy and keep_alive:
                conn.busy = False
                conn.idle_since = self.limits.clock()
                if conn.kind == ANONYMOUS:
                    self._idle_anonymous[request] = None  # the idlest stay first

    def _close_idlest(self, now: float, *queues: OrderedDict) -> socket.socket | None:
        """Under the lock: mark the idlest connection at the head of ``queues`` as closing, if it
        has been idle at least ``evict_idle_s``; the caller shuts it outside the lock."""
        heads = [next(iter(queue)) for queue in queues if queue]
        if not heads:
            return None
        request = min(heads, key=lambda r: self._conns[r].idle_since)
        conn = self._conns[request]
        if now - conn.idle_since < self.limits.evict_idle_s:
            return None
        self._leave_counts(request, conn)
        conn.closing = True
        self._closing += 1
        return request

    def _leave_counts(self, request, conn: _Conn) -> None:
        """Under the lock: a connection closing (early, or for good) leaves the idle queues and
        the count of anonymous connections."""
        self._idle_new.pop(request, None)
        self._idle_anonymous.pop(request, None)
        self._anonymous -= conn.kind == ANONYMOUS

    @staticmethod
    def _shut(request) -> None:
        # Its thread, waiting for a request line, reads end-of-file and finishes.
        with contextlib.suppress(OSError):
            request.shutdown(socket.SHUT_RDWR)

    def admission(self) -> dict[str, int]:
        """A snapshot of the connection table and the rate table: connections by kind, how many are
        closing early, how many refused ones wait for their answer, how many client addresses are
        remembered."""
        with self._lock:
            kinds = Counter(conn.kind for conn in self._conns.values() if not conn.closing)
            counts = {"connections": len(self._conns) - self._closing, "anonymous": self._anonymous,
                      "token": kinds[TOKEN], "new": kinds[NEW], "closing": self._closing, "parked": len(self._parked)}
        with self._rate_lock:
            counts["addresses"] = len(self._addresses)
        return counts

    # --- rates ------------------------------------------------------------------------------------
    def take(self, address: str, token: bool) -> float:
        """0 when the shared budgets let a request through (and it is counted), else the wait."""
        with self._rate_lock:
            if token:
                return self.total.take()
            return self._address_bucket(address).take() or self.anonymous.take() or self.total.take()

    def charge(self, address: str, token: bool, cost: float) -> None:
        """Charge a large answer's extra cost to the shared budgets it drew on."""
        with self._rate_lock:
            self.total.charge(cost)
            if not token:
                self.anonymous.charge(cost)
                self._address_bucket(address).charge(cost)

    def _address_bucket(self, address: str) -> TokenBucket:
        bucket = self._addresses.get(address)
        if bucket is not None:
            self._addresses.move_to_end(address)
            return bucket
        # Bounded: forgetting the least recent address only refills its budget; the anonymous
        # total still bounds what many addresses get together.
        if len(self._addresses) >= self.limits.max_addresses:
            self._addresses.popitem(last=False)
        bucket = self._addresses[address] = TokenBucket(self.limits.rate_per_address, self.limits.clock)
        return bucket

    # --- deadlines ----------------------------------------------------------------------------------
    def set_deadline(self, request, seconds: float) -> None:
        with self._lock:
            if (conn := self._conns.get(request)) is not None:
                conn.deadline = time.monotonic() + seconds

    def shutdown_request(self, request) -> None:
        with self._lock:
            conn = self._conns.pop(request, None)
            if conn is not None and conn.closing:
                self._closing -= 1
            elif conn is not None:
                self._leave_counts(request, conn)
            self._cut.discard(request)
            answer = self._refusing.pop(request, None)
        if answer is not None:
            self._refuse(request, answer)
        else:
            super().shutdown_request(request)

    def reap(self) -> int:
        """Cut off connections past their deadline (silent, trickling or not reading): first their
        input, so a handler waiting for bytes answers what it has; a grace period later, both ways,
        so one blocked writing to a client that does not read returns too. How many were cut."""
        now = time.monotonic()
        with self._lock:
            late = [(request, socket.SHUT_RDWR if request in self._cut else socket.SHUT_RD)
                    for request, conn in self._conns.items() if conn.deadline < now]
            for request, how in late:
                self._conns[request].deadline = now + self.limits.grace_s if how == socket.SHUT_RD else math.inf
                self._cut.add(request)
        for request, how in late:
            with contextlib.suppress(OSError):
                request.shutdown(how)
        return len(late)

    def reap_forever(self, interval_s: float = 0.5) -> None:
        while not self._stop.wait(interval_s):
            self.reap()
            self.release_parked()

    def close_open_connections(self) -> None:
        self._stop.set()
        with self._lock:
            requests, self._conns = list(self._conns), {}
            parked = [request for _, request, _ in self._parked]
            self._parked.clear()
            self._idle_new.clear()
            self._idle_anonymous.clear()
            self._anonymous = self._closing = 0
        for request in requests:
            with contextlib.suppress(OSError):
                request.shutdown(socket.SHUT_RDWR)
        for request in parked:  # no thread of theirs will close them
            with contextlib.suppress(OSError):
                request.close()

    def log_failure(self, err: BaseException) -> None:
        """One brief log line per kind of failure; later ones are only counted."""
        kind = type(err).__name__
        self._failures[kind] = self._failures.get(kind, 0) + 1
        if self._failures[kind] == 1:
            log.warning("tailpilot control API: request failed (%s: %s); later %s failures are counted, "
                        "not logged", kind, str(err)[:200], kind)

    def handle_error(self, request, client_address) -> None:
        # Failures inside a request are answered by the handler; what reaches here is a client
        # gone mid-request or a bug in the server itself: never a traceback in vLLM's log.
        import sys

        err = sys.exc_info()[1]
        if err is not None and not isinstance(err, (ConnectionError, TimeoutError)):
            self.log_failure(err)


class ControlServer:
    """The HTTP server on a daemon thread; ``port=0`` picks a free port."""

    def __init__(self, target: ControlTarget, host: str = "127.0.0.1", port: int = DEFAULT_PORT,
                 token: str | None = None, limits: Limits | None = None) -> None:
        self.limits = limits or Limits()
        token = (token or "").strip() or None
        if token is None:
            log.warning("tailpilot control API: no token configured (%s / %s): settings writes are refused",
                        TOKEN_ENV, TOKEN_FILE_ENV)
            self.limits = dataclasses.replace(self.limits, token_reserve=0.0)  # nobody could use the reserve
        self.httpd = _HTTPServer((host, port), _make_handler(target, token, self.limits), self.limits)
        self.thread = threading.Thread(target=self.httpd.serve_forever, name="tailpilot-control", daemon=True)
        self.reaper = threading.Thread(target=self.httpd.reap_forever, name="tailpilot-control-reaper", daemon=True)

    @property
    def port(self) -> int:
        return self.httpd.server_address[1]

    @property
    def base_url(self) -> str:
        """``http://host:port``: where ``/metrics`` and ``/v1/models`` live on a vLLM-like target."""
        host = self.httpd.server_address[0]
        if isinstance(host, bytes):  # an AF_UNIX-style address; never for TCP, which this serves
            host = host.decode()
        return f"http://{host}:{self.port}"

    @property
    def url(self) -> str:
        return f"{self.base_url}{PREFIX}"

    def start(self) -> "ControlServer":
        self.thread.start()
        self.reaper.start()
        return self

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self.httpd.close_open_connections()

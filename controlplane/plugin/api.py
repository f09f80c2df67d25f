"""The replica control API (docs/control-api.md), served on a daemon thread next to the scheduler.

    GET /tailpilot/v1/state[?cursor=N]   queue, KV, live γ/β, counters; with a cursor also the
                                         completions since N (at most a page; ``more``, ``next_cursor``)
    GET /tailpilot/v1/settings           the active (or staged) settings document and its version
    PUT /tailpilot/v1/settings           validate + stage a document; If-Match: <version> for CAS
    GET /tailpilot/v1/steps?cursor=N     the step log (duration and batch composition per step), paged
    GET /tailpilot/v1/health

A target that also plays a vLLM server (the simulated twin replicas) may define any of
``api_metrics() -> (body bytes, content type)``, ``api_models() -> dict`` and
``api_health() -> bool``; the server then also answers ``GET /metrics``, ``GET /v1/models`` and
``GET /health`` (200, or 503 when unhealthy) on the same port, as vLLM's API server does.

Loopback by default; writes need ``Authorization: Bearer <token>`` with the token from
``$TAILPILOT_TOKEN`` or the file named by ``$TAILPILOT_TOKEN_FILE``. Without a configured token
(unset, empty or whitespace) every write is refused: an operator must opt in to remote control.

This server lives in vLLM's engine-core process, so everything it does is bounded (``Limits``):
the token is checked from the headers before any body is read; a write must declare a
``Content-Length`` no larger than ``max_body``; request line and headers share a byte budget; a
connection that is silent, trickles or reads its answer too slowly is closed by a reaper thread;
connections over ``max_connections`` get an immediate 503; each connection (and all of them
together) is rate-limited, and a client over its rate gets 429 with ``Retry-After`` after a short
pause that costs the engine nothing (a sleeping thread does not hold the GIL). Every request gets
an HTTP answer: malformed ones a 4xx JSON error naming the problem, the server's own failures a
500 (logged once per kind, briefly). Only standard-library parts: nothing heavy enters vLLM's process.
"""

from __future__ import annotations

import contextlib
import hmac
import http.client
import json
import logging
import math
import re
import socket
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable, Protocol
from urllib.parse import parse_qs, urlsplit

import pydantic_core  # pydantic's own core (Rust): strict JSON without a hand-written encoder
from pydantic import ValidationError

from controlplane.plugin.core import SettingsConflict
from controlplane.plugin.env import DEFAULT_PORT, HOST_ENV, PORT_ENV, TOKEN_ENV, TOKEN_FILE_ENV, PluginEnv  # noqa: F401 (re-exported)
from controlplane.settings import describe_error

PREFIX = "/tailpilot/v1"
log = logging.getLogger("tailpilot.control")

_DIGITS = re.compile(r"[0-9]{1,18}", re.ASCII)  # cursors, versions, lengths: ASCII digits, < 2**63
_VERSION = re.compile(r'"?([0-9]{1,18})"?', re.ASCII)  # If-Match, bare or as an ETag
LINGER_S = 0.5  # at most this long reading what a refused client still sends before closing


@dataclass(frozen=True, slots=True)
class Limits:
    """What one control server may cost its host process."""

    max_connections: int = 32  # concurrent; more get an immediate 503 from the accept thread
    backlog: int = 128  # listen queue: a burst of pollers waits in the kernel, not in a reset
    max_body: int = 64 * 1024  # a settings document is ~1 KiB
    max_header_bytes: int = 16 * 1024  # request line + headers
    request_timeout_s: float = 10.0  # from a request's first line to the last byte of its answer
    first_request_s: float = 5.0  # a new connection must send its request line within this
    idle_timeout_s: float = 30.0  # a keep-alive connection idle longer is closed
    rate_per_connection: float = 20.0  # requests/s, with a burst of the same size
    rate_total: float = 200.0  # requests/s over all connections, with a burst of the same size
    max_penalty_s: float = 1.0  # a rate-limited request waits up to this long before its 429
    # A large answer costs its serialisation: one more request's worth per this many bytes, so a
    # client re-reading full pages gets proportionally fewer of them (a page of 1,000 completions
    # is ~340 KB: ~6 requests' worth).
    bytes_per_token: int = 64 * 1024
    grace_s: float = 1.0  # after a deadline cuts a connection's input, until it is closed both ways
    clock: Callable[[], float] = field(default=time.monotonic, compare=False)


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
            self.server.set_deadline(self.request, limits.idle_timeout_s)

        def parse_request(self) -> bool:
            # The request line is in: the rest of this request has ``request_timeout_s``.
            self.server.set_deadline(self.request, limits.request_timeout_s)
            if not super().parse_request():
                return False
            if self.request_version == "HTTP/0.9":  # no headers, no status line: nothing to answer with
                self.send_error(400, "HTTP/0.9 requests are not supported")
                return False
            return True

        def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
            """http.server's own errors (bad request line, headers, method) as JSON, connection closed."""
            self.close_connection = self.linger = True
            self.request_version = "HTTP/1.1"  # an HTTP/0.9-looking request line still gets a status line
            with contextlib.suppress(OSError):
                self._send(code, {"error": message or explain or "bad request", "status": code})

        def _dispatch(self, handler: Callable[[], None]) -> None:
            try:
                wait = self.bucket.take() or self.server.total.take()  # the total only for requests let through
                if wait > 0:
                    time.sleep(min(wait, limits.max_penalty_s))  # no GIL held: the engine runs on
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
            self.send_error(405, f"method HEAD not allowed on {urlsplit(self.path).path}")

        do_POST = do_DELETE = do_PATCH = do_OPTIONS = do_HEAD  # noqa: N815

        # --- answers ----------------------------------------------------------------------
        def _send(self, status: int, body: dict[str, Any], headers: dict[str, str] | None = None) -> None:
            data = encode_json(body)
            if len(data) >= limits.bytes_per_token:
                cost = len(data) / limits.bytes_per_token
                self.bucket.charge(cost)
                self.server.total.charge(cost)
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

        def _refuse_body(self) -> None:
            """A GET with a body: we do not read it, so the connection cannot carry another request."""
            if self.headers.get("Content-Length", "0").strip() not in ("", "0") or \
                    self.headers.get("Transfer-Encoding"):
                self.close_connection = True

        def _get(self) -> None:
            self._refuse_body()
            path = urlsplit(self.path).path
            if path == f"{PREFIX}/state":
                return self._send(200, target.api_state(self._cursor(self._query(("cursor",)))))
            if path == f"{PREFIX}/steps":
                return self._send(200, target.api_steps(self._cursor(self._query(("cursor",))) or 0))
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
        def _authorize(self) -> None:
            """Decided from the headers alone: an unauthorised body is never read."""
            if token_bytes is None:
                raise HTTPError(403, "writes are disabled: no token configured on this replica "
                                     f"(set {TOKEN_ENV} or {TOKEN_FILE_ENV})", close=True)
            auth = self.headers.get("Authorization", "")
            scheme, _, given = auth.partition(" ")
            if scheme != "Bearer" or not given.strip():
                raise HTTPError(401, "missing bearer token (Authorization: Bearer <token>)", close=True)
            # Headers arrive as latin-1 text; compare bytes so any input compares in constant time.
            if not hmac.compare_digest(given.strip().encode("latin-1", "replace"), token_bytes):
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
            path = urlsplit(self.path).path
            if path != f"{PREFIX}/settings":
                raise HTTPError(404, f"no such endpoint: {path[:200]}", close=True)
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


class _HTTPServer(ThreadingHTTPServer):
    """Counts and times connections: over the cap a connection is answered 503 and closed without
    a thread; a reaper closes connections past their deadline; ``stop`` closes keep-alive ones, so
    a stopped server looks down to a client holding a pooled connection."""

    daemon_threads = True
    _BUSY_BODY = b'{"error": "too many connections to the control API", "status": 503}'
    BUSY = (b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nConnection: close\r\n"
            b"Retry-After: 1\r\nContent-Length: %d\r\n\r\n%s" % (len(_BUSY_BODY), _BUSY_BODY))

    def __init__(self, address, handler, limits: Limits) -> None:
        self.request_queue_size = limits.backlog
        self.limits = limits
        self.total = TokenBucket(limits.rate_total, limits.clock)  # shared by the handler threads
        self._open: dict[socket.socket, float] = {}  # connection -> deadline (time.monotonic)
        self._cut: set[socket.socket] = set()  # connections whose input the reaper has shut
        self._open_lock = threading.Lock()
        self._failures: dict[str, int] = {}
        self._stop = threading.Event()
        super().__init__(address, handler)

    def process_request(self, request, client_address) -> None:
        with self._open_lock:
            busy = len(self._open) >= self.limits.max_connections
            if not busy:
                self._open[request] = time.monotonic() + self.limits.first_request_s
        if busy:
            with contextlib.suppress(OSError):
                request.setblocking(False)  # never wait on a client from the accept thread
                request.send(self.BUSY)
            self.shutdown_request(request)
            return
        super().process_request(request, client_address)

    def set_deadline(self, request, seconds: float) -> None:
        with self._open_lock:
            if request in self._open:
                self._open[request] = time.monotonic() + seconds

    def shutdown_request(self, request) -> None:
        with self._open_lock:
            self._open.pop(request, None)
            self._cut.discard(request)
        super().shutdown_request(request)

    def reap(self) -> int:
        """Cut off connections past their deadline (silent, trickling or not reading): first their
        input, so a handler waiting for bytes answers what it has; a grace period later, both ways,
        so one blocked writing to a client that does not read returns too. How many were cut."""
        now = time.monotonic()
        with self._open_lock:
            late = [conn for conn, deadline in self._open.items() if deadline < now]
            for conn in late:
                self._open[conn] = now + self.limits.grace_s if conn not in self._cut else float("inf")
        for conn in late:
            how = socket.SHUT_RDWR if conn in self._cut else socket.SHUT_RD
            self._cut.add(conn)
            with contextlib.suppress(OSError):
                conn.shutdown(how)
        return len(late)

    def reap_forever(self, interval_s: float = 0.5) -> None:
        while not self._stop.wait(interval_s):
            self.reap()

    def close_open_connections(self) -> None:
        self._stop.set()
        with self._open_lock:
            conns, self._open = list(self._open), {}
        for conn in conns:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)

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

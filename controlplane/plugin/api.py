"""The replica control API (SPEC §5), served on a daemon thread next to the scheduler.

    GET /tailpilot/v1/state?cursor=N     queue, KV, live γ/β, counters, completions since N
    GET /tailpilot/v1/settings           the active (or staged) settings document and its version
    PUT /tailpilot/v1/settings           validate + stage a document; If-Match: <version> for CAS
    GET /tailpilot/v1/steps?cursor=N     the step log (duration and batch composition per step)
    GET /tailpilot/v1/health

A target that also plays a vLLM server (the simulated twin replicas) may define any of
``api_metrics() -> (body bytes, content type)``, ``api_models() -> dict`` and
``api_health() -> bool``; the server then also answers ``GET /metrics``, ``GET /v1/models`` and
``GET /health`` (200, or 503 when unhealthy) on the same port, as vLLM's API server does.

Loopback by default; writes need ``Authorization: Bearer <token>`` with the token from
``$TAILPILOT_TOKEN`` or the file named by ``$TAILPILOT_TOKEN_FILE``. Without a configured token
every write is refused (an operator must opt in to remote control).
"""

from __future__ import annotations

import contextlib
import hmac
import json
import os
import socket
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import parse_qs, urlsplit

from pydantic import ValidationError

from controlplane.plugin.core import SettingsConflict
from controlplane.settings import describe_error

PREFIX = "/tailpilot/v1"
TOKEN_ENV, TOKEN_FILE_ENV = "TAILPILOT_TOKEN", "TAILPILOT_TOKEN_FILE"
HOST_ENV, PORT_ENV = "TAILPILOT_API_HOST", "TAILPILOT_API_PORT"
DEFAULT_PORT = 8765
MAX_BODY = 1 << 20


class ControlTarget(Protocol):
    def api_state(self, cursor: int) -> dict[str, Any]: ...
    def api_settings(self) -> dict[str, Any]: ...
    def api_put_settings(self, doc: dict[str, Any], if_match: int | None) -> dict[str, Any]: ...
    def api_steps(self, cursor: int) -> dict[str, Any]: ...


def token_from_env() -> str | None:
    token = os.environ.get(TOKEN_ENV)
    if token:
        return token.strip()
    path = os.environ.get(TOKEN_FILE_ENV)
    if path:
        return Path(path).read_text().strip() or None
    return None


def _make_handler(target: ControlTarget, token: str | None):
    class Handler(BaseHTTPRequestHandler):
        server_version = "tailpilot-control/1"
        protocol_version = "HTTP/1.1"
        # Headers and body go out in separate writes: with Nagle's algorithm the body waits for
        # the client's delayed ACK (~40 ms per request on Linux).
        disable_nagle_algorithm = True

        def log_message(self, fmt, *args):  # quiet: the engine's log is not ours to flood
            pass

        def _send(self, status: int, body: dict[str, Any], headers: dict[str, str] | None = None) -> None:
            data = json.dumps(body, default=float).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            for k, v in (headers or {}).items():
                self.send_header(k, v)
            self.end_headers()
            self.wfile.write(data)

        def _send_raw(self, status: int, data: bytes, content_type: str) -> None:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _vllm_get(self, path: str) -> bool:
            """The optional vLLM-server endpoints; False if ``path`` is not one the target serves."""
            if path == "/metrics" and hasattr(target, "api_metrics"):
                data, content_type = target.api_metrics()
                self._send_raw(200, data, content_type)
            elif path == "/v1/models" and hasattr(target, "api_models"):
                self._send(200, target.api_models())
            elif path == "/health" and hasattr(target, "api_health"):
                self._send_raw(200 if target.api_health() else 503, b"", "text/plain")
            else:
                return False
            return True

        def _error(self, status: int, message: str) -> None:
            self._send(status, {"error": message, "status": status})

        def _cursor(self, query: dict) -> int:
            raw = query.get("cursor", ["0"])[0]
            if not raw.isdigit():
                raise ValueError(f"cursor: expected a non-negative integer, got {raw!r}")
            return int(raw)

        def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
            url = urlsplit(self.path)
            query = parse_qs(url.query)
            try:
                if url.path == f"{PREFIX}/state":
                    return self._send(200, target.api_state(self._cursor(query)))
                if url.path == f"{PREFIX}/settings":
                    doc = target.api_settings()
                    return self._send(200, doc, {"ETag": str(doc["version"])})
                if url.path == f"{PREFIX}/steps":
                    return self._send(200, target.api_steps(self._cursor(query)))
                if url.path == f"{PREFIX}/health":
                    return self._send(200, {"ok": True})
                if self._vllm_get(url.path):
                    return
            except ValueError as err:
                return self._error(400, str(err))
            self._error(404, f"no such endpoint: {url.path}")

        def do_PUT(self) -> None:  # noqa: N802
            url = urlsplit(self.path)
            length = int(self.headers.get("Content-Length") or 0)
            body = self.rfile.read(min(length, MAX_BODY)) if length else b""
            if url.path != f"{PREFIX}/settings":
                return self._error(404, f"no such endpoint: {url.path}")
            if token is None:
                return self._error(403, "writes are disabled: no token configured on this replica "
                                        f"(set {TOKEN_ENV} or {TOKEN_FILE_ENV})")
            auth = self.headers.get("Authorization", "")
            if not auth.startswith("Bearer "):
                return self._error(401, "missing bearer token (Authorization: Bearer <token>)")
            if not hmac.compare_digest(auth.removeprefix("Bearer ").strip(), token):
                return self._error(401, "wrong bearer token")
            if_match = self.headers.get("If-Match")
            if if_match is not None:
                if not if_match.strip().strip('"').isdigit():
                    return self._error(400, f"If-Match: expected a settings version number, got {if_match!r}")
                if_match = int(if_match.strip().strip('"'))
            try:
                doc = json.loads(body or b"null")
            except json.JSONDecodeError as err:
                return self._error(400, f"body: not JSON ({err})")
            if not isinstance(doc, dict):
                return self._error(400, "body: expected a settings object")
            try:
                result = target.api_put_settings(doc, if_match)
            except SettingsConflict as err:
                return self._error(409, str(err))
            except (ValidationError, ValueError) as err:
                return self._error(400, describe_error(err))
            self._send(200, result, {"ETag": str(result["version"])})

    return Handler


class _HTTPServer(ThreadingHTTPServer):
    """Tracks open connections so ``stop`` can close keep-alive ones: a stopped server must look
    down to a client that holds a pooled connection, not keep answering from its handler threads."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._open: set[socket.socket] = set()
        self._open_lock = threading.Lock()

    def process_request(self, request, client_address) -> None:
        with self._open_lock:
            self._open.add(request)
        super().process_request(request, client_address)

    def shutdown_request(self, request) -> None:
        with self._open_lock:
            self._open.discard(request)
        super().shutdown_request(request)

    def close_open_connections(self) -> None:
        with self._open_lock:
            conns, self._open = list(self._open), set()
        for conn in conns:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)

    def handle_error(self, request, client_address) -> None:
        if isinstance(sys.exc_info()[1], ConnectionError):  # a client went away mid-request: not ours
            return
        super().handle_error(request, client_address)


class ControlServer:
    """The HTTP server on a daemon thread; ``port=0`` picks a free port."""

    def __init__(self, target: ControlTarget, host: str = "127.0.0.1", port: int = DEFAULT_PORT,
                 token: str | None = None) -> None:
        self.httpd = _HTTPServer((host, port), _make_handler(target, token))
        self.httpd.daemon_threads = True
        self.thread = threading.Thread(target=self.httpd.serve_forever, name="tailpilot-control", daemon=True)

    @property
    def port(self) -> int:
        return self.httpd.server_address[1]

    @property
    def base_url(self) -> str:
        """``http://host:port``: where ``/metrics`` and ``/v1/models`` live on a vLLM-like target."""
        host = self.httpd.server_address[0]
        return f"http://{host}:{self.port}"

    @property
    def url(self) -> str:
        return f"{self.base_url}{PREFIX}"

    def start(self) -> "ControlServer":
        self.thread.start()
        return self

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self.httpd.close_open_connections()

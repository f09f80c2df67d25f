"""A replica that answers what a test crafts, over real HTTP on loopback.

:class:`CraftedReplica` serves ``GET /tailpilot/v1/state?cursor=N`` from a completions log the test
writes (each entry a dict, sent as JSON text: an integer of any size and a lone surrogate escape
``"\\ud800"`` go over the wire exactly as a broken or hostile replica would send them) and a vLLM
``/metrics`` page. ``state_extra`` holds the state document's other fields, changed between polls
as the test goes; ``answer`` replaces the whole answer for the faults no document can carry (an
answer that never ends, a Content-Length of 10 GB).
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

from test_collector import VLLM_V1_PAGE

PAGE_LIMIT = 1_000  # the control API's page size


def entry(i: int, **fields: Any) -> dict[str, Any]:
    """The completions-log entry number ``i``, valid unless ``fields`` say otherwise."""
    doc = {
        "seq": i,
        "id": f"q{i}",
        "tenant": "acme",
        "type": "chat",
        "arrival": float(i),
        "received_at": i + 0.01,
        "scheduled_at": i + 0.1,
        "first_token_at": i + 0.2,
        "finished_at": i + 1.0,
        "prompt_tokens": 10 + i,
        "output_tokens": 5 + i,
        "max_tokens": 64,
        "preemptions": 0,
        "recomputed_tokens": 0,
        "reason": "finished",
    }
    doc.update(fields)
    return doc


class CraftedReplica:
    def __init__(
        self, name: str, log: list[dict[str, Any]] | None = None, *, metrics: bytes | None = None
    ) -> None:
        self.name = name
        self.log: list[dict[str, Any]] = list(log or [])
        self.state_extra: dict[str, Any] = {}
        self.metrics = VLLM_V1_PAGE.encode() if metrics is None else metrics
        # (handler, path) -> True when it answered itself; None: the normal answer.
        self.answer: Callable[[BaseHTTPRequestHandler, str], bool] | None = None
        self.page_limit = PAGE_LIMIT
        self.cursors_asked: list[int] = []
        self.bytes_sent = 0
        self.disconnected = threading.Event()  # a client hung up on a crafted answer
        replica = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a: Any) -> None:
                pass

            def do_GET(self) -> None:
                parts = urlsplit(self.path)
                if parts.path == "/tailpilot/v1/state":
                    cursor = int(parse_qs(parts.query).get("cursor", ["-1"])[0])
                    replica.cursors_asked.append(cursor)
                if replica.answer is not None and replica.answer(self, parts.path):
                    return
                if parts.path == "/tailpilot/v1/state":
                    return self.reply(200, replica.state_body(cursor), "application/json")
                if parts.path == "/metrics":
                    return self.reply(200, replica.metrics, "text/plain; version=0.0.4")
                self.reply(404, b'{"error": "no such endpoint"}', "application/json")

            def reply(self, status: int, body: bytes, ctype: str) -> None:
                try:
                    self.send_response(status)
                    self.send_header("Content-Type", ctype)
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)
                except OSError:
                    pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def state_doc(self, cursor: int) -> dict[str, Any]:
        start = max(cursor, 0) if cursor >= 0 else len(self.log)
        page = self.log[start : start + self.page_limit]
        doc: dict[str, Any] = {
            "replica": self.name,
            "instance": "i-1",
            "time": 100.0,
            "policy": "fcfs",
            "settings": {"policy": "fcfs", "params": {}, "pinned": []},
            "settings_version": 1,
            "waiting": 0,
            "running": 1,
            "kv": {"used_blocks": 1, "total_blocks": 100, "usage": 0.01},
            "finished_total": len(self.log),
            "steps_total": 10 + len(self.log),
            "completions": page,
            "next_cursor": start + len(page),
            "more": start + len(page) < len(self.log),
        }
        doc.update(self.state_extra)
        return doc

    def state_body(self, cursor: int) -> bytes:
        return json.dumps(
            self.state_doc(cursor)
        ).encode()  # ensure_ascii: a lone surrogate as "\ud800"

    def stream(
        self, handler: BaseHTTPRequestHandler, total: int, *, declared: int | None = None
    ) -> None:
        """Answer with ``total`` bytes of a JSON array that never closes, then a byte every 50 ms
        until the client hangs up (a replica whose answer never ends); ``declared``: a
        Content-Length."""
        try:
            handler.send_response(200)
            handler.send_header("Content-Type", "application/json")
            if declared is not None:
                handler.send_header("Content-Length", str(declared))
            handler.end_headers()  # no length: the body ends when the connection does (HTTP/1.0)
            chunk = b"[" + b"9," * 32_767 + b"9"
            sent = 0
            while sent < total:
                handler.wfile.write(chunk)
                sent += len(chunk)
                self.bytes_sent += len(chunk)
            give_up = time.monotonic() + 60.0  # a test's own bound on a thread of this server
            while (
                time.monotonic() < give_up
            ):  # a byte now and then, never the end: the client's cap or timeout ends it
                time.sleep(0.05)
                handler.wfile.write(b" ")
                handler.wfile.flush()
                self.bytes_sent += 1
        except OSError:  # the client hung up
            self.disconnected.set()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

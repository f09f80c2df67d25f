"""What the control API's handler reads from a request, each part within its budget: the request
line and headers (``HeaderBudgetReader``), the header block's framing (``header_problem``,
``has_body``), the query (``parse_query``, ``parse_cursor``, ``parse_limit``), ``If-Match``
(``parse_if_match``) and a settings document (``read_settings_document``). What cannot be read as
asked raises ``HTTPError``, which the handler (``scheduler.plugin.api``) answers. Only
standard-library parts: this runs in vLLM's process.
"""

from __future__ import annotations

import http.client
import io
import re
from email.message import Message
from typing import Any
from urllib.parse import parse_qs, urlsplit

from scheduler.contract import INFLIGHT_LIMIT
from scheduler.errors import TailpilotError
from scheduler.plugin.admission import Limits
from scheduler.plugin.wire import parse_json_body

_DIGITS = re.compile(r"[0-9]{1,18}", re.ASCII)  # cursors, versions, lengths: ASCII digits, < 2**63
_VERSION = re.compile(r'([0-9]{1,18})|"([0-9]{1,18})"', re.ASCII)  # If-Match, bare or an ETag
# Headers that decide how a request is framed, who sends it or what it may change: given twice,
# which one counts is ambiguous (one reader's choice can differ from a proxy's).
SINGLE_HEADERS = ("Content-Length", "Transfer-Encoding", "Authorization", "If-Match", "Host")


class HTTPError(TailpilotError):
    """Answer ``status`` with ``message``; ``close`` when unread bytes make the connection
    unusable."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        close: bool = False,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status, self.close, self.headers = status, close, headers or {}


class HeaderBudgetReader:
    """A connection's input with a byte budget for each request's line and headers."""

    def __init__(self, raw: io.BufferedIOBase, budget: int) -> None:
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


def header_problem(headers: Message) -> str | None:
    """The problem (400) with the request's header block, None when there is none: a line that is
    not ``Name: value`` (a space before the colon included), a folded line (obsolete line
    folding, RFC 9112 §5.2), or a header of ``SINGLE_HEADERS`` given more than once. Each could
    hide a header from this server while another reader sees it: a smuggled request."""
    if headers.defects:  # the parser stopped at a line it could not read as a header
        return "headers: a line is not 'Name: value' (no space before the colon, no folding)"
    for name, value in headers.items():
        if "\r" in value or "\n" in value:
            return f"{name[:40]}: folded over lines (obsolete line folding is not accepted)"
    for name in SINGLE_HEADERS:
        given = headers.get_all(name) or []
        if len(given) > 1:
            shown = ", ".join(repr(v[:20]) for v in given[:4])
            return f"{name}: given {len(given)} times ({shown}); send it once"
    return None


def has_body(headers: Message) -> bool:
    return headers.get("Content-Length", "0").strip() not in ("", "0") or bool(
        headers.get("Transfer-Encoding")
    )


def parse_query(path: str, allowed: tuple[str, ...]) -> dict[str, str]:
    url = urlsplit(path)
    if not url.query:
        return {}
    try:
        query = parse_qs(
            url.query,
            keep_blank_values=True,
            strict_parsing=True,
            max_num_fields=len(allowed) + 1,
        )
    except ValueError as err:
        raise HTTPError(400, f"query: {err}") from None
    for name, values in query.items():
        if name not in allowed:
            raise HTTPError(
                400,
                f"query: unknown parameter {name!r} (known: {', '.join(allowed) or 'none'})",
            )
        if len(values) > 1:
            raise HTTPError(400, f"query: {name} given {len(values)} times")
    return {name: values[0] for name, values in query.items()}


def parse_cursor(query: dict[str, str]) -> int | None:
    raw = query.get("cursor")
    if raw is None:
        return None
    if not _DIGITS.fullmatch(raw):
        raise HTTPError(400, f"cursor: expected a non-negative integer, got {raw[:40]!r}")
    return int(raw)


def parse_limit(query: dict[str, str]) -> int:
    raw = query.get("limit")
    if raw is None:
        return INFLIGHT_LIMIT
    if not _DIGITS.fullmatch(raw) or not 1 <= int(raw) <= INFLIGHT_LIMIT:
        raise HTTPError(
            400, f"limit: expected an integer from 1 to {INFLIGHT_LIMIT}, got {raw[:40]!r}"
        )
    return int(raw)


def parse_if_match(headers: Message) -> int | None:
    """The settings version ``If-Match`` names (compare-and-set), None without one."""
    if_match = headers.get("If-Match")
    if if_match is None:
        return None
    m = _VERSION.fullmatch(if_match.strip())
    if m is None:  # "*", weak tags, lists and half-quoted values included
        raise HTTPError(
            400,
            f"If-Match: expected a settings version number, got {if_match[:40]!r}",
            close=True,
        )
    return int(m.group(1) or m.group(2))


def read_settings_document(
    headers: Message, reader: HeaderBudgetReader, limits: Limits
) -> dict[str, Any]:
    """The body, read within the limits, as a JSON object."""
    try:
        doc = parse_json_body(_read_body(headers, reader, limits))
    except ValueError as err:
        raise HTTPError(400, str(err)) from None
    if not isinstance(doc, dict):
        raise HTTPError(400, f"body: expected a settings object, got {type(doc).__name__}")
    return doc


def _read_body(headers: Message, reader: HeaderBudgetReader, limits: Limits) -> bytes:
    if headers.get("Transfer-Encoding"):
        raise HTTPError(411, "Transfer-Encoding is not accepted: send Content-Length", close=True)
    raw = headers.get("Content-Length")
    if raw is None:
        raise HTTPError(411, "Content-Length: required", close=True)
    if not _DIGITS.fullmatch(raw.strip()):
        raise HTTPError(400, f"Content-Length: expected a byte count, got {raw[:40]!r}", close=True)
    length = int(raw)
    if length > limits.max_body:
        raise HTTPError(
            413, f"body: {length} bytes, over the limit of {limits.max_body}", close=True
        )
    try:
        body = reader.read(length)
    except TimeoutError:
        raise HTTPError(
            408, f"body: not received within {limits.request_timeout_s:g} s", close=True
        ) from None
    if len(body) < length:  # the client closed, or the reaper cut a trickle off
        raise HTTPError(408, f"body: {len(body)} of {length} bytes arrived in time", close=True)
    return body

"""Admission for the control API's server: what one server may cost its host process, and how it
is shared out between token holders and anonymous clients.

The server runs in vLLM's engine-core process, so every decision here is bounded and constant
work:

* connections: at most ``Limits.max_connections`` open; a share (``token_reserve``) is kept for
  requests carrying the bearer token, so unauthenticated clients cannot lock the collector out;
  when slots run short, the idlest unauthenticated connection is closed early for a newcomer;
  a refused connection gets its 503 after a pause, held without a thread;
* rates: each connection, each client address and all of them together draw on token buckets
  (``TokenBucket``, ``RateBudgets``); a large answer costs more;
* deadlines: a reaper thread cuts off connections that are silent, trickle or do not read.

The request handler (``scheduler.plugin.api``) asks ``BoundedHTTPServer`` at each step of a
request: ``begin_request`` when its headers are in, ``rates.take`` before answering,
``end_request`` after. Only standard-library parts: nothing heavy enters vLLM's process.
"""

from __future__ import annotations

import contextlib
import logging
import math
import socket
import sys
import threading
import time
from collections import Counter, OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from scheduler.plugin.wire import encode_json
from scheduler.settings import MAX_DOCUMENT_BYTES

log = logging.getLogger("tailpilot.control")

LINGER_BYTES = 64 * 1024  # what a refused connection may have sent already, read before closing

#: What socketserver calls a request: a stream server's is its connection's socket (the datagram
#: form, ``(data, socket)``, never reaches this TCP server).
ServerRequest = socket.socket | tuple[bytes, socket.socket]


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
    max_body: int = MAX_DOCUMENT_BYTES  # the largest settings document the model accepts
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
    max_addresses: int = (
        1024  # client addresses whose rate is remembered; the least recent is forgotten
    )
    # When the slots are full, a newcomer takes the slot of the unauthenticated connection idle
    # this long between requests, or silent this long since it was accepted (evict_new_s), the
    # idlest first. A client sends its request as it connects: its handler reads the headers
    # within milliseconds, so a connection still silent after evict_new_s is holding a slot, and
    # churning silent connections cannot crowd token holders out (a keep-alive client between
    # requests is given longer).
    evict_idle_s: float = 1.0
    evict_new_s: float = 0.05
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
            raise ValueError(
                f"Limits.token_reserve: expected a share in [0, 1), got {self.token_reserve!r}"
            )
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


class TokenBucket:
    """``rate`` tokens per second up to ``rate`` banked; ``take`` returns 0 or the wait for a
    token."""

    __slots__ = ("clock", "rate", "stamp", "tokens")

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


# What the server knows a connection by: new until its first request's headers are in, then the
# kind of its last request (anonymous, or carrying this replica's token).
NEW, ANONYMOUS, TOKEN = "new", "anonymous", "token"
CLOSED_EARLY = "closed early to make room"  # begin_request's answer for a connection being closed


def _refusal(message: str) -> bytes:
    """A whole 503 answer that closes the connection, to send without a handler."""
    body = encode_json({"error": message, "status": 503})
    return (
        b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
        b"Connection: close\r\nRetry-After: 1\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
    )


@dataclass(slots=True)
class _Conn:
    """One open connection as the server sees it (read and written under the server's lock)."""

    deadline: float  # time.monotonic() past which the reaper cuts it off
    idle_since: float  # Limits.clock() when it last began waiting for a request line
    kind: str = NEW
    busy: bool = False  # from its request's headers to the end of its answer
    closing: bool = False  # closed early to make room; its thread is finishing


class RateBudgets:
    """The request rates a server's connections share (each connection also has its own
    ``TokenBucket``, held by its handler): every request draws on ``total``; anonymous ones also on
    ``anonymous`` and on their client address's bucket. The handler threads share it (its lock)."""

    def __init__(self, limits: Limits) -> None:
        self.limits = limits
        self.total = TokenBucket(limits.rate_total, limits.clock)
        self.anonymous = TokenBucket(limits.rate_anonymous, limits.clock)
        self._addresses: OrderedDict[str, TokenBucket] = OrderedDict()  # least recently seen first
        self._lock = threading.Lock()

    def take(self, address: str, token: bool) -> float:
        """0 when the shared budgets let a request through (and it is counted), else the wait."""
        with self._lock:
            if token:
                return self.total.take()
            return (
                self._address_bucket(address).take() or self.anonymous.take() or self.total.take()
            )

    def charge(self, address: str, token: bool, cost: float) -> None:
        """Charge a large answer's extra cost to the shared budgets it drew on."""
        with self._lock:
            self.total.charge(cost)
            if not token:
                self.anonymous.charge(cost)
                self._address_bucket(address).charge(cost)

    def addresses(self) -> int:
        """How many client addresses' rates are remembered."""
        with self._lock:
            return len(self._addresses)

    def _address_bucket(self, address: str) -> TokenBucket:
        bucket = self._addresses.get(address)
        if bucket is not None:
            self._addresses.move_to_end(address)
            return bucket
        # Bounded: forgetting the least recent address only refills its budget; the anonymous
        # total still bounds what many addresses get together.
        if len(self._addresses) >= self.limits.max_addresses:
            self._addresses.popitem(last=False)
        bucket = self._addresses[address] = TokenBucket(
            self.limits.rate_per_address, self.limits.clock
        )
        return bucket


class BoundedHTTPServer(ThreadingHTTPServer):
    """Counts, sorts and times connections. Over the cap a connection is answered 503 and closed
    without a thread, unless an unauthenticated connection has been idle long enough to be closed
    early for it (the idlest first); anonymous connections may hold only their share of the slots.
    A reaper closes connections past their deadline; ``stop`` closes keep-alive ones, so a stopped
    server looks down to a client holding a pooled connection. Every decision is constant work: the
    idle unauthenticated connections wait in two queues ordered by idle time."""

    daemon_threads = True
    BUSY = _refusal("too many connections to the control API")

    def __init__(
        self,
        address: tuple[str, int],
        handler: type[BaseHTTPRequestHandler],
        limits: Limits,
    ) -> None:
        self.request_queue_size = limits.backlog
        self.limits = limits
        self.rates = RateBudgets(limits)  # shared by the handler threads
        self._conns: dict[socket.socket, _Conn] = {}
        # Silent since accepted, oldest first; and between requests, idlest first.
        self._idle_new: OrderedDict[socket.socket, None] = OrderedDict()
        self._idle_anonymous: OrderedDict[socket.socket, None] = OrderedDict()
        self._anonymous = 0  # connections whose last request was anonymous
        self._closing = 0  # closed early, their threads finishing: at most max_closing at once
        self._max_closing = max(1, limits.reserved_connections)
        self._cut: set[socket.socket] = set()  # connections whose input the reaper has shut
        self._refusing: dict[socket.socket, bytes] = {}  # handlers done: refuse instead of closing
        # (due, socket, answer), due first
        self._parked: deque[tuple[float, socket.socket, bytes]] = deque()
        self._lock = threading.Lock()
        self._failures: dict[str, int] = {}
        self._stop = threading.Event()
        super().__init__(address, handler)

    # --- admission ------------------------------------------------------------------------------
    def process_request(self, request: ServerRequest, client_address: object) -> None:
        assert isinstance(request, socket.socket)  # a stream server's request (ServerRequest)
        now, victim = self.limits.clock(), None
        with self._lock:
            admitted = len(self._conns) - self._closing < self.limits.max_connections
            if not admitted and self._closing < self._max_closing:
                victim = self._close_idlest(now, new_too=True)
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

    def refuse_on_close(self, request: socket.socket, message: str) -> None:
        """When its handler is done, answer ``request`` 503 with ``message`` instead of closing
        it."""
        answer = _refusal(message)
        with self._lock:
            self._refusing[request] = answer

    def _refuse(self, request: socket.socket, answer: bytes) -> None:
        """Answer ``answer`` and close: after the pause from the reaper thread, or at once when
        there is no pause or the parking lot is full."""
        with self._lock:
            park = self.limits.max_penalty_s > 0 and len(self._parked) < self.limits.max_parked
            if park:
                self._parked.append(
                    (self.limits.clock() + self.limits.max_penalty_s, request, answer)
                )
        if not park:
            self._answer_and_close(request, answer)

    def release_parked(self) -> int:
        """Answer and close the parked connections whose pause is over; how many."""
        now = self.limits.clock()
        due: list[tuple[float, socket.socket, bytes]] = []
        with self._lock:
            while self._parked and self._parked[0][0] <= now:
                due.append(self._parked.popleft())
        for _, request, answer in due:
            self._answer_and_close(request, answer)
        return len(due)

    def _answer_and_close(self, request: socket.socket, answer: bytes) -> None:
        with contextlib.suppress(OSError):
            request.setblocking(False)  # never wait on a client from the accept or reaper thread
            # What it sent already: unread, it would reset the answer.
            with contextlib.suppress(BlockingIOError):
                request.recv(LINGER_BYTES)
            request.send(answer)
        super().shutdown_request(request)

    def begin_request(self, request: socket.socket, token: bool) -> str | None:
        """A request's headers are in: None to serve it, else why it is refused (the connection is
        then closed). An anonymous request on a connection not yet counted as anonymous needs an
        anonymous slot: a free one, or the idlest idle anonymous connection's, closed early."""
        now, victim = self.limits.clock(), None
        with self._lock:
            conn = self._conns.get(request)
            if conn is None or conn.closing:
                return CLOSED_EARLY
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
                        victim = self._close_idlest(now)
                    if victim is None:
                        return (
                            "too many unauthenticated connections to the control API "
                            f"({self.limits.reserved_connections} of {self.limits.max_connections} "
                            "are kept for requests with the bearer token)"
                        )
                conn.kind = ANONYMOUS
                self._anonymous += 1
        if victim is not None:
            self._shut(victim)
        return None

    def end_request(self, request: socket.socket, keep_alive: bool) -> None:
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

    def _close_idlest(self, now: float, new_too: bool = False) -> socket.socket | None:
        """Under the lock: mark the idlest idle anonymous connection (idle ``evict_idle_s``) or,
        with ``new_too``, silent new one (silent ``evict_new_s``) as closing; the caller shuts it
        outside the lock. None when no connection has been idle or silent that long."""
        queues = [(self._idle_anonymous, self.limits.evict_idle_s)]
        if new_too:
            queues.append((self._idle_new, self.limits.evict_new_s))
        # Each queue is in idle order: its head became evictable first (idle since + its wait).
        heads = [
            (self._conns[head].idle_since + wait, head)
            for queue, wait in queues
            if (head := next(iter(queue), None)) is not None
        ]
        if not heads:
            return None
        evictable_since, request = min(heads, key=lambda item: item[0])
        if now < evictable_since:
            return None
        conn = self._conns[request]
        self._leave_counts(request, conn)
        conn.closing = True
        self._closing += 1
        return request

    def _leave_counts(self, request: socket.socket, conn: _Conn) -> None:
        """Under the lock: a connection closing (early, or for good) leaves the idle queues and
        the count of anonymous connections."""
        self._idle_new.pop(request, None)
        self._idle_anonymous.pop(request, None)
        self._anonymous -= conn.kind == ANONYMOUS

    @staticmethod
    def _shut(request: socket.socket) -> None:
        # Its thread, waiting for a request line, reads end-of-file and finishes.
        with contextlib.suppress(OSError):
            request.shutdown(socket.SHUT_RDWR)

    def admission(self) -> dict[str, int]:
        """A snapshot of the connection table and the rate table: connections by kind, how many are
        serving a request now (busy: answered but not yet idle counts too), how many are closing
        early, how many refused ones wait for their answer, how many client addresses are
        remembered."""
        with self._lock:
            open_conns = [conn for conn in self._conns.values() if not conn.closing]
            kinds = Counter(conn.kind for conn in open_conns)
            counts = {
                "connections": len(self._conns) - self._closing,
                "anonymous": self._anonymous,
                "token": kinds[TOKEN],
                "new": kinds[NEW],
                "busy": sum(conn.busy for conn in open_conns),
                "closing": self._closing,
                "parked": len(self._parked),
            }
        counts["addresses"] = self.rates.addresses()
        return counts

    # --- deadlines -------------------------------------------------------------------------------
    def set_deadline(self, request: socket.socket, seconds: float) -> None:
        with self._lock:
            if (conn := self._conns.get(request)) is not None:
                conn.deadline = time.monotonic() + seconds

    def shutdown_request(self, request: ServerRequest) -> None:
        assert isinstance(request, socket.socket)  # a stream server's request (ServerRequest)
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
            late = [
                (request, socket.SHUT_RDWR if request in self._cut else socket.SHUT_RD)
                for request, conn in self._conns.items()
                if conn.deadline < now
            ]
            for request, how in late:
                self._conns[request].deadline = (
                    now + self.limits.grace_s if how == socket.SHUT_RD else math.inf
                )
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
            log.warning(
                "tailpilot control API: request failed (%s: %s); later %s failures are counted, "
                "not logged",
                kind,
                str(err)[:200],
                kind,
            )

    def handle_error(self, request: ServerRequest, client_address: object) -> None:
        # Failures inside a request are answered by the handler; what reaches here is a client
        # gone mid-request or a bug in the server itself: never a traceback in vLLM's log.
        err = sys.exc_info()[1]
        if err is not None and not isinstance(err, (ConnectionError, TimeoutError)):
            self.log_failure(err)

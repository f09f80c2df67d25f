"""Fair admission in the control API: unauthenticated clients cannot lock a token holder out.

The real control server over real sockets, with a bare ReplicaCore as its engine (no vLLM). A
request carrying ``Authorization: Bearer <token>`` is a token holder's (the collector polling
``/state``); the rest are anonymous. Rates and idle ages run on an injected clock that moves only
when told; waits are on events; outcomes are counted, never timed. What this costs a real engine
is measured by ``benchmarks/control_api_load.py --attack``.
"""

from __future__ import annotations

import http.client
import json
import socket
import threading
import time
from collections import Counter

import pytest
from core_target import CoreTarget  # tests/core_target.py

from scheduler.plugin.admission import Limits
from scheduler.plugin.api import PREFIX, ControlServer
from scheduler.plugin.core import ReplicaCore
from scheduler.policies import RequestState
from scheduler.settings import Settings

TOKEN = "admission-token"
WAIT_S = 30.0  # a generous bound on every wait for an event


class SteppedClock:
    """A monotonic clock that moves only when the test says so."""

    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def serve(**limits) -> tuple[ReplicaCore, ControlServer]:
    core = ReplicaCore(Settings(policy="fcfs"), replica="r1")
    for i in range(50):  # a completions log to poll
        s = RequestState(id=f"q{i}", arrival=float(i), prompt_tokens=5, max_tokens=5, tenant="a")
        core.track(s, float(i))
        s.generated = 5
        core.finish(s, float(i) + 1)
    limits.setdefault("max_penalty_s", 0.0)
    return core, ControlServer(
        CoreTarget(core), port=0, token=TOKEN, limits=Limits(**limits)
    ).start()


def connect(server: ControlServer, source: str = "127.0.0.1") -> socket.socket:
    return socket.create_connection(
        ("127.0.0.1", server.port), timeout=WAIT_S, source_address=(source, 0)
    )


def ask(sock: socket.socket, path: str = "/state", auth: str | None = None) -> int:
    """One request on a keep-alive connection; its status, or 0 when the server closed instead."""
    header = f"Authorization: {auth}\r\n" if auth else ""
    try:
        sock.sendall(f"GET {PREFIX}{path} HTTP/1.1\r\nHost: x\r\n{header}\r\n".encode())
        resp = http.client.HTTPResponse(sock)
        resp.begin()
        resp.read()
        return resp.status
    except (OSError, http.client.HTTPException):
        return 0


def closed_by_server(sock: socket.socket) -> bool:
    """Waits for the server to close ``sock`` (True), or for bytes from it (False)."""
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


def settled(server: ControlServer) -> bool:
    """Waits until no connection closed early is still finishing (its slot is free again)."""
    deadline = time.monotonic() + WAIT_S
    while server.httpd.admission()["closing"]:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def at_rest(server: ControlServer) -> bool:
    """Waits until every answered request's connection is idle again. A handler marks its
    connection idle (and queues it by idle age) only after the answer is sent, so a test that
    moves the clock right after a reply must wait for this, or the idle order is a race."""
    deadline = time.monotonic() + WAIT_S
    while server.httpd.admission()["busy"]:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


BEARER = f"Bearer {TOKEN}"


# --- connection slots -----------------------------------------------------------------------------


def test_anonymous_connections_leave_slots_for_token_holders():
    clock = SteppedClock()
    _, server = serve(max_connections=4, clock=clock)  # 1 of 4 slots kept for token holders
    try:
        anonymous = [connect(server) for _ in range(3)]
        assert [ask(s) for s in anonymous] == [200] * 3
        # A fourth anonymous client is refused: the anonymous slots are full and their holders
        # have not been idle long enough to be closed for it.
        extra = connect(server)
        extra.sendall(f"GET {PREFIX}/state HTTP/1.1\r\nHost: x\r\n\r\n".encode())
        raw = b""
        while chunk := extra.recv(65536):
            raw += chunk
        assert (
            raw.startswith(b"HTTP/1.1 503 ") and b"kept for requests with the bearer token" in raw
        )
        # A token holder gets the kept slot, and keeps it.
        holder = connect(server)
        assert [ask(holder, auth=BEARER) for _ in range(3)] == [200] * 3
        assert [ask(s) for s in anonymous] == [200] * 3  # the anonymous ones were not disturbed
        assert at_rest(server) and server.httpd.admission() == {
            "connections": 4,
            "anonymous": 3,
            "token": 1,
            "new": 0,
            "busy": 0,
            "closing": 0,
            "parked": 0,
            "addresses": 1,
        }
    finally:
        server.stop()


def test_without_a_token_configured_nothing_is_kept_back():
    core = ReplicaCore(Settings(policy="fcfs"), replica="r1")
    server = ControlServer(
        CoreTarget(core), port=0, token=" ", limits=Limits(max_connections=4)
    ).start()
    try:
        clients = [connect(server) for _ in range(4)]  # every slot serves anonymous clients
        assert [ask(s) for s in clients] == [200] * 4
    finally:
        server.stop()


def test_idle_anonymous_connections_are_closed_early_idlest_first_and_never_a_token_holders():
    clock = SteppedClock()
    _, server = serve(max_connections=4, clock=clock)  # 3 anonymous slots, evict_idle_s=1
    try:
        a = [connect(server) for _ in range(3)]
        for s in a:
            assert ask(s) == 200 and at_rest(server)
            clock.t += 1.0  # a[0] is the idlest, then a[1], a[2]
        clock.t += 1.0
        newcomer = connect(server)
        assert ask(newcomer) == 200 and at_rest(server)  # in a[0]'s anonymous slot
        assert closed_by_server(a[0]) and settled(server)
        holder = connect(server)  # the fourth slot
        assert ask(holder, auth=BEARER) == 200 and at_rest(server)
        clock.t += 5.0  # every connection idle for long, the token holder's too
        late = connect(server)  # all four slots taken: the idlest unauthenticated one goes, a[1]
        assert ask(late) == 200
        assert closed_by_server(a[1])
        assert ask(holder, auth=BEARER) == 200  # the idlest of all, but a token holder's: kept
        assert ask(a[2]) == 200 and ask(newcomer) == 200
        assert server.httpd.admission()["token"] == 1
    finally:
        server.stop()


def test_a_silent_connection_is_closed_early_only_once_it_has_been_silent_a_while():
    clock = SteppedClock()
    _, server = serve(max_connections=2, clock=clock)
    try:
        silent = [connect(server) for _ in range(2)]
        assert accepted(server, new=2)
        young = connect(server)  # both slots held by connections too young to close: 503
        assert young.recv(65536).startswith(b"HTTP/1.1 503 ")
        clock.t += server.limits.evict_new_s
        holder = connect(server)  # the older silent connection makes room
        assert ask(holder, auth=BEARER) == 200
        assert closed_by_server(silent[0])
        silent[1].sendall(f"GET {PREFIX}/health HTTP/1.1\r\nHost: x\r\n\r\n".encode())
        assert silent[1].recv(65536).startswith(b"HTTP/1.1 200 ")
    finally:
        server.stop()


def accepted(server: ControlServer, new: int) -> bool:
    """Waits until the server has accepted ``new`` connections that have sent nothing yet (a
    connect returns before the accept thread has counted it)."""
    deadline = time.monotonic() + WAIT_S
    while server.httpd.admission()["new"] < new:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def test_churning_silent_connections_cannot_crowd_a_token_holder_out():
    """An attacker re-opening silent connections faster than ``evict_idle_s`` once held every slot
    (a token holder got 503 one poll in three): a connection still silent ``evict_new_s`` after it
    was accepted gives its slot to a newcomer, while a keep-alive client idle between requests
    keeps its slot for ``evict_idle_s``."""
    clock = SteppedClock()
    _, server = serve(max_connections=4, clock=clock)
    limits = server.limits
    assert limits.evict_new_s < limits.evict_idle_s
    try:
        kept = connect(server)
        assert ask(kept) == 200 and at_rest(server)  # an anonymous keep-alive client, now idle
        silent = [connect(server) for _ in range(3)]  # the table is full
        assert accepted(server, new=3)
        young = connect(server)
        assert young.recv(65536).startswith(b"HTTP/1.1 503 ")  # nobody silent long enough yet
        clock.t += limits.evict_new_s  # kept has been idle as long: it keeps its slot
        holders = []
        for i in range(2):  # the silent connection accepted first makes room, each time
            holders.append(connect(server))
            assert ask(holders[-1], auth=BEARER) == 200, i
            assert closed_by_server(silent[i]) and settled(server)
        assert ask(kept) == 200 and ask(silent[2]) == 200  # neither was closed
        assert [ask(h, auth=BEARER) for h in holders] == [200, 200]
    finally:
        server.stop()


def test_refused_connections_wait_for_their_503_without_a_thread():
    clock = SteppedClock()
    _, server = serve(max_connections=1, max_penalty_s=1.0, max_parked=20, clock=clock)
    try:
        holder = connect(server)
        assert ask(holder, auth=BEARER) == 200
        threads = threading.active_count()
        refused = [connect(server) for _ in range(25)]
        # 20 wait for their answer, holding a socket each and no thread; the rest are answered now.
        for sock in refused[20:]:
            assert sock.recv(65536).startswith(b"HTTP/1.1 503 ")
        assert server.httpd.admission()["parked"] == 20 and threading.active_count() <= threads
        clock.t += 1.0  # the pause is over: the reaper answers them
        for sock in refused[:20]:
            assert sock.recv(65536).startswith(b"HTTP/1.1 503 ")
        assert server.httpd.admission()["parked"] == 0
        assert ask(holder, auth=BEARER) == 200
    finally:
        server.stop()


# --- rate budgets ---------------------------------------------------------------------------------


@pytest.mark.parametrize("scheme", ["Bearer", "bearer"])
def test_anonymous_requests_leave_a_share_of_the_rate_for_token_holders(scheme):
    clock = SteppedClock()
    _, server = serve(rate_total=8, rate_per_connection=1e9, clock=clock)  # anonymous share: 6 of 8
    try:
        anonymous, holder = connect(server), connect(server)
        assert [ask(anonymous) for _ in range(8)] == [200] * 6 + [429] * 2
        assert [ask(holder, auth=f"{scheme} {TOKEN}") for _ in range(3)] == [200] * 2 + [429]
        assert ask(holder, auth=f"Bearer {TOKEN}x") == 429  # a wrong token is anonymous
        clock.t += 1.0
        assert [ask(holder, auth=f"{scheme} {TOKEN}") for _ in range(8)] == [
            200
        ] * 8  # all of it when idle
    finally:
        server.stop()


def test_the_anonymous_rate_is_per_client_address_across_reconnects():
    clock = SteppedClock()
    _, server = serve(rate_per_address=5, rate_per_connection=1e9, rate_total=1e9, clock=clock)
    try:
        codes = [
            ask(s) for s in (connect(server) for _ in range(3)) for _ in range(3)
        ]  # 3 fresh connections
        assert codes == [200] * 5 + [429] * 4
        other = connect(server, source="127.0.0.2")  # another address has its own budget
        assert [ask(other) for _ in range(6)] == [200] * 5 + [429]
        holder = connect(server)  # a token holder from the first address is not held to it
        assert [ask(holder, auth=BEARER) for _ in range(10)] == [200] * 10
    finally:
        server.stop()


def test_the_address_table_is_bounded_and_forgets_the_least_recent():
    clock = SteppedClock()
    _, server = serve(
        rate_per_address=1, max_addresses=2, rate_per_connection=1e9, rate_total=1e9, clock=clock
    )
    try:
        first = connect(server, source="127.0.0.2")
        assert [ask(first), ask(first)] == [200, 429]
        for source in ("127.0.0.3", "127.0.0.4"):  # a third address: the first is forgotten
            assert ask(connect(server, source=source)) == 200
        assert server.httpd.admission()["addresses"] == 2
        assert ask(first) == 200  # forgotten, so its budget starts afresh
    finally:
        server.stop()


# --- the attack of issue 21 -----------------------------------------------------------------------


class Attack:
    """32 unauthenticated keep-alive connections that reconnect when closed, and a dozen readers
    looping on ``GET /state`` without a token, ignoring ``Retry-After``."""

    def __init__(
        self, server: ControlServer, clock: SteppedClock, idle: int = 32, readers: int = 12
    ) -> None:
        self.server, self.clock = server, clock
        self.stop = threading.Event()
        self.lock = threading.Condition()
        self.outcomes: Counter = Counter()
        self.reader_answers = 0
        self.started = [threading.Event() for _ in range(idle + readers)]  # each has had an answer
        self.threads = [
            threading.Thread(target=self._idle, args=(i,), daemon=True) for i in range(idle)
        ]
        self.threads += [
            threading.Thread(target=self._reader, args=(idle + i,), daemon=True)
            for i in range(readers)
        ]

    def __enter__(self) -> Attack:
        for t in self.threads:
            t.start()
        deadline = time.monotonic() + WAIT_S
        for started in self.started:
            while not started.wait(0.05):
                self.clock.t += (
                    0.05  # refused ones get their 503 once the pause is over on this clock
                )
                assert time.monotonic() < deadline, "an attacker never got an answer"
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(WAIT_S)

    def _note(self, i: int, outcome: int | str, reader: bool = False) -> None:
        with self.lock:
            self.outcomes[outcome] += 1
            self.reader_answers += reader
            self.lock.notify_all()
        self.started[i].set()

    def _connect(self) -> socket.socket | None:
        try:
            return socket.create_connection(("127.0.0.1", self.server.port), timeout=WAIT_S)
        except OSError:
            return None

    def _idle(self, i: int) -> None:
        while not self.stop.is_set():
            sock = self._connect()
            status = ask(sock) if sock is not None else 0
            self._note(i, status)
            if sock is not None:
                sock.settimeout(0.2)  # to notice the end of the test while holding the connection
            while status == 200 and not self.stop.is_set():  # hold it until the server closes it
                try:
                    if sock.recv(1) == b"":  # type: ignore[union-attr]  # status 200: connected
                        break
                except TimeoutError:
                    continue
                except OSError:
                    break
            if sock is not None:
                sock.close()
            if status != 200:
                self.stop.wait(0.1)  # refused: try again soon (a bound on this test's own CPU)

    def _reader(self, i: int) -> None:
        sock = None
        while not self.stop.is_set():
            sock = sock or self._connect()
            status = ask(sock, "/state?cursor=0") if sock is not None else 0
            self._note(i, status, reader=True)
            if status in (0, 503) and sock is not None:
                sock.close()
                sock = None
                self.stop.wait(0.1)
        if sock is not None:
            sock.close()

    def wait_for_readers(self, seen: int, more: int) -> int:
        """Waits until the readers have had ``more`` answers since ``seen``; their count now."""
        with self.lock:
            assert self.lock.wait_for(lambda: self.reader_answers >= seen + more, WAIT_S)
            return self.reader_answers


@pytest.mark.slow
def test_a_token_holder_keeps_polling_while_anonymous_clients_attack():
    clock = SteppedClock()
    # The limits the plugin runs with; the anonymous pause is real (1 s), the clock is not.
    _, server = serve(clock=clock, max_penalty_s=Limits().max_penalty_s)
    polls: Counter = Counter()
    try:
        with Attack(server, clock) as attack:
            clock.t += 2.0  # the idle attackers have been idle a while
            holder: http.client.HTTPConnection | None = None
            cursor, seen = 0, attack.reader_answers
            for _ in range(60):
                seen = attack.wait_for_readers(
                    seen, 2
                )  # each poll lands among the readers' requests
                clock.t += 0.1  # the collector's 10 Hz polls, or 1 Hz with its pages
                holder = holder or http.client.HTTPConnection(
                    "127.0.0.1", server.port, timeout=WAIT_S
                )
                try:
                    holder.request(
                        "GET", f"{PREFIX}/state?cursor={cursor}", headers={"Authorization": BEARER}
                    )
                    resp = holder.getresponse()
                    body = resp.read()
                    polls[resp.status] += 1
                    if resp.status == 200:
                        cursor = json.loads(body)["next_cursor"]
                except (OSError, http.client.HTTPException) as err:
                    polls[type(err).__name__] += 1
                    holder.close()
                    holder = None
            attackers = dict(attack.outcomes)
            assert polls[200] >= 0.95 * 60, (polls, attackers)
            assert cursor == 50
            # The attack was real (attackers were refused for want of slots), and it stayed within
            # the anonymous share while the token holder kept its connection.
            assert attackers.get(503, 0) > 0, attackers
            admission = server.httpd.admission()
            assert (
                admission["anonymous"] <= Limits().anonymous_connections and admission["token"] == 1
            ), admission
    finally:
        server.stop()


# --- the collector is a token holder --------------------------------------------------------------


def test_the_collectors_polls_carry_its_token_and_get_the_kept_slot(monkeypatch):
    """Every anonymous slot held by fresh connections: the collector, polling with the cluster
    file's token, is still answered; the same poll without the token is refused."""
    import asyncio

    from crafted_replica import CraftedReplica

    from controlplane.cluster import ClusterSpec, ReplicaSpec
    from controlplane.poller import poll_once

    monkeypatch.setenv("ADMISSION_TOKEN", TOKEN)
    clock = SteppedClock()
    _, server = serve(max_connections=4, clock=clock)  # 3 anonymous slots, 1 kept
    api = CraftedReplica("api")  # vLLM's own API server: serves /metrics
    control = f"http://127.0.0.1:{server.port}"
    try:
        anonymous = [connect(server) for _ in range(3)]
        assert [ask(s) for s in anonymous] == [200] * 3  # young: too fresh to be closed early

        def poll(token_env):
            spec = ReplicaSpec(name="r1", api_url=api.url, control_url=control, token_env=token_env)
            cluster = ClusterSpec(name="adm", timeout_s=5.0, replicas=[spec])
            return asyncio.run(poll_once(cluster))[0]

        refused = poll(None)
        assert not refused.health.healthy and "503" in (refused.health.reason or "")
        answered = poll("ADMISSION_TOKEN")
        assert answered.health.healthy, answered.health.reason
        assert [ask(s) for s in anonymous] == [200] * 3
    finally:
        api.close()
        server.stop()

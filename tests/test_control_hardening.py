"""The control API as a network neighbour would attack it: raw bytes over real sockets against the
real server (no vLLM). Every request gets an HTTP answer, nothing changes without a valid token
and document, and the server stays bounded in bytes read, time and connections."""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import threading

import httpx
import pytest
from core_target import CoreTarget  # tests/core_target.py
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from controlplane.cluster import ClusterSpec, ReplicaSpec
from controlplane.http import Answer
from controlplane.poller import ReplicaView
from controlplane.replica_http import fetch_state, make_client, read_json
from controlplane.steering import apply_settings
from scheduler.plugin.admission import Limits
from scheduler.plugin.api import PREFIX, ControlServer, token_from_env
from scheduler.plugin.core import PAGE_LIMIT, ReplicaCore
from scheduler.policies import RequestState
from scheduler.settings import Settings

TOKEN = "s3cret"
AUTH = f"Authorization: Bearer {TOKEN}\r\n"


class FrozenClock:
    """A monotonic clock that moves only when told: rate limits without timing."""

    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def serve(
    core: ReplicaCore | None = None, token: str | None = TOKEN, **limits
) -> tuple[ReplicaCore, ControlServer]:
    core = core or ReplicaCore(Settings(policy="fcfs"), replica="r1")
    limits.setdefault("max_penalty_s", 0.0)
    server = ControlServer(CoreTarget(core), port=0, token=token, limits=Limits(**limits)).start()
    return core, server


@pytest.fixture
def api():
    core, server = serve()
    yield core, server
    server.stop()


def exchange(
    server: ControlServer, data: bytes, *, half_close: bool = True, timeout: float = 10.0
) -> bytes:
    """Send raw bytes, then read until the server closes the connection."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=timeout) as sock:
        try:
            sock.sendall(data)
            if half_close:
                sock.shutdown(socket.SHUT_WR)
        except OSError:  # the server may close before taking all of a body it refused
            pass
        chunks = []
        while True:
            try:
                chunk = sock.recv(65536)
            except ConnectionResetError:
                break
            if not chunk:
                break
            chunks.append(chunk)
    return b"".join(chunks)


def responses(raw: bytes) -> list[tuple[int, dict]]:
    """(status, JSON body) of each HTTP response in ``raw``."""
    out = []
    while raw:
        head, _, rest = raw.partition(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        assert lines[0].startswith("HTTP/1.1 "), raw[:200]
        headers = dict(line.split(": ", 1) for line in lines[1:])
        n = int(headers["Content-Length"])
        body, raw = rest[:n], rest[n:]
        out.append((int(lines[0].split()[1]), json.loads(body) if body else {}))
    return out


def one(raw: bytes) -> tuple[int, dict]:
    [answer] = responses(raw)
    return answer


def put_raw(body: bytes, *, headers: str = AUTH, length: str | None = None) -> bytes:
    length = str(len(body)) if length is None else length
    cl = f"Content-Length: {length}\r\n" if length != "" else ""
    return f"PUT {PREFIX}/settings HTTP/1.1\r\nHost: x\r\n{headers}{cl}\r\n".encode() + body


# --- authentication before any body --------------------------------------------------------------


@pytest.mark.parametrize(
    "auth",
    [
        "",
        "Authorization: Bearer nope\r\n",
        "Authorization: Bearer \r\n",
        "Authorization: Basic czNjcmV0\r\n",
        "Authorization: Bearer ²\r\n",
    ],
)
def test_unauthorised_writes_are_refused_from_the_headers_without_reading_the_body(api, auth):
    core, server = api
    # A declared body far over the limit that is never sent: the answer cannot wait for it.
    for length in ("-1", str(300 << 20)):
        status, body = one(
            exchange(server, put_raw(b"", headers=auth, length=length), half_close=False)
        )
        assert status == 401 and "token" in body["error"]
    assert core.version == 1


@pytest.mark.parametrize("value", ["", " ", "\n", "\t \n"])
def test_an_empty_or_blank_token_is_no_token(monkeypatch, tmp_path, value, caplog):
    monkeypatch.setenv("TAILPILOT_TOKEN", value)
    assert token_from_env() is None
    monkeypatch.delenv("TAILPILOT_TOKEN")
    (tmp_path / "tok").write_text(value)
    monkeypatch.setenv("TAILPILOT_TOKEN_FILE", str(tmp_path / "tok"))
    assert token_from_env() is None
    with caplog.at_level(logging.WARNING, logger="tailpilot.control"):
        core, server = serve(token=value)
    try:
        assert "writes are refused" in caplog.text
        status, body = one(
            exchange(server, put_raw(b'{"policy": "las"}', headers="Authorization: Bearer \r\n"))
        )
        assert status == 403 and "no token configured" in body["error"]
        assert core.version == 1
    finally:
        server.stop()


# --- the body ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "length, status, words",
    [
        ("", 411, "Content-Length: required"),
        ("-1", 400, "Content-Length"),
        ("abc", 400, "Content-Length"),
        ("1" * 5000, 400, "Content-Length"),
        (str(64 * 1024 + 1), 413, "over the limit"),
    ],
)
def test_content_length_is_required_and_bounded(api, length, status, words):
    core, server = api
    got, body = one(exchange(server, put_raw(b"", length=length), half_close=False))
    assert got == status and words in body["error"]
    assert core.version == 1


def test_an_oversized_body_is_not_parsed_as_further_requests(api):
    core, server = api
    smuggled = f"GET {PREFIX}/health HTTP/1.1\r\nHost: x\r\n\r\n".encode() * 3000  # ~110 KB
    raw = exchange(server, put_raw(smuggled))
    assert [s for s, _ in responses(raw)] == [413]  # one answer, then the connection is closed
    assert core.version == 1


@pytest.mark.parametrize(
    "body, words",
    [
        (b"\xff\xfe{}", "not UTF-8"),
        (b"[" * 1000 + b"]" * 1000, "body"),
        (b'{"policy": "vtc", "params": {"weights": {"acme": Infinity}}}', "Infinity"),
        (b'{"policy": "las", "params": {"preempt_margin": NaN}}', "NaN"),
        (b'{"policy": "uniboost", "params": {"gamma": 1e999}}', "out of range"),
        (b'{"policy": "uniboost", "params": {"gamma": "5"}}', "params.gamma"),
        (b'{"policy": "uniboost", "params": {"gamma": true}}', "params.gamma"),
        (b'{"policy": "uniboost", "params": {"memguard": "yes"}}', "params.memguard"),
        (b'{"policy": "vtc", "params": {"weights": {"acme": "2"}}}', "params.weights.acme"),
        (b'{"policy": "fcfs", "engine": "bogus"}', "engine"),
        (b'{"policy": "fcfs", "engine": {"max_num_seqs": 8.0}}', "engine.max_num_seqs"),
        (b'{"policy": "uniboost", "pinned": 5}', "pinned"),
        (b'{"policy": "uniboost", "pinned": [["gamma"]]}', "pinned"),
        (b'["policy"]', "expected a settings object"),
        (b"{not json", "not JSON"),
        # Falsy values of the wrong type are not "no params" (only absent or null is).
        (b'{"policy": "uniboost", "params": []}', "params: must be an object"),
        (b'{"policy": "uniboost", "params": false}', "params: must be an object"),
        (b'{"policy": "uniboost", "params": ""}', "params: must be an object"),
        (b'{"policy": "uniboost", "pinned": false}', "pinned: must be a list"),
        (b'{"policy": "uniboost", "pinned": 0}', "pinned: must be a list"),
        # Ambiguous or costly JSON: which key counts; int() is quadratic in the digits.
        (b'{"policy": "fcfs", "policy": "las"}', "key 'policy' given more than once"),
        (b'{"policy": "vtc", "params": {"weights": {"a": 1.0, "a": 2.0}}}', "key 'a' given"),
        (b'{"policy": "uniboost", "params": {"gamma": 1' + b"0" * 5000 + b"}}", "5001 digits"),
        # Tenant and type names every reader can carry: the field and the name are named.
        (rb'{"policy": "vtc", "params": {"weights": {"\ud800": 1.0}}}', "params.weights"),
        (rb'{"policy": "slofq", "params": {"throttle": {"a\u0000b": 0.5}}}', "U+0000"),
        (rb'{"policy": "slofq", "params": {"tenants": {"": {}}}}', "must not be empty"),
        (
            b'{"policy": "slofq", "params": {"type_shares": {"' + b"t" * 101 + b'": 0.5}}}',
            "101 characters, over the limit of 100",
        ),
    ],
)
def test_malformed_or_non_finite_documents_are_400_naming_the_problem(api, body, words):
    core, server = api
    status, answer = one(exchange(server, put_raw(body)))
    assert status == 400 and words in answer["error"], answer
    assert core.version == 1 and core.settings.policy == "fcfs"


# The third value is ARABIC-INDIC DIGIT ONE on purpose: a hostile If-Match int() accepts.
@pytest.mark.parametrize(
    "if_match",
    ["1" * 5000, "²", "١", "1 2", "-1", "", '"1', '1"', "*", 'W/"1"'],  # noqa: RUF001
)
def test_a_malformed_if_match_is_400(api, if_match):
    core, server = api
    status, answer = one(
        exchange(server, put_raw(b'{"policy": "las"}', headers=AUTH + f"If-Match: {if_match}\r\n"))
    )
    assert status == 400 and "If-Match" in answer["error"]
    assert core.version == 1


def test_a_valid_write_still_works_and_an_etag_if_match_is_taken(api):
    _core, server = api
    status, answer = one(
        exchange(server, put_raw(b'{"policy": "las"}', headers=AUTH + 'If-Match: "1"\r\n'))
    )
    assert status == 200 and answer["version"] == 2


# --- requests http.server itself would answer with HTML or nothing -------------------------------


@pytest.mark.parametrize(
    "raw, status",
    [
        (b"GARBAGE\r\n\r\n", 400),
        (b"GET /\r\n\r\n", 400),  # HTTP/0.9-looking: still a status line and JSON
        (b"POST " + PREFIX.encode() + b"/settings HTTP/1.1\r\nContent-Length: 0\r\n\r\n", 405),
        (b"DELETE " + PREFIX.encode() + b"/settings HTTP/1.1\r\n\r\n", 405),
        (b"BREW /pot HTTP/1.1\r\n\r\n", 501),
        (
            b"GET "
            + PREFIX.encode()
            + b"/state HTTP/1.1\r\n"
            + b"X-Pad: "
            + b"a" * 20000
            + b"\r\n\r\n",
            431,
        ),
        (b"GET " + PREFIX.encode() + b"/state HTTP/1.1\r\n" + b"X: y\r\n" * 3000 + b"\r\n", 431),
        (b"GET /" + b"a" * 70000 + b" HTTP/1.1\r\n\r\n", 431),
    ],
    ids=[
        "garbage",
        "http0.9",
        "post",
        "delete",
        "brew",
        "long-header",
        "many-headers",
        "long-line",
    ],
)
def test_malformed_requests_get_a_json_4xx(api, raw, status):
    _, server = api
    got, body = one(exchange(server, raw))
    assert got == status and body["status"] == status and body["error"]


def head_of(raw: bytes) -> dict[str, str]:
    """The headers of the first response in ``raw``."""
    lines = raw.partition(b"\r\n\r\n")[0].decode("latin-1").split("\r\n")[1:]
    return dict(line.split(": ", 1) for line in lines)


@pytest.mark.parametrize("method", ["PUT", "GET"])
@pytest.mark.parametrize("lengths", [("17", "200"), ("17", "17"), ("0", "17")])
def test_repeated_content_length_is_400_and_the_rest_is_not_read_as_a_request(api, method, lengths):
    core, server = api
    body = b'{"policy": "las"}'  # 17 bytes, then a smuggled request
    smuggled = f"GET {PREFIX}/health HTTP/1.1\r\nHost: x\r\n\r\n".encode()
    cls = "".join(f"Content-Length: {n}\r\n" for n in lengths)
    raw = exchange(
        server,
        f"{method} {PREFIX}/settings HTTP/1.1\r\nHost: x\r\n{AUTH}{cls}\r\n".encode()
        + body
        + smuggled,
    )
    answers = responses(raw)
    assert [s for s, _ in answers] == [400], answers  # one answer, then the connection is closed
    assert "Content-Length: given 2 times" in answers[0][1]["error"]
    assert head_of(raw)["Connection"] == "close"
    assert core.version == 1


@pytest.mark.parametrize(
    "head, words",
    [
        # A line that is not a header ends the block for the parser; a reader that skips it sees
        # the Content-Length after it, and the "body" is a second request.
        ("Broken header line\r\nContent-Length: 43\r\n", "not 'Name: value'"),
        ("Content-Length : 43\r\n", "not 'Name: value'"),  # a space before the colon
        ("X-Pad: a\r\n  folded\r\nContent-Length: 43\r\n", "folded"),
        ("Content-Length: 43\r\nTransfer-Encoding: chunked\r\nTransfer-Encoding: x\r\n", "given 2"),
        ("Content-Length: 43\r\n" + AUTH, "Authorization: given 2 times"),
        ("Content-Length: 43\r\nIf-Match: 1\r\nIf-Match: 9\r\n", "If-Match: given 2 times"),
        ("Content-Length: 43\r\nHost: y\r\n", "Host: given 2 times"),
    ],
    ids=[
        "no-colon",
        "space-before-colon",
        "obs-fold",
        "te-twice",
        "auth-twice",
        "if-match",
        "host",
    ],
)
def test_a_header_block_another_reader_could_read_otherwise_is_400_and_nothing_is_smuggled(
    api, head, words
):
    core, server = api
    smuggled = f"PUT {PREFIX}/settings HTTP/1.1\r\nHost: x\r\n{AUTH}Content-Length: 17\r\n\r\n"
    raw = exchange(
        server,
        f"GET {PREFIX}/health HTTP/1.1\r\nHost: x\r\n{AUTH}{head}\r\n".encode()
        + smuggled.encode()
        + b'{"policy": "las"}',
    )
    answers = responses(raw)
    assert [s for s, _ in answers] == [400], answers  # one answer, then the connection is closed
    assert words in answers[0][1]["error"]
    assert core.version == 1 and core.settings.policy == "fcfs"


def test_text_utf8_cannot_carry_is_answered_escaped_never_a_500(api):
    """A lone surrogate in a tenant label (the plugin cleans labels; a target may not) is sent
    spelled as its escape: /state stays readable, and the collector's cursor can move on."""
    core, server = api
    s = RequestState(id="q\udc80", arrival=1.0, prompt_tokens=5, max_tokens=5, tenant="t\ud800")
    core.track(s, 1.0)
    s.generated = 5
    core.finish(s, 2.0)
    status, answer = one(exchange(server, f"GET {PREFIX}/state?cursor=0 HTTP/1.1\r\n\r\n".encode()))
    assert status == 200
    assert [(c["id"], c["tenant"]) for c in answer["completions"]] == [("q\\udc80", "t\\ud800")]


@pytest.mark.parametrize("scheme", ["bearer", "BEARER", "BeArEr"])
def test_the_auth_scheme_is_case_insensitive(api, scheme):
    core, server = api
    status, answer = one(
        exchange(
            server, put_raw(b'{"policy": "las"}', headers=f"Authorization: {scheme} {TOKEN}\r\n")
        )
    )
    assert status == 200 and answer["version"] == 2 and core.settings.policy == "las"


@pytest.mark.parametrize(
    "method, path, allowed",
    [
        ("POST", "/settings", "GET, PUT"),
        ("DELETE", "/settings", "GET, PUT"),
        ("PATCH", "/settings", "GET, PUT"),
        ("POST", "/state", "GET"),
        ("PUT", "/state", "GET"),
        ("PUT", "/steps", "GET"),
        ("HEAD", "/health", "GET"),
        ("OPTIONS", "/health", "GET"),
    ],
)
def test_405_names_the_method_and_the_allowed_ones(api, method, path, allowed):
    _, server = api
    raw = exchange(
        server,
        f"{method} {PREFIX}{path} HTTP/1.1\r\nHost: x\r\n{AUTH}Content-Length: 0\r\n\r\n".encode(),
    )
    assert raw.startswith(b"HTTP/1.1 405 ") and head_of(raw)["Allow"] == allowed
    if method != "HEAD":  # a HEAD answer has no body
        assert (
            one(raw)[1]["error"]
            == f"method {method} not allowed on {PREFIX}{path}; allowed: {allowed}"
        )


def test_an_unknown_path_is_404_whatever_the_method(api):
    _, server = api
    for method in ("POST", "PUT", "DELETE"):
        status, body = one(
            exchange(
                server,
                f"{method} /nope HTTP/1.1\r\nHost: x\r\n{AUTH}Content-Length: 0\r\n\r\n".encode(),
            )
        )
        assert status == 404 and "no such endpoint: /nope" in body["error"]


@pytest.mark.parametrize(
    "query, words",
    [
        ("cursor=", "cursor"),
        ("cursor=1&cursor=2", "2 times"),
        ("cursor=%D9%A3", "cursor"),  # Arabic-Indic 3
        ("cursor=-1", "cursor"),
        ("cursor=" + "9" * 30, "cursor"),
        ("limit=5", "unknown parameter"),
        ("&&", "query"),
    ],
)
def test_cursor_and_query_are_strict(api, query, words):
    _, server = api
    status, body = one(
        exchange(server, f"GET {PREFIX}/state?{query} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
    )
    assert status == 400 and words in body["error"], body


def test_a_get_with_a_body_closes_the_connection_instead_of_reading_it_as_a_request(api):
    _, server = api
    raw = exchange(
        server,
        f"GET {PREFIX}/health HTTP/1.1\r\nContent-Length: 44\r\n\r\n".encode()
        + f"GET {PREFIX}/health HTTP/1.1\r\nHost: x\r\n\r\n".encode(),
    )
    assert [s for s, _ in responses(raw)] == [200]


def test_keep_alive_serves_several_requests_on_one_connection(api):
    _, server = api
    req = f"GET {PREFIX}/health HTTP/1.1\r\nHost: x\r\n\r\n".encode()
    assert [s for s, _ in responses(exchange(server, req * 3))] == [200, 200, 200]


# --- the server's own failures -------------------------------------------------------------------


class Broken(CoreTarget):
    def api_state(self, cursor):
        raise RuntimeError("boom")

    def api_settings(self):
        return {"settings": {"gamma": float("inf")}, "version": 1, "replica": "r1"}


def test_handler_failures_are_500_and_logged_once_and_output_is_strict_json(caplog):
    core = ReplicaCore(Settings(policy="fcfs"))
    server = ControlServer(Broken(core), port=0, token=TOKEN).start()
    try:
        with caplog.at_level(logging.WARNING, logger="tailpilot.control"):
            for _ in range(3):
                status, body = one(
                    exchange(server, f"GET {PREFIX}/state HTTP/1.1\r\n\r\n".encode())
                )
                assert (
                    status == 500
                    and "RuntimeError" in body["error"]
                    and "boom" not in body["error"]
                )
        assert sum("RuntimeError" in r.getMessage() for r in caplog.records) == 1
        assert "Traceback" not in caplog.text
        raw = exchange(server, f"GET {PREFIX}/settings HTTP/1.1\r\n\r\n".encode())
        assert b"Infinity" not in raw and one(raw) == (
            200,
            {"settings": {"gamma": None}, "version": 1, "replica": "r1"},
        )
    finally:
        server.stop()


# --- bounded in connections, time and rate -------------------------------------------------------


def wait_closed(sock: socket.socket, timeout: float = 10.0) -> bytes:
    """Everything the server sends until it closes ``sock`` (an event, with a generous bound)."""
    sock.settimeout(timeout)
    data = b""
    while True:
        try:
            chunk = sock.recv(65536)
        except ConnectionResetError:
            return data
        if not chunk:
            return data
        data += chunk


def test_connections_over_the_cap_get_503_and_silent_ones_are_reaped():
    # Idle ages run on a frozen clock: on a loaded machine a second could pass between the four
    # connecting and the fifth, and an idle one would then be evicted to admit it (evict_idle_s),
    # which is tested elsewhere. The reaper's deadline is real time: 5 s for a first request
    # keeps the four open through a stall that long; its wait below is an event.
    _core, server = serve(max_connections=4, first_request_s=5.0, clock=FrozenClock())
    try:
        idle = [socket.create_connection(("127.0.0.1", server.port)) for _ in range(4)]
        # Over the cap: answered at once by the accept thread, without a handler thread.
        # (Accepting is sequential, so the four above are counted before this one.)
        extra = socket.create_connection(("127.0.0.1", server.port))
        status, body = one(wait_closed(extra))
        assert status == 503 and "too many connections" in body["error"]
        # The silent ones are closed by the reaper (they never sent a request line).
        for sock in idle:
            assert wait_closed(sock) == b""
            sock.close()
        r = httpx.get(server.url + "/health", trust_env=False, timeout=10)
        assert r.status_code == 200
    finally:
        server.stop()


def test_a_trickling_client_is_cut_off_at_the_request_deadline():
    core, server = serve(request_timeout_s=0.3)
    try:
        sock = socket.create_connection(("127.0.0.1", server.port))
        sock.sendall(
            f"PUT {PREFIX}/settings HTTP/1.1\r\n".encode()
        )  # the request line, then nothing
        assert wait_closed(sock) == b""
        sock.close()
        status, body = one(exchange(server, put_raw(b"{", length="100"), half_close=False))
        assert status == 408 and "body" in body["error"]  # a short body, cut off by the deadline
        assert core.version == 1
    finally:
        server.stop()


def test_rate_limited_readers_get_429_with_retry_after():
    clock = FrozenClock()
    # No share kept for token holders here: tests/test_control_admission.py covers that.
    _core, server = serve(rate_per_connection=5, rate_total=8, token_reserve=0.0, clock=clock)
    try:
        with httpx.Client(base_url=server.url, trust_env=False, timeout=10) as client:
            codes = [client.get("/health").status_code for _ in range(7)]
            assert codes == [200] * 5 + [429] * 2  # the connection's burst, then refused
            r = client.get("/health")
            assert (
                r.status_code == 429
                and r.headers["Retry-After"] == "1"
                and "slow down" in r.json()["error"]
            )
        with httpx.Client(base_url=server.url, trust_env=False, timeout=10) as other:
            # A second connection has its own burst, within what is left of the total (8 - 5).
            assert [other.get("/health").status_code for _ in range(4)] == [200] * 3 + [429]
        clock.t += 1.0  # a second later the buckets have refilled
        assert httpx.get(server.url + "/health", trust_env=False).status_code == 200
    finally:
        server.stop()


# --- /state is bounded; the collector pages ------------------------------------------------------


def finish_many(core: ReplicaCore, n: int) -> None:
    for i in range(n):
        s = RequestState(id=f"q{i}", arrival=float(i), prompt_tokens=5, max_tokens=5, tenant="a")
        core.track(s, float(i))
        s.generated = 5
        core.finish(s, float(i) + 1)


def test_state_sends_completions_only_for_a_cursor_and_at_most_a_page(api):
    core, server = api
    finish_many(core, 2 * PAGE_LIMIT + 10)
    with httpx.Client(base_url=server.url, trust_env=False, timeout=10) as client:
        bare = client.get("/state").json()
        assert (
            bare["completions"] == []
            and bare["next_cursor"] == 2 * PAGE_LIMIT + 10
            and not bare["more"]
        )
        page = client.get("/state", params={"cursor": 0}).json()
        assert (
            len(page["completions"]) == PAGE_LIMIT
            and page["more"]
            and page["next_cursor"] == PAGE_LIMIT
        )
        last = client.get("/state", params={"cursor": 2 * PAGE_LIMIT}).json()
        assert len(last["completions"]) == 10 and not last["more"]


def collector_read(server: ControlServer) -> tuple[ReplicaView, object]:
    """One collector read of a replica's state and completions: (its view, the answer)."""
    spec = ReplicaSpec(name="r1", api_url=server.base_url, control_url=server.base_url)
    view = ReplicaView(spec, window_s=60.0)

    async def go():
        client = make_client(ClusterSpec(name="c", replicas=[spec]))
        try:
            return await fetch_state(client, view, 5.0)
        finally:
            await client.aclose()

    return view, asyncio.run(go())


def test_the_collector_pages_through_a_backlog(api):
    core, server = api
    finish_many(core, 3 * PAGE_LIMIT + 7)
    _, answer = collector_read(server)
    assert [c.request_id for c in answer.completions] == [
        f"q{i}" for i in range(3 * PAGE_LIMIT + 7)
    ]
    assert answer.cursor == 3 * PAGE_LIMIT + 7


def test_the_collector_reads_non_finite_numbers_as_null_and_skips_broken_completions(api):
    assert read_json(Answer(200, b'{"a": NaN, "b": [Infinity, -Infinity, 1e999, 2.5]}'), "x") == {
        "a": None,
        "b": [None, None, None, 2.5],
    }

    class Hostile(CoreTarget):
        def api_state(self, cursor):
            doc = super().api_state(cursor)
            doc["completions"] = [
                {**c, "arrival": float("inf")} if c["id"] == "q1" else c for c in doc["completions"]
            ]
            return doc

    core = ReplicaCore(Settings(policy="fcfs"))
    finish_many(core, 3)
    server = ControlServer(Hostile(core), port=0, token=TOKEN).start()
    try:
        view, answer = collector_read(server)
    finally:
        server.stop()
    # The broken entry is left out (sent as null), the others are kept, and the cursor moves
    # past all.
    assert [c.request_id for c in answer.completions] == ["q0", "q2"] and answer.cursor == 3
    assert view.skipped_completions == 1


# --- "applied" means applied ---------------------------------------------------------------------


def cluster_of(server: ControlServer) -> ClusterSpec:
    return ClusterSpec(
        name="c",
        timeout_s=2.0,
        replicas=[
            ReplicaSpec(
                name="r1",
                api_url=server.base_url,
                control_url=server.base_url,
                token_env="TP_HARDEN_TOKEN",
            )
        ],
    )


def test_an_idle_replica_applies_at_once_and_set_reports_applied(api, monkeypatch):
    core, server = api
    monkeypatch.setenv("TP_HARDEN_TOKEN", TOKEN)
    [r] = asyncio.run(apply_settings(cluster_of(server), None, {"policy": "las"}))
    assert r.result == "applied" and r.version == 2 and "active" in r.message
    assert core.policy.name == "las" and core.active_version == 2  # without any step


def test_a_change_not_active_within_the_wait_is_reported_staged_then_applies(api, monkeypatch):
    core, server = api
    monkeypatch.setenv("TP_HARDEN_TOKEN", TOKEN)
    busy = RequestState(id="busy", arrival=0.0, prompt_tokens=5, max_tokens=5)
    core.track(busy, 0.0)  # work in flight and no step runs: the document stays staged
    [r] = asyncio.run(apply_settings(cluster_of(server), None, {"policy": "las"}, wait_s=0.2))
    assert (
        r.result == "staged" and r.ok and "not active yet" in r.message and "version 1" in r.message
    )
    assert core.policy.name == "fcfs"
    stepped = threading.Event()

    def step_soon():  # the engine's next step, while `set` waits
        core.begin_step(1.0)
        stepped.set()

    threading.Timer(0.05, step_soon).start()
    [r2] = asyncio.run(
        apply_settings(
            cluster_of(server), None, {"policy": "las", "params": {"starve_s": 4.0}}, wait_s=30.0
        )
    )
    assert stepped.is_set() and r2.result in ("applied", "staged")
    core.begin_step(2.0)
    assert core.policy.name == "las" and core.active_version == 3


# --- fuzz ----------------------------------------------------------------------------------------

METHODS = st.sampled_from(["GET", "PUT", "POST", "HEAD", "DELETE", "PUT", "PUT", "X"])
PATHS = st.sampled_from(
    [
        f"{PREFIX}/settings",
        f"{PREFIX}/state",
        f"{PREFIX}/steps",
        f"{PREFIX}/health",
        "/",
        "/metrics",
        f"{PREFIX}/state?cursor=0",
        f"{PREFIX}/state?cursor=x",
    ]
)
HEADER = st.tuples(
    st.sampled_from(
        ["Authorization", "Content-Length", "If-Match", "Transfer-Encoding", "Host", "X-Junk"]
    ),
    st.one_of(
        st.just(f"Bearer {TOKEN}"),
        st.just("Bearer "),
        st.text(max_size=30),
        st.integers(-5, 1 << 20).map(str),
        st.just("chunked"),
    ),
)
BODIES = st.one_of(
    st.binary(max_size=300),
    st.just(b'{"policy": "las"}'),
    st.builds(
        lambda g: json.dumps({"policy": "uniboost", "params": {"gamma": g}}).encode(),
        st.one_of(
            st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=5), st.booleans()
        ),
    ),
)


@pytest.fixture(scope="module")
def fuzz_api():
    core, server = serve(
        rate_per_connection=1e9, rate_total=1e9, rate_per_address=1e9
    )  # not a rate test
    yield core, server
    server.stop()


@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(method=METHODS, path=PATHS, headers=st.lists(HEADER, max_size=5), body=BODIES)
def test_fuzz_every_request_gets_an_answer_and_nothing_changes_without_token_and_document(
    fuzz_api, method, path, headers, body
):
    core, server = fuzz_api
    before = (core.version, core.settings)
    lines = "".join(f"{k}: {v}\r\n" for k, v in headers if "\r" not in v and "\n" not in v)
    raw = f"{method} {path} HTTP/1.1\r\nHost: x\r\n{lines}\r\n".encode("utf-8", "replace") + body
    answer = exchange(server, raw)
    assert answer.startswith(b"HTTP/1.1 "), (raw[:200], answer[:200])
    status = int(answer.split()[1])
    authorised = any(k == "Authorization" and v == f"Bearer {TOKEN}" for k, v in headers)
    if core.version != before[0]:  # a change needs the token, a PUT and a valid document
        assert method == "PUT" and path.endswith("/settings") and authorised and status == 200
        try:
            doc = json.loads(body)
        except ValueError:
            pytest.fail(f"state changed on an invalid body {body!r}")
        assert (
            Settings.model_validate({**doc, "engine": before[1].engine.model_dump()}).policy
            == core.settings.policy
        )
    else:
        assert status != 200 or method in ("GET", "PUT")
    # The server still serves.
    assert one(exchange(server, f"GET {PREFIX}/health HTTP/1.1\r\n\r\n".encode()))[0] == 200


def test_large_answers_cost_more_of_the_rate_limit(api):
    core, _ = api
    finish_many(core, PAGE_LIMIT)
    clock = FrozenClock()
    _, server = serve(
        core,
        rate_per_connection=20,
        rate_total=1000,
        rate_per_address=1e9,
        clock=clock,
        bytes_per_token=16 * 1024,
    )
    try:
        with httpx.Client(base_url=server.url, trust_env=False, timeout=10) as client:
            # A full page (~200 KB) costs ~13 requests' worth: the second page is already refused.
            codes = [client.get("/state", params={"cursor": 0}).status_code for _ in range(3)]
            assert codes == [200, 200, 429]
            # Small answers cost one each: 20 of them fit a fresh connection's burst.
        with httpx.Client(base_url=server.url, trust_env=False, timeout=10) as other:
            assert all(other.get("/health").status_code == 200 for _ in range(20))
    finally:
        server.stop()

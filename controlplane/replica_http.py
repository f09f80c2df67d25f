"""The collector's HTTP client for replicas: polls and settings writes, errors as one-line reasons,
and the reading of their answers (/state paged and fitted per entry, /metrics parsed off the loop).

Every answer is read as strict JSON (NaN, Infinity and numbers too big for a float are null: one
replica sending them must not break the store or the window), and every failure becomes a short
reason naming what was asked (``state: timeout after 2 s``), which the TUI and ``status`` show.

Every answer is read streamed, with a cap on its size (:data:`MAX_STATE_BYTES`,
:data:`MAX_METRICS_BYTES`; :data:`MAX_STEPS_BYTES` for the step log): an answer that never ends
costs the collector at most that much memory, however long the cluster's timeout, instead of
growing until the timeout ends it (``controlplane.http``: the session and the bounded reader;
``controlplane.retry``: a 429 is asked again, :data:`controlplane.retry.POLL_RATE_LIMITED`).
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol
from urllib.parse import urlencode

import aiohttp
from pydantic import BaseModel, ValidationError

from controlplane.cluster import ClusterSpec, ReplicaSpec
from controlplane.http import (
    TRANSPORT_ERRORS,
    Answer,
    AnswerTooLarge,
    async_client,
    describe_http_error,
    request,
    tls_context,
)
from controlplane.prom import MetricsFormatError, parse_vllm_metrics
from controlplane.retry import POLL_RATE_LIMITED, rate_limited
from scheduler import contract
from scheduler.errors import FAILED, TailpilotError
from scheduler.names import DEFAULT_TENANT, DEFAULT_TYPE, fold_name
from scheduler.validation import finite_or_none
from storage import limits
from storage.rows import CompletionRow

API_PREFIX = "/tailpilot/v1"
log = logging.getLogger("controlplane.collector")  # the collector's log: these are its reads

#: The largest /state answer read (also GET/PUT /settings, smaller still). A full page of 1,000
#: completions is ~0.35 MB (~0.6 MB with 200-character ids and 100-character tenant names): 4 MiB is
#: several times the largest a replica sends, and bounds what one broken or hostile replica can
#: make the recorder hold (its parsed objects are ~10x the bytes) to tens of MB.
MAX_STATE_BYTES = 4 * 1024 * 1024
#: The largest /steps page read (tuner.closed_loop.calibrate): a page of 1,000 step records is
#: ~0.15 MB.
MAX_STEPS_BYTES = 4 * 1024 * 1024
#: The largest vLLM /metrics page read. One engine's page is ~0.1 MB (~600 sample lines, mostly
#: histogram buckets); 8 MiB holds dozens of engines or models, and is read before parsing starts.
MAX_METRICS_BYTES = 8 * 1024 * 1024


def control_base(replica: ReplicaSpec) -> str:
    """``{control_url}/tailpilot/v1`` (a control_url that already ends with it is kept)."""
    url = replica.control_url.rstrip("/")
    return url if url.endswith(API_PREFIX) else url + API_PREFIX


def opt_int(x: Any) -> int | None:
    """``x`` as an int when it is a finite number (not a boolean) within a 64-bit column, else
    None (a metrics page may say NaN or +Inf)."""
    value = finite_or_none(x)
    if value is None or limits.int_problem(int(value), limits.INT64_RANGE) is not None:
        return None
    return int(value)


class StateFormatError(TailpilotError, ValueError):
    """A control API answer that is not the documented state document; the message names the
    field."""

    exit_code = FAILED


class PollingClient:
    """The collector's one HTTP client, for polls and settings writes alike: an aiohttp session
    (``controlplane.http.async_client``: no proxies from the environment, no cookies, no
    redirects) holding at most :data:`~controlplane.http.MAX_CONNECTIONS_PER_HOST` connections
    to each replica at a time, idle ones kept for the next poll (none with ``keepalive=False``).
    The session is made on first use: it binds to the running event loop."""

    def __init__(self, timeout_s: float, *, keepalive: bool = True) -> None:
        self._timeout_s = timeout_s
        self._keepalive = keepalive
        self._session: aiohttp.ClientSession | None = None

    async def ready(self) -> aiohttp.ClientSession:
        """The aiohttp session, made on first use. Call it before a request's own time bound
        starts: the first use in a process loads the TLS trust store, tens of milliseconds (more
        on a loaded machine), which is no replica's delay."""
        if self._session is None:
            # Loaded on a worker thread: the other replicas' polls do not wait for it.
            await asyncio.to_thread(tls_context)
            if self._session is None:  # another poll may have made it meanwhile
                self._session = async_client(self._timeout_s, keepalive=self._keepalive)
        return self._session

    async def _request(
        self,
        method: str,
        url: str,
        timeout_s: float,
        max_bytes: int,
        what: str,
        headers: Mapping[str, str],
        doc: Any = None,
    ) -> Answer:
        session = await self.ready()
        headers = dict(headers)
        body = None
        if doc is not None:
            # json.dumps' defaults: a value the replica refuses is its 4xx, not a client error.
            body = json.dumps(doc).encode()
            headers.setdefault("Content-Type", "application/json")
        return await request(
            session,
            method,
            url,
            max_bytes,
            what,
            headers=headers,
            body=body,
            timeout_s=None if timeout_s == self._timeout_s else timeout_s,
        )

    async def get(
        self,
        url: str,
        timeout_s: float,
        max_bytes: int = MAX_STATE_BYTES,
        what: str = "answer",
        headers: Mapping[str, str] | None = None,
    ) -> Answer:
        """GET ``url``; its body read streamed, :class:`~controlplane.http.AnswerTooLarge` past
        ``max_bytes`` (a declared Content-Length past it is refused before any of the body is
        read)."""
        return await self._request("GET", url, timeout_s, max_bytes, what, headers or {})

    async def put_json(
        self, url: str, doc: Any, headers: Mapping[str, str], timeout_s: float
    ) -> Answer:
        """PUT ``doc`` as JSON to ``url``; its answer read as :meth:`get` reads one."""
        return await self._request(
            "PUT", url, timeout_s, MAX_STATE_BYTES, "PUT settings", headers, doc
        )

    async def aclose(self) -> None:
        session, self._session = self._session, None
        if session is not None:
            await session.close()


def make_client(cluster: ClusterSpec) -> PollingClient:
    """The one async client for all replicas of a cluster (no proxies from the environment)."""
    return PollingClient(cluster.timeout_s)


class HttpFailure(TailpilotError):
    """A replica that did not answer 200 (``status``: its HTTP status, when one came back)."""

    exit_code = FAILED

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


def bearer(token: str | None) -> dict[str, str]:
    """The Authorization header for a control-API token (none without one). Reads carry it too:
    the control API keeps a share of its connections and rate for token holders."""
    return {"Authorization": f"Bearer {token}"} if token else {}


async def get_answer(
    client: PollingClient,
    url: str,
    what: str,
    timeout_s: float,
    params: dict[str, Any] | None = None,
    max_bytes: int = MAX_STATE_BYTES,
    token: str | None = None,
) -> Answer:
    """GET ``url`` (``params`` as its query), the whole request within ``timeout_s`` however the
    bytes trickle, a 429 asked again (:data:`~controlplane.retry.POLL_RATE_LIMITED`); the answer
    when it is 200, else :class:`HttpFailure` with a one-line reason naming ``what``."""
    if params:
        url = f"{url}?{urlencode(params)}"
    headers = bearer(token)
    await client.ready()
    try:
        async with asyncio.timeout(timeout_s):  # the whole request, however the bytes trickle
            resp: Answer = await POLL_RATE_LIMITED.call_async(
                lambda: client.get(url, timeout_s, max_bytes, what, headers), again=rate_limited
            )
    except AnswerTooLarge as err:
        raise HttpFailure(str(err)) from None
    except TRANSPORT_ERRORS as err:
        raise HttpFailure(describe_http_error(err, what, timeout_s)) from None
    if resp.status_code != 200:
        body = resp.text.strip().replace("\n", " ")
        body = body if len(body) <= 120 else body[:117] + "..."
        raise HttpFailure(
            f"{what}: HTTP {resp.status_code}" + (f" ({body})" if body else ""), resp.status_code
        )
    return resp


def read_json(resp: Answer, what: str, on_non_finite: Callable[[], None] | None = None) -> Any:
    """A replica's JSON, with NaN/Infinity (and numbers too big for a float) read as null: one
    replica sending them must not break the store (PostgreSQL refuses them) or the window.
    ``on_non_finite`` is called once for each number so read. An integer of more digits than
    Python converts (4,300) is bad JSON like any other, not an unexpected error."""

    def non_finite(_text: str) -> None:
        if on_non_finite is not None:
            on_non_finite()
        return None

    def finite_float(text: str) -> float | None:
        value = finite_or_none(float(text))
        if value is None:
            non_finite(text)
        return value

    try:
        return json.loads(resp.content, parse_constant=non_finite, parse_float=finite_float)
    except (ValueError, RecursionError) as err:  # JSONDecodeError, UnicodeDecodeError: ValueErrors
        raise StateFormatError(
            f"{what}: bad JSON ({type(err).__name__}: {str(err)[:120]})"
        ) from None


# --- a state document as the store can hold it -------------------------------------------------

#: Counts a replica reports (queue lengths, totals, versions): any integer past 64 bits is no
#: count a replica can have, and would break the arithmetic or the store; the columns' own ranges
#: (storage.limits) are applied where the figures are stored.
_STATE_COUNTS = (
    "settings_version",
    "pending_version",
    "waiting",
    "running",
    "preemptions_total",
    "recomputed_tokens_total",
    "refused_total",
    "finished_total",
    "steps_total",
)
_KV_COUNTS = ("used_blocks", "total_blocks", "block_size")
_BREAKER_COUNTS = ("trips_total", "failed_version", "fallback_version")


def fit_state(
    state: contract.State, declared: Mapping[str, Collection[str]] | None = None
) -> list[str]:
    """Null (in place) what a /state document (read through ``contract.State``) holds that the
    collector cannot use or store; the reasons, one per value (storage.limits.REASONS). The
    completions are fitted one by one elsewhere; ``next_cursor`` is checked by the caller.
    ``declared``: the cluster file's tenants and types, kept apart in the waiting counts
    whatever their number (``scheduler.names.fold_name``)."""
    reasons = _fit_numbers(state)
    for key, chars in (
        ("instance", limits.INSTANCE_CHARS),
        ("policy", limits.POLICY_CHARS),
        ("replica", None),
    ):
        value = getattr(state, key)
        if isinstance(value, str):
            _null(state, key, limits.text_problem(value, chars), reasons)
    breaker = state.breaker
    if breaker is not None and isinstance(breaker.last_error, str):
        breaker.last_error = limits.clean_text(breaker.last_error)[: contract.BREAKER_ERROR_CHARS]
    if state.settings is not None:
        _null(state, "settings", limits.settings_problem(state.settings), reasons)
    if state.live is not None:  # shown, never stored: only what the terminal cannot print is nulled
        _null(state, "live", limits.json_problem(state.live), reasons)
    declared = declared or {}
    if state.waiting_by_tenant is not None:
        state.waiting_by_tenant = _fit_counts_by_name(
            state.waiting_by_tenant, reasons, declared.get("tenant", ())
        )
    if state.waiting_by_type is not None:
        state.waiting_by_type = _fit_counts_by_name(
            state.waiting_by_type, reasons, declared.get("type", ())
        )
    return reasons


def _fit_numbers(state: contract.State) -> list[str]:
    """Null (in place) the counts a /state document holds out of range (negative, past 64 bits)
    and a KV usage outside 0..1; the reasons."""
    reasons: list[str] = []
    parts: list[tuple[BaseModel, tuple[str, ...]]] = [(state, _STATE_COUNTS)]
    if state.kv is not None:
        parts.append((state.kv, _KV_COUNTS))
    if state.breaker is not None:
        parts.append((state.breaker, _BREAKER_COUNTS))
    for part, keys in parts:
        for key in keys:
            _null(part, key, limits.int_problem(getattr(part, key), limits.COUNT_RANGE), reasons)
    if state.kv is not None:
        _null(state.kv, "usage", limits.fraction_problem(state.kv.usage), reasons)
    return reasons


def _null(where: BaseModel, key: str, problem: str | None, reasons: list[str]) -> None:
    """Null ``where.key`` and note why, when there is a ``problem``."""
    if problem is not None:
        setattr(where, key, None)
        reasons.append(problem)


def _fit_counts_by_name(
    counts: dict[str, int], reasons: list[str], declared: Collection[str] = ()
) -> dict[str, int]:
    """Waiting requests per tenant (or type): names bounded as the window bounds them (too long,
    not valid text, or past the cap of undeclared names: under OTHER_GROUP); counts past 64 bits
    dropped."""
    out: dict[str, int] = {}
    for name, n in counts.items():
        if limits.int_problem(n, limits.INT64_RANGE) is not None:
            reasons.append(limits.OUT_OF_RANGE)
            continue
        group, why = limits.group_name(name)
        if why is not None:
            reasons.append(why)
        else:
            group = fold_name(group, out, declared)
        out[group] = out.get(group, 0) + n
    return out


# --- reading a replica's answers: /state (paged, fitted per entry) and /metrics -----------------

#: The control API returns at most a page of completions per answer and says ``more`` when
#: another follows (a replica without that flag: a page of this size means more are waiting).
STATE_PAGE_LIMIT = 1_000
MAX_PAGES_PER_POLL = 16  # within the control API's per-connection burst


class StateReader(Protocol):
    """What :func:`fetch_state` needs of the collector's view of a replica."""

    name: str
    spec: ReplicaSpec
    cursor: int
    declared: Mapping[str, Collection[str]]  # the cluster file's tenants and types

    def restarted(self, doc: contract.State) -> str | None: ...

    def seen_id(self, key: int) -> bool: ...

    def count(self, rejected: Mapping[str, int], skipped: int = 0) -> None: ...


def completion_row(replica: str, c: Any) -> CompletionRow:
    """One completions-log entry (``contract.Completion``) as a row; ValueError for a malformed
    one."""
    try:
        comp = contract.read(contract.Completion, c, lenient=False)
    except ValidationError as err:
        raise ValueError(contract.describe(err)) from None
    return CompletionRow(
        replica=replica,
        request_id=comp.id,
        tenant=comp.tenant or DEFAULT_TENANT,
        type=comp.type or DEFAULT_TYPE,
        arrival_s=comp.arrival,
        received_s=comp.received_at,
        first_token_s=comp.first_token_at,
        finished_s=comp.finished_at,
        prompt_tokens=comp.prompt_tokens,
        output_tokens=comp.output_tokens,
        preemptions=comp.preemptions,
        recomputed_tokens=comp.recomputed_tokens,
        reason=comp.reason or "finished",
        # The client's cap; replicas from before it was logged send none.
        max_tokens=comp.max_tokens,
    )


def read_state(
    doc: Any,
    rejected: dict[str, int] | None = None,
    declared: Mapping[str, Collection[str]] | None = None,
) -> contract.State:
    """A /state document read through ``contract.State`` (leniently: a broken optional field is
    null) and fitted to what the store holds (storage.limits; what was nulled counted in
    ``rejected``; ``declared`` tenants and types kept apart); StateFormatError naming the field a
    reader cannot do without."""
    if not isinstance(doc, dict):
        raise StateFormatError(f"bad state document: expected an object, got {type(doc).__name__}")
    try:
        state: contract.State = contract.read(contract.State, doc)
    except ValidationError as err:
        raise StateFormatError(f"bad state document: {contract.describe(err)}") from None
    if limits.int_problem(state.next_cursor, limits.CURSOR_RANGE) is not None:
        # The cursor is stored with the rows it covers: a page that cannot be is not taken at all.
        raise StateFormatError(
            "bad state document: next_cursor is beyond what the store holds "
            f"({limits.CURSOR_RANGE[1]})"
        )
    for reason in fit_state(state, declared):
        count_into(rejected, reason)
    return state


def count_into(counts: dict[str, int] | None, reason: str, n: int = 1) -> None:
    """Count ``n`` values not stored as sent for ``reason`` (no-op without ``counts``)."""
    if counts is not None:
        counts[reason] = counts.get(reason, 0) + n


@dataclass(slots=True)
class StateAnswer:
    """What one poll read of a replica's /state: its newest document and the completions since the
    view's cursor, fitted (storage.limits)."""

    doc: contract.State | None  # None: no page read yet
    completions: list[CompletionRow]
    cursor: int  # the cursor after ``completions``
    restarted: str | None = None  # why the replica is taken to have restarted (read from 0)
    rejected: dict[str, int] = field(default_factory=dict)  # values not stored as sent, per reason
    skipped: int = 0  # completions-log entries left out
    ids: list[int] = field(default_factory=list)  # hashes of the request ids of ``completions``


def _take_completions(
    view: StateReader, answer: StateAnswer, entries: list[Any], this_poll: set[int]
) -> str | None:
    """Add a page's completions-log ``entries`` to ``answer``, each checked before the cursor moves
    past it: one that cannot be stored is skipped (or a field nulled) and counted, the rest of the
    page is kept, and a replica that keeps sending a broken entry does not stall its own recording
    behind it. The first reason an entry was skipped (None: none was, or only repeated ids)."""
    why = None
    rejected = answer.rejected
    for c in entries:
        try:
            row = completion_row(view.name, c)
        except (KeyError, TypeError, ValueError, AttributeError) as err:
            answer.skipped += 1
            count_into(rejected, limits.MALFORMED)
            why = why or f"{type(err).__name__}: {str(err)[:80]}"
            continue
        fitted, reasons = limits.fit_completion(row)
        for reason in reasons:
            count_into(rejected, reason)
        if fitted is None:
            answer.skipped += 1
            why = why or f"an entry the store cannot hold ({reasons[0]})"
            continue
        key = hash(fitted.request_id)
        if key in this_poll or view.seen_id(key):
            # The store keeps the first of an id: count the repeat, do not hide it.
            answer.skipped += 1
            count_into(rejected, limits.DUPLICATE_ID)
            continue
        this_poll.add(key)
        answer.ids.append(key)
        answer.completions.append(fitted)
    return why


async def fetch_state(client: PollingClient, view: StateReader, timeout_s: float) -> StateAnswer:
    """The state document and the completions since ``view.cursor``; changes nothing in ``view``
    but its counts of what could not be stored as sent (its ``count``).

    Pages through a backlog; reads from cursor 0 when the replica restarted."""
    url = control_base(view.spec) + "/state"
    answer = StateAnswer(None, [], view.cursor)
    rejected = answer.rejected
    this_poll: set[int] = set()
    why = None
    # The document's own fields: counted once a poll, from the page used.
    state_rejected: dict[str, int] = {}

    def non_finite() -> None:
        count_into(rejected, limits.NON_FINITE)

    for page in range(MAX_PAGES_PER_POLL + 1):
        try:
            resp = await get_answer(
                client, url, "state", timeout_s, {"cursor": answer.cursor}, token=view.spec.token()
            )
        except HttpFailure as err:
            if page == 0 or err.status != 429:
                raise
            break  # the replica rate-limits a long backlog: keep what came, read on next poll
        try:
            page_rejected: dict[str, int] = {}
            doc = read_state(read_json(resp, "state", non_finite), page_rejected, view.declared)
        except StateFormatError:
            if page == 0:
                raise
            break  # keep the pages read, with their cursor; the next poll meets this page first
        answer.doc, state_rejected = doc, page_rejected
        if answer.restarted is None and not answer.completions:
            restarted = view.restarted(doc)
            if restarted:  # read the new incarnation from its beginning
                answer.restarted, answer.cursor = restarted, 0
                continue
        page_why = _take_completions(view, answer, doc.completions, this_poll)
        why = why or page_why
        answer.cursor = max(answer.cursor, doc.next_cursor)
        if doc.more is False or (doc.more is None and len(doc.completions) < STATE_PAGE_LIMIT):
            break
    for reason, n in state_rejected.items():
        count_into(rejected, reason, n)
    # Counted as read: the counts are what was sent, applied or not.
    view.count(rejected, answer.skipped)
    if answer.skipped:
        log.warning(
            "replica %s: skipped %d completion entries (%s)",
            view.name,
            answer.skipped,
            why or "repeated request ids",
        )
    return answer


async def fetch_metrics(
    client: PollingClient, spec: ReplicaSpec, timeout_s: float
) -> dict[str, float]:
    resp = await get_answer(
        client, spec.metrics_url, "metrics", timeout_s, max_bytes=MAX_METRICS_BYTES
    )
    # Parsed on a worker thread: a page near its caps takes tens of milliseconds, which the event
    # loop (every other replica's polls, the writer, the /metrics page) must not wait for.
    metrics = await asyncio.to_thread(parse_metrics_page, resp)
    if not metrics:
        raise MetricsFormatError("metrics: no vLLM metrics on the page (is api_url a vLLM server?)")
    return metrics


def parse_metrics_page(resp: Answer) -> dict[str, float]:
    return parse_vllm_metrics(resp.text)


async def fetch_inflight(
    client: PollingClient, spec: ReplicaSpec, timeout_s: float, limit: int = contract.INFLIGHT_LIMIT
) -> contract.Inflight:
    """The replica's oldest ``limit`` requests in flight (``GET /inflight``), read through the
    contract strictly on its required fields; ``StateFormatError`` naming the field otherwise,
    ``HttpFailure`` when it did not answer 200."""
    resp = await get_answer(
        client,
        control_base(spec) + "/inflight",
        "inflight",
        timeout_s,
        {"limit": limit},
        token=spec.token(),
    )
    try:
        inflight: contract.Inflight = contract.read(contract.Inflight, read_json(resp, "inflight"))
        return inflight
    except ValidationError as err:
        raise StateFormatError(f"inflight: {contract.describe(err)}") from None

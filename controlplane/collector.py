"""The live collector: polls every replica of a cluster and turns what it sees into rows.

For each replica, every ``poll_interval_s``:

* ``GET {control_url}/tailpilot/v1/state?cursor=N`` — queue, KV, live γ/β, counters, the settings
  document and the completions finished since cursor ``N`` (docs/control-api.md);
* ``GET {api_url}/metrics`` — vLLM's Prometheus page, parsed with ``prometheus_client``'s parser
  through :data:`VLLM_METRICS`, a table of the metric names different vLLM versions use.

From the per-request completions it keeps a rolling window (``window_s`` of the cluster, on the
replica's own clock) and computes **exact** P50/P90/P95/P99 of TTFT, TTLT and TBT per replica, per
tenant and per request type with :func:`scheduler.metrics.distribution_stats` — no histogram
interpolation. The results are :class:`storage.rows.SampleRow` / ``GroupSampleRow`` /
``CompletionRow``, written by one writer task as one :class:`storage.rows.Batch` per flush.

Rooms: the Prometheus page is parsed in ``controlplane/prom.py``; the HTTP client, its errors,
strict JSON and the reading of /state and /metrics (bounded in bytes, every entry fitted to what the
store holds: ``storage/limits.py``) are ``controlplane/replica_http.py``; settings changes (``tailpilot set``) are
``controlplane/steering.py``; the rolling window and its exact percentiles
``controlplane/window.py``; this module keeps the per-replica views and the poll loop.

Concurrency: one client for all replicas (:class:`PollingClient`, one aiohttp session for polls
and settings writes); one task per replica that polls and then
sleeps to its next tick, so a poll never overlaps the previous one of the same replica and a slow
replica (bounded by the cluster's ``timeout_s``) only delays itself.

Isolation: what one replica sends costs only its own values. Every entry is fitted before the
cursor moves past it (a value no column holds is nulled or its entry skipped, counted per reason in
``ReplicaView.rejected``; repeated request ids are counted too), a page whose cursor the store cannot
hold marks only that replica unhealthy, and its /state and /metrics answers are read with caps.
When a replica's circuit breaker trips (its /state ``breaker``), one settings-audit row is written
per increase (``who="engine"``, ``result="breaker"``), with the batch, never twice across restarts.

Exactly-once: a replica's cursor is persisted in the same transaction as the completions it covers
(``Batch.cursors``); a batch the store refuses (``StoreBusy``) is kept and retried with the next,
never dropped. On start the cursors come from the store, each with the replica instance it counts
in. A replica that restarted (its /state ``instance`` changed, its counters went backwards, or it
has fewer completions than our cursor) is read again from cursor 0; the store's unique key on
(replica, request id) absorbs any re-delivery. The instance is what catches a restart while no
collector ran that has since completed more requests than the stored cursor.

A replica without the tailpilot plugin (the control API answers 404) still gives a sample from
``/metrics`` alone: it stays healthy, with ``reason`` saying "metrics only: no tailpilot control
API", and its latency percentiles are empty (vLLM's histograms cannot give exact tails).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections import deque
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Iterable, Mapping

import numpy as np

from controlplane.cluster import ClusterSpec, ReplicaSpec
from controlplane.governance import AlertEvaluator
from controlplane.governance import report as governance_report
from controlplane.prom import VLLM_METRICS, MetricsFormatError, parse_vllm_metrics
from controlplane.replica_http import (  # noqa: F401 (re-exported)
    API_PREFIX,
    MAX_PAGES_PER_POLL,
    STATE_PAGE_LIMIT,
    PollingClient,
    StateAnswer,
    StateFormatError,
    _get,
    HttpFailure,
    _json,
    _opt_int,
    _Resp,
    completion_row,
    control_base,
    count_into,
    fetch_metrics,
    fetch_state,
    make_client,
    read_state,
)
from controlplane.window import _Rate, _Window, governance_columns, latency_percentiles  # noqa: F401 (re-exported)
from storage import limits
from storage.rows import (
    BREAKER_RESULT,
    BREAKER_WHO,
    AlertRow,
    Batch,
    CompletionRow,
    GovernanceRow,
    GroupSampleRow,
    SampleRow,
    SettingsChangeRow,
    SettingsSeenRow,
)

__all__ = [
    "VLLM_METRICS",
    "MetricsFormatError",
    "StateFormatError",
    "parse_vllm_metrics",
    "control_base",
    "Health",
    "ReplicaSnapshot",
    "ClusterSnapshot",
    "ReplicaView",
    "PollResult",
    "latency_percentiles",
    "PollingClient",
    "make_client",
    "CollectorStats",
    "Collector",
    "poll_once",
    "poll_cluster_once",
    "ApplyResult",
    "apply_settings",
]

#: Request ids of a replica remembered to count the completions that repeat one (the store keeps
#: the first of an id and drops the rest). One poll's most pages (16 x 1,000): a repeat within a
#: poll, or from the poll before, is always caught; ~1 MB per replica (hashes, not the ids).
RECENT_IDS_REMEMBERED = MAX_PAGES_PER_POLL * STATE_PAGE_LIMIT
log = logging.getLogger(__name__)


# --------------------------------------------------------------------------------------------
# Per-replica state
# --------------------------------------------------------------------------------------------




@dataclass(slots=True)
class Health:
    healthy: bool = False
    reason: str | None = "not polled yet"
    since: float | None = None  # collector clock, when this health state began
    failures: int = 0  # consecutive failed polls
    mode: str = "unknown"  # "plugin" | "metrics-only" | "unknown"
    last_ok: float | None = None  # collector clock of the last successful poll


@dataclass(slots=True)
class ReplicaSnapshot:
    """Everything known about one replica after its latest poll (what the TUI shows)."""

    name: str
    health: Health
    sample: SampleRow | None
    groups: list[GroupSampleRow]
    settings: dict[str, Any] | None  # the active settings document
    settings_version: int | None
    state: dict[str, Any] | None  # the last /state document, without its completions
    metrics: dict[str, float]  # the last parsed /metrics (logical names)
    cursor: int
    window_completions: int
    # What the collector could not store as this replica sent it, per reason (storage.limits.REASONS).
    rejected: dict[str, int] = field(default_factory=dict)
    # The replica's circuit breaker as its last /state reported it (contract.Breaker), None when not.
    breaker: dict[str, Any] | None = None


@dataclass(slots=True)
class ClusterSnapshot:
    cluster: str
    t_ms: int
    replicas: dict[str, ReplicaSnapshot]
    # The newest governance report (controlplane.governance.report, with "alerts": firing alert
    # -> severity), or None when the cluster is not governed.
    governance: dict[str, Any] | None = None


def _opt_float(x: Any) -> float | None:
    return float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) else None


@dataclass(slots=True)
class PollResult:
    """What one poll of one replica produced (rows for the writer)."""

    sample: SampleRow
    groups: list[GroupSampleRow]
    completions: list[CompletionRow]
    cursor: int | None  # the cursor after ``completions``; None when the state poll failed
    instance: str | None = None  # the replica instance ``cursor`` counts in, when it reports one
    settings_seen: SettingsSeenRow | None = None  # the settings document, when its version or instance is new
    breaker_trip: SettingsChangeRow | None = None  # an audit row, when the replica's breaker tripped again


class ReplicaView:
    """One replica as the collector sees it: health, last documents, cursor and window.

    State documents reach it as ``replica_http.read_state`` returns them, already read through
    ``contract.State`` (every field of its type, or null) and fitted to what the store holds
    (``storage.limits``): they are used as they are. Only the /metrics numbers are checked here."""

    def __init__(self, spec: ReplicaSpec, window_s: float, cursor: int = 0, instance: str | None = None,
                 reserved: Mapping[str, Iterable[str]] | None = None) -> None:
        self.spec = spec
        self.name = spec.name
        self.window_s = float(window_s)
        self.health = Health()
        self.state: dict[str, Any] | None = None  # last /state document, without completions
        self.metrics: dict[str, float] = {}
        self.metrics_error: str | None = None  # the last /metrics poll's error
        self.cursor = int(cursor)
        self.instance = instance  # the replica incarnation ``cursor`` counts in (None: not known)
        self._settings_key: tuple[str | None, int | None] | None = None  # (instance, version) last stored
        self.window = _Window(reserved=reserved)
        self.sample: SampleRow | None = None
        self.groups: list[GroupSampleRow] = []
        self.polls = 0
        self.restarts = 0
        self.skipped_completions = 0  # completions-log entries left out (malformed, unstorable, repeated)
        # Values not stored as sent, per reason (storage.limits.REASONS): an entry skipped or a field nulled.
        self.rejected: dict[str, int] = {}
        # Hashes of the newest request ids read (RECENT_IDS_REMEMBERED), to count repeats.
        self._recent_ids: deque[int] = deque()
        self._recent_set: set[int] = set()
        # (instance, trips) of the breaker's newest trip written to the audit log; None: none known.
        self.breaker_recorded: tuple[str | None, int] | None = None
        self.last_restart: tuple[float, str] | None = None  # (collector clock, why)
        self._coverage_start: float | None = None  # replica clock: since when the window is complete
        self._resumed = cursor > 0
        self._last_finished_total: int | None = None
        self._last_steps_total: int | None = None
        self._preemptions = _Rate()
        self._gen_tokens = _Rate()
        self._requests = _Rate()

    # --- the state document -----------------------------------------------------------------
    def restarted(self, doc: Mapping[str, Any]) -> str | None:
        """Why ``doc`` shows the replica restarted since the last poll (None if it did not)."""
        finished, steps = doc.get("finished_total"), doc.get("steps_total")
        instance = doc.get("instance") or None
        if instance is not None and self.instance is not None and instance != self.instance:
            return f"instance changed from {self.instance} to {instance}"
        if finished is not None and finished < self.cursor:
            return f"finished_total {finished} < cursor {self.cursor}"
        if doc["next_cursor"] < self.cursor:
            return f"next_cursor {doc['next_cursor']} < cursor {self.cursor}"
        if finished is not None and self._last_finished_total is not None and finished < self._last_finished_total:
            return f"finished_total went back from {self._last_finished_total} to {finished}"
        if steps is not None and self._last_steps_total is not None and steps < self._last_steps_total:
            return f"steps_total went back from {self._last_steps_total} to {steps}"
        return None

    def reset_for_restart(self) -> None:
        self.restarts += 1
        self.cursor = 0
        self.window.clear()
        self._coverage_start = None
        self._resumed = False
        self._last_finished_total = self._last_steps_total = None
        for rate in (self._preemptions, self._gen_tokens, self._requests):
            rate.clear()

    def _remember_counters(self, doc: Mapping[str, Any]) -> None:
        self._last_finished_total = doc.get("finished_total")
        self._last_steps_total = doc.get("steps_total")

    # --- building rows ----------------------------------------------------------------------
    def build(self, t: float, answer: "StateAnswer | None", metrics: dict[str, float] | None,
              errors: list[str], no_plugin: str | None) -> PollResult:
        """Fold one poll's answers into the view and return its rows. ``t`` is the collector clock."""
        t_ms = int(round(t * 1000))
        self.polls += 1
        state: dict[str, Any] | None = None
        completions: list[CompletionRow] = []
        if answer is not None:
            if answer.restarted:
                self.reset_for_restart()
                self.last_restart = (t, answer.restarted)
            self.cursor = answer.cursor
            self.instance = answer.doc.get("instance") or self.instance
            state, completions = answer.doc, answer.completions
            self._remember_ids(answer.ids)
        if metrics is not None:
            self.metrics = metrics
        m = metrics or {}
        row = SampleRow(replica=self.name, t_ms=t_ms, healthy=not errors,
                        reason="; ".join(errors) if errors else None)
        groups: list[GroupSampleRow] = []
        seen: SettingsSeenRow | None = None
        trip: SettingsChangeRow | None = None
        if state is not None:
            self.state = {k: v for k, v in state.items() if k != "completions"}
            self._remember_counters(state)
            seen = self._settings_seen(state, t_ms)
            trip = self._breaker_trip(state.get("breaker"), t_ms)
            now_r = state.get("time")
            if now_r is None:  # a document without a clock: fall back to the newest finish / ours
                now_r = max([c.finished_s for c in completions] + [t])
            if self._coverage_start is None:
                if self._resumed or not completions:
                    self._coverage_start = now_r
                else:
                    self._coverage_start = min(now_r, min(c.arrival_s for c in completions))
            # Trimmed first too: names that left the window free their place in its cap before new ones come.
            self.window.trim(now_r - self.window_s)
            self.window.add(completions)
            self.window.trim(now_r - self.window_s)
            duration = min(self.window_s, now_r - self._coverage_start)
            groups = self._fill_from_state(row, state, now_r, duration, t_ms)
        elif metrics is not None:  # no plugin, or its control API failed this time
            row.waiting = _opt_int(m.get("waiting"))
            row.running = _opt_int(m.get("running"))
            row.kv_usage = _opt_float(m.get("kv_usage"))
            if no_plugin:  # counter rates on our clock (a plugin replica's are on its own clock)
                row.preemptions_per_s = self._preemptions.add(t, m.get("preemptions_total"), self.window_s)
                row.throughput_tok_s = self._gen_tokens.add(t, m.get("generation_tokens_total"), self.window_s)
                row.throughput_req_s = self._requests.add(t, m.get("requests_total"), self.window_s)
        if no_plugin and not errors:
            row.reason = no_plugin
        for reason in limits.fit_sample(row):
            count_into(self.rejected, reason)
        row.rejected = dict(self.rejected) or None  # a copy: the row is written later, off the loop
        self._set_health(t, row.healthy, row.reason, "metrics-only" if no_plugin else
                         ("plugin" if state is not None else self.health.mode))
        self.sample, self.groups = row, groups
        return PollResult(row, groups, completions, self.cursor if state is not None else None,
                          self.instance if state is not None else None, seen, trip)

    # --- counts, request ids, the circuit breaker ---------------------------------------------
    def count(self, rejected: Mapping[str, int], skipped: int = 0) -> None:
        """Add what one answer held that could not be stored as sent (per reason), and the
        completions-log entries it left out."""
        for reason, n in rejected.items():
            count_into(self.rejected, reason, n)
        self.skipped_completions += skipped

    def seen_id(self, key: int) -> bool:
        """Whether a request id (its hash) was among the newest read."""
        return key in self._recent_set

    def _remember_ids(self, keys: list[int]) -> None:
        ids, members = self._recent_ids, self._recent_set
        for key in keys:
            ids.append(key)
            members.add(key)
        while len(ids) > RECENT_IDS_REMEMBERED:
            members.discard(ids.popleft())

    def _breaker_trip(self, breaker: Mapping[str, Any] | None, t_ms: int) -> SettingsChangeRow | None:
        """An audit row when the replica's breaker tripped since the newest trip recorded (its
        counter starts again with each instance); None otherwise."""
        trips = (breaker or {}).get("trips_total")
        if breaker is None or not isinstance(trips, int):
            return None
        recorded = self.breaker_recorded
        before = 0
        if recorded is not None and (recorded[0] == self.instance or None in (recorded[0], self.instance)):
            before = recorded[1] if recorded[1] <= trips else 0  # fewer: a restart without an instance
        self.breaker_recorded = (self.instance, trips)
        if trips <= before:
            return None
        new = trips - before
        failed, fallback = breaker.get("failed_version"), breaker.get("fallback_version")
        to = f"settings v{fallback}" if fallback is not None else "vLLM's stock order"
        message = (f"a policy raised in the engine's step ({breaker.get('last_error') or 'no error reported'}); "
                   f"settings v{failed if failed is not None else '?'} replaced by {to} "
                   f"({new} new trip{'s' if new > 1 else ''}, {trips} since the replica started)")
        version = failed if limits.int_problem(failed, limits.VERSION_RANGE) is None else None
        return SettingsChangeRow(
            replica=self.name, t_ms=t_ms, who=BREAKER_WHO, result=BREAKER_RESULT, message=message, version=version,
            new={"trips_total": trips, "new_trips": new, "instance": self.instance, "failed_version": failed,
                 "fallback_version": fallback, "last_error": breaker.get("last_error"),
                 "last_at": breaker.get("last_at")})

    def _settings_seen(self, state: Mapping[str, Any], t_ms: int) -> SettingsSeenRow | None:
        """The settings document as a row when this (instance, version) was not stored yet."""
        settings, version = state.get("settings"), state.get("settings_version")
        if limits.int_problem(version, limits.VERSION_RANGE) is not None:
            version = None  # counted where the sample nulls it (the same figure, the same column type)
        key = (self.instance, version)
        if settings is None or key == self._settings_key:
            return None
        self._settings_key = key
        return SettingsSeenRow(self.name, t_ms, key[1], key[0], settings)

    def _fill_from_state(self, row: SampleRow, s: dict[str, Any], now_r: float, duration: float,
                         t_ms: int) -> list[GroupSampleRow]:
        m = self.metrics
        kv = s.get("kv") or {}
        row.policy = s.get("policy")
        row.settings_version = s.get("settings_version")
        row.waiting, row.running = s.get("waiting"), s.get("running")
        row.kv_used_blocks, row.kv_total_blocks = kv.get("used_blocks"), kv.get("total_blocks")
        row.kv_usage = kv.get("usage")
        if row.kv_usage is None:
            row.kv_usage = _opt_float(m.get("kv_usage"))
        row.gamma_live, row.beta_live = s.get("gamma_live"), s.get("beta_live")
        preemptions = s.get("preemptions_total")
        if preemptions is None:
            preemptions = _opt_float(m.get("preemptions_total"))
        row.preemptions_per_s = self._preemptions.add(now_r, preemptions, self.window_s)
        w = self.window
        if duration > 0:
            row.throughput_tok_s = float(w.out_tokens.sum()) / duration
            row.throughput_req_s = len(w) / duration
        row.latency = latency_percentiles(w.ttft, w.ttlt, w.tbt)
        row.breaker_trips = (s.get("breaker") or {}).get("trips_total")
        groups: list[GroupSampleRow] = []
        if len(w) == 0:
            return groups
        for kind, codes in (("tenant", w.tenant), ("type", w.type)):
            names = w.names(kind)
            for code in np.unique(codes):
                sel = codes == code
                tokens = float(w.out_tokens[sel].sum())
                groups.append(GroupSampleRow(
                    replica=self.name, t_ms=t_ms, kind=kind, group=names[int(code)],
                    completed=int(sel.sum()),
                    throughput_tok_s=tokens / duration if duration > 0 else None,
                    latency=latency_percentiles(w.ttft[sel], w.ttlt[sel], w.tbt[sel])))
        return groups

    def _set_health(self, t: float, healthy: bool, reason: str | None, mode: str) -> None:
        h = self.health
        if healthy != h.healthy or h.since is None:
            h.since = t
        h.healthy, h.reason, h.mode = healthy, reason, mode
        if healthy:
            h.failures, h.last_ok = 0, t
        else:
            h.failures += 1

    def snapshot(self) -> ReplicaSnapshot:
        state = self.state or {}
        return ReplicaSnapshot(
            name=self.name, health=replace(self.health), sample=self.sample, groups=list(self.groups),
            settings=state.get("settings"), settings_version=state.get("settings_version"),
            state=self.state, metrics=dict(self.metrics), cursor=self.cursor,
            window_completions=len(self.window), rejected=dict(self.rejected),
            breaker=dict(state["breaker"]) if isinstance(state.get("breaker"), dict) else None)


async def _poll_view(client: PollingClient, view: ReplicaView, timeout_s: float, clock: Callable[[], float],
                     *, with_completions: bool = True, metrics_every: int = 1) -> PollResult:
    """One poll of one replica: /state and /metrics concurrently, folded into ``view``.

    ``metrics_every`` > 1 reads /metrics of a replica with the plugin only every that many polls
    (its sample comes from /state; /metrics is then a check that vLLM's API server is up); the
    last metrics answer, or its error, stands in between."""
    due = (metrics_every <= 1 or view.health.mode != "plugin" or not view.health.healthy
           or view.metrics_error is not None or view.polls % metrics_every == 0)

    async def metrics_part() -> dict[str, float] | None:
        return await fetch_metrics(client, view.spec, timeout_s) if due else None

    async def state_part() -> StateAnswer:
        if with_completions:
            return await fetch_state(client, view, timeout_s)
        resp = await _get(client, control_base(view.spec) + "/state", "state", timeout_s,  # no cursor: no completions
                          token=view.spec.token())
        rejected: dict[str, int] = {}
        doc = read_state(_json(resp, "state", lambda: count_into(rejected, limits.NON_FINITE)), rejected)
        view.count(rejected)
        return StateAnswer(doc, [], view.cursor, rejected=rejected)

    state_res, metrics_res = await asyncio.gather(state_part(), metrics_part(), return_exceptions=True)
    errors: list[str] = []
    no_plugin: str | None = None
    answer = None
    if isinstance(state_res, BaseException):
        if isinstance(state_res, HttpFailure) and state_res.status == 404:
            no_plugin = "metrics only: no tailpilot control API (state: HTTP 404)"
        elif isinstance(state_res, (HttpFailure, StateFormatError)):
            errors.append(str(state_res))
        else:
            raise state_res
    else:
        answer = state_res
    metrics = None
    if isinstance(metrics_res, BaseException):
        if isinstance(metrics_res, (HttpFailure, MetricsFormatError)):
            errors.append(str(metrics_res))
            view.metrics_error = str(metrics_res)
        else:
            raise metrics_res
    elif due:
        metrics, view.metrics_error = metrics_res, None
    else:
        metrics = view.metrics
    if no_plugin and metrics is None:
        errors.insert(0, "state: HTTP 404 (no tailpilot control API)")
    return view.build(clock(), answer, metrics, errors, no_plugin)


# --------------------------------------------------------------------------------------------
# The collector
# --------------------------------------------------------------------------------------------


@dataclass
class CollectorStats:
    polls: int = 0
    failed_polls: int = 0
    batches: int = 0
    busy_retries: int = 0  # flushes the store refused (rows kept and retried)
    rows_written: int = 0  # samples + group samples + completions
    samples_written: int = 0
    group_samples_written: int = 0
    completions_written: int = 0  # completion rows handed to the store (re-deliveries included)
    pending_rows: int = 0
    breaker_trips: int = 0  # replicas' circuit-breaker trips written to the audit log


def reserved_groups(cluster: ClusterSpec) -> dict[str, tuple[str, ...]]:
    """The tenants and types the cluster file names: each window keeps them apart whatever the count."""
    gov = cluster.governance
    return {"tenant": tuple(gov.tenants), "type": tuple(gov.type_shares)} if gov is not None else {}


def _store_busy_types() -> tuple[type[BaseException], ...]:
    try:
        from storage.store import StoreBusy  # noqa: PLC0415 (built in parallel; optional here)
    except ImportError:
        return ()
    return (StoreBusy,)


class Collector:
    """Polls every replica of ``cluster`` until ``stop`` is set; writes rows to ``store``.

    ``store`` may be None (the TUI without a database): rows are then only kept as the latest
    snapshot. ``client`` (one :class:`PollingClient` for all replicas) is created if not given and
    closed at the end if created here. ``clock`` stamps samples (seconds since the epoch).
    ``metrics_every``: read /metrics of a replica with the plugin every that many polls (default:
    every poll; a replica without the plugin, or whose last /metrics read failed, every poll).
    """

    def __init__(self, cluster: ClusterSpec, store: Any | None = None, *,
                 client: PollingClient | None = None, clock: Callable[[], float] = time.time,
                 flush_interval_s: float = 1.0, metrics_every: int = 1) -> None:
        self.cluster = cluster
        self.metrics_every = max(1, int(metrics_every))
        self.store = store
        self.clock = clock
        self.flush_interval_s = float(flush_interval_s)
        self._client = client
        self._own_client = client is None
        self.views: dict[str, ReplicaView] = {r.name: ReplicaView(r, cluster.window_s,
                                                                  reserved=reserved_groups(cluster))
                                               for r in cluster.replicas}
        self.stats = CollectorStats()
        self._pending = Batch()
        self._inflight: Batch | None = None  # the batch a flush is writing
        self._subscribers: list[asyncio.Queue] = []
        self._busy = _store_busy_types()
        self._flush_lock = asyncio.Lock()
        self._poll_listeners: list[Callable[[str, PollResult], None]] = []
        gov = cluster.governance
        self._alerts = AlertEvaluator(gov.alerts) if gov is not None else None
        self._gov_params = gov.params() if gov is not None else None
        self._gov_stored: float | None = None
        self._waiting_since: dict[str, tuple[float, int]] = {}  # tenant -> (since, waiting then)
        self.governance: dict[str, Any] | None = None
        # The governor's last status (state, paused, active modes), when one runs on this
        # collector (controlplane.governor.governor_step sets it; the /metrics page reads it).
        self.governor_status: dict[str, Any] | None = None

    # --- public reading side (TUI, tests) ----------------------------------------------------
    def snapshot(self) -> ClusterSnapshot:
        return ClusterSnapshot(cluster=self.cluster.name, t_ms=int(self.clock() * 1000),
                               replicas={name: v.snapshot() for name, v in self.views.items()},
                               governance=self.governance)

    def govern(self, *, immediate: bool = False) -> dict[str, Any] | None:
        """The cluster's governance figures over the replicas' windows now; alert transitions and
        (once per ``window_s``) the figures are queued for the store. ``immediate``: judge the
        alerts on these figures alone, without their for/keep-firing holds (a one-shot poll)."""
        if self._alerts is None or self._gov_params is None:
            return None
        t = self.clock()
        t_ms = int(t * 1000)
        columns = governance_columns([v.window for v in self.views.values()])
        asked: dict[str, float] = {}  # requests per type: the window's completions and those waiting
        for kind in columns[1].tolist():
            asked[kind] = asked.get(kind, 0.0) + 1.0
        for v in self.views.values():
            for kind, n in ((v.state or {}).get("waiting_by_type") or {}).items():
                asked[kind] = asked.get(kind, 0.0) + float(n)
        figures = governance_report(*columns, self._gov_params, duration_s=self.cluster.window_s, arrived=asked,
                                    waiting=self._waiting_tenants(t))
        events = self._alerts.evaluate(figures, None if immediate else t)
        figures["alerts"] = dict(self._alerts.active)
        figures["alerts_pending"] = self._alerts.pending()
        figures["alert_values"] = dict(self._alerts.value)
        figures["t_ms"] = t_ms
        self.governance = figures
        if self.store is not None:
            self._pending.alerts += [AlertRow(t_ms=t_ms, **e) for e in events]
            if self._gov_stored is None or t - self._gov_stored >= self.cluster.window_s:
                self._pending.governance.append(GovernanceRow(t_ms=t_ms, summary=figures))
                self._gov_stored = t
        return figures

    def _waiting_tenants(self, now: float) -> dict[str, dict[str, float]]:
        """Per tenant its requests waiting on the healthy replicas (``/state``'s
        ``waiting_by_tenant``) and how long it has had some waiting without its queue shrinking
        (a lower bound of its oldest request's wait: its requests were neither admitted nor
        dropped meanwhile), on this collector's clock."""
        counts: dict[str, int] = {}
        for v in self.views.values():
            if v.health.healthy:
                for tenant, n in ((v.state or {}).get("waiting_by_tenant") or {}).items():
                    counts[tenant] = counts.get(tenant, 0) + int(n)
        out: dict[str, dict[str, float]] = {}
        for tenant in list(self._waiting_since):
            if counts.get(tenant, 0) <= 0:
                del self._waiting_since[tenant]
        for tenant, n in counts.items():
            if n <= 0:
                continue
            since, last = self._waiting_since.get(tenant, (now, n))
            if n < last:  # some were admitted (or dropped): the oldest may be newer than ``since``
                since = now
            self._waiting_since[tenant] = (since, n)
            out[tenant] = {"requests": n, "waited_s": now - since}
        return out

    def subscribe(self, maxsize: int = 8) -> asyncio.Queue:
        """A queue that receives a :class:`ClusterSnapshot` after every flush tick (oldest dropped
        when the reader falls behind)."""
        q: asyncio.Queue = asyncio.Queue(maxsize=maxsize)
        self._subscribers.append(q)
        return q

    def unsubscribe(self, q: asyncio.Queue) -> None:
        with contextlib.suppress(ValueError):
            self._subscribers.remove(q)

    def on_poll(self, fn: Callable[[str, PollResult], None]) -> None:
        """Call ``fn(replica, result)`` after every poll (synchronously, on the event loop)."""
        self._poll_listeners.append(fn)

    def _publish(self) -> None:
        if not self._subscribers:
            return
        snap = self.snapshot()
        for q in self._subscribers:
            if q.full():
                with contextlib.suppress(asyncio.QueueEmpty):
                    q.get_nowait()
            q.put_nowait(snap)

    @property
    def pending_rows(self) -> int:
        """Rows polled and not yet stored (a batch the store is writing or refused included)."""
        return len(self._pending) + (len(self._inflight) if self._inflight is not None else 0)

    # --- running ----------------------------------------------------------------------------
    async def start(self) -> None:
        """Register the replicas and load the persisted cursors (called by :meth:`run`)."""
        if self.store is None:
            return
        if self._alerts is not None:  # alerts firing when the last collector stopped still are
            for event in await asyncio.to_thread(self.store.firing_alerts, self.cluster.name):
                self._alerts.active[event["name"]] = event["severity"]
                value = (event.get("summary") or {}).get("value")
                if isinstance(value, (int, float)):
                    self._alerts.value.setdefault(event["name"], float(value))
        await asyncio.to_thread(self.store.ensure_replicas, self.cluster.name,
                                [(r.name, r.api_url, r.control_url) for r in self.cluster.replicas])
        positions = await asyncio.to_thread(self.store.cursor_positions, self.cluster.name)
        for name, (cursor, instance) in positions.items():
            view = self.views.get(name)
            if view is not None and cursor:
                self.views[name] = ReplicaView(view.spec, self.cluster.window_s, cursor, instance,
                                               reserved=reserved_groups(self.cluster))
        # The newest breaker trip recorded per replica: a restart writes no trip twice.
        for name, recorded in (await asyncio.to_thread(self.store.breaker_positions, self.cluster.name)).items():
            if name in self.views:
                self.views[name].breaker_recorded = recorded

    async def run(self, stop: asyncio.Event) -> CollectorStats:
        """Poll until ``stop`` is set, then flush everything pending and return the stats."""
        if self._client is None:
            self._client = make_client(self.cluster)
        try:
            await self.start()
            tasks = [asyncio.create_task(self._replica_loop(v.name, stop), name=f"poll-{v.name}")
                     for v in self.views.values()]
            writer = asyncio.create_task(self._writer_loop(stop), name="collector-writer")
            stopping = asyncio.create_task(stop.wait())
            try:
                # The writer only ends early by failing (a store error other than busy): surface it.
                await asyncio.wait([stopping, writer], return_when=asyncio.FIRST_COMPLETED)
            finally:
                stopping.cancel()
                for task in tasks:  # an in-flight poll has applied nothing yet: cancelling it is safe
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
                if not writer.done():
                    stop.set()
                await asyncio.gather(writer, return_exceptions=True)
            writer_error = writer.exception()
            if writer_error is not None:
                raise writer_error
            await self.flush(final=True)
            self._publish()
        finally:
            if self._own_client and self._client is not None:
                await self._client.aclose()
                self._client = None
        return self.stats

    async def poll(self, name: str) -> PollResult:
        """Poll one replica now and queue its rows for the writer."""
        assert self._client is not None, "poll() needs a client: run() or pass client="
        view = self.views[name]
        result = await _poll_view(self._client, view, self.cluster.timeout_s, self.clock,
                                  metrics_every=self.metrics_every)
        self.stats.polls += 1
        if not result.sample.healthy:
            self.stats.failed_polls += 1
        if self.store is not None:
            p = self._pending
            p.samples.append(result.sample)
            p.group_samples.extend(result.groups)
            if result.cursor is not None:
                p.completions.extend(result.completions)
                p.cursors[name] = result.cursor
                if result.instance is not None:
                    p.instances[name] = result.instance
            if result.settings_seen is not None:
                p.settings_seen.append(result.settings_seen)
            if result.breaker_trip is not None:
                p.settings_changes.append(result.breaker_trip)
        if result.breaker_trip is not None:
            self.stats.breaker_trips += int((result.breaker_trip.new or {}).get("new_trips") or 1)
            log.warning("replica %s: circuit breaker tripped: %s", name, result.breaker_trip.message)
        for fn in self._poll_listeners:
            try:
                fn(name, result)
            except Exception:  # a listener's bug is not the replica's
                log.exception("poll listener %r failed", fn)
        return result

    async def _replica_loop(self, name: str, stop: asyncio.Event) -> None:
        loop = asyncio.get_running_loop()
        interval = self.cluster.poll_interval_s
        # Spread the replicas over the first interval so that 64 polls do not land at once.
        index = list(self.views).index(name)
        next_at = loop.time() + interval * index / max(len(self.views), 1)
        while not stop.is_set():
            delay = next_at - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)  # run() cancels this task when stop is set
                if stop.is_set():
                    return
            started = loop.time()
            try:
                await self.poll(name)
            except Exception as err:  # a collector bug must not silence this replica for good
                log.exception("polling %s failed", name)
                view = self.views[name]
                row = SampleRow(replica=name, t_ms=int(self.clock() * 1000), healthy=False,
                                reason=f"collector error: {type(err).__name__}: {err}")
                view._set_health(self.clock(), False, row.reason, view.health.mode)
                view.sample = row
                self.stats.polls += 1
                self.stats.failed_polls += 1
                if self.store is not None:
                    self._pending.samples.append(row)
            # The next tick after this poll ended: missed ticks are skipped, never stacked.
            next_at += interval
            if next_at <= loop.time():
                next_at = started + interval * (1 + math.floor((loop.time() - started) / interval))

    async def _writer_loop(self, stop: asyncio.Event) -> None:
        """Every ``flush_interval_s``: a snapshot to the subscribers, and a flush unless the last
        one is still waiting for the store (a locked database never stalls the snapshots)."""
        flushing: asyncio.Task | None = None
        try:
            while not stop.is_set():
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(stop.wait(), self.flush_interval_s)
                if stop.is_set():
                    break
                self.govern()
                self._publish()
                if self.store is not None and (flushing is None or flushing.done()):
                    if flushing is not None:
                        flushing.result()  # a store error other than busy ends the collector
                    flushing = asyncio.create_task(self.flush())
        finally:
            if flushing is not None:
                await flushing

    async def flush(self, *, final: bool = False, deadline_s: float = 60.0) -> int:
        """Write what is pending as one batch; returns the rows written (0 if the store was busy:
        the rows stay pending for the next flush). ``final`` retries a busy store until
        ``deadline_s`` and then raises."""
        if self.store is None:
            return 0
        async with self._flush_lock:
            give_up = time.monotonic() + deadline_s
            while True:
                batch, self._pending = self._pending, Batch()
                if not len(batch) and not batch.cursors:
                    return 0
                self._inflight = batch
                try:
                    try:
                        await asyncio.to_thread(self.store.write, self.cluster.name, batch)
                    finally:
                        self._inflight = None
                except self._busy:
                    self.stats.busy_retries += 1
                    self._requeue(batch)
                    if not final or time.monotonic() > give_up:
                        if final:
                            raise
                        self.stats.pending_rows = len(self._pending)
                        return 0
                    await asyncio.sleep(0.2)
                    continue
                except BaseException:
                    self._requeue(batch)
                    raise
                s = self.stats
                s.batches += 1
                s.samples_written += len(batch.samples)
                s.group_samples_written += len(batch.group_samples)
                s.completions_written += len(batch.completions)
                s.rows_written += len(batch)
                s.pending_rows = len(self._pending)
                if not final or not len(self._pending):
                    return len(batch)

    def _requeue(self, batch: Batch) -> None:
        """Put a refused batch back in front of what arrived meanwhile (newer cursors win)."""
        self._pending = batch.followed_by(self._pending)


async def poll_once(cluster: ClusterSpec, *, client: PollingClient | None = None,
                    with_completions: bool = False, clock: Callable[[], float] = time.time,
                    ) -> list[ReplicaSnapshot]:
    """One concurrent poll of every replica, no store (``tailpilot status``).

    Without ``with_completions`` the completions are not downloaded (the state is read past the
    end of the log), so the latency percentiles are empty; with it, every completion the replica
    still holds is read and the window percentiles are computed as the collector would.
    """
    return [v.snapshot() for v in await _poll_views(cluster, client, with_completions, clock)]


async def poll_cluster_once(cluster: ClusterSpec, *, client: PollingClient | None = None,
                            clock: Callable[[], float] = time.time) -> ClusterSnapshot:
    """``poll_once`` with completions, as a ClusterSnapshot with the governance figures of the
    replicas' windows and the alerts they raise now (``tailpilot status``)."""
    views = await _poll_views(cluster, client, True, clock)
    collector = Collector(cluster, client=client, clock=clock)
    collector.views = {v.name: v for v in views}
    collector.govern(immediate=True)
    return collector.snapshot()


async def _poll_views(cluster: ClusterSpec, client: PollingClient | None, with_completions: bool,
                      clock: Callable[[], float]) -> list[ReplicaView]:
    own = client is None
    client = client or make_client(cluster)
    try:
        views = [ReplicaView(r, cluster.window_s, reserved=reserved_groups(cluster))
                 for r in cluster.replicas]
        await asyncio.gather(*(_poll_view(client, v, cluster.timeout_s, clock, with_completions=with_completions)
                               for v in views))
        return views
    finally:
        if own:
            await client.aclose()


# Settings changes live in controlplane/steering.py; imported here for callers of the collector's API.
from controlplane.steering import APPLY_WAIT_S, ApplyResult, SettingsChange, apply_settings  # noqa: E402,F401

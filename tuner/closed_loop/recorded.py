"""A recording is a trace: the requests a cluster's replicas served, replayed through the simulator.

    trace = load_any("db:tailpilot.db#recording=peak&replicas=a")  # or any trace file
    trace = load_recorded(RecordedSpan(recording="peak"))  # $TAILPILOT_DB or ./tailpilot.db

A ``db:`` trace URL is ``db:[STORE][#KEY=VALUE&...]``: STORE an SQLite path or SQLAlchemy URL
(empty: ``$TAILPILOT_DB``, else ./tailpilot.db); the keys select what to replay:

* ``recording``: a recording's name (``tailpilot recordings``); its cluster and time span;
* ``cluster``: the cluster (needed without a recording, or to tell two recordings of one name
  apart);
* ``replicas``: comma-separated replica names; needed when the span has more than one replica,
  since the simulator replays one replica's traffic (``replicas=a,b`` merges theirs on purpose);
* ``from``, ``to``: seconds from the span's first arrival (a part of the span);
* ``stored_until_ms``: only completions the store received before this time (its clock, ms since
  the epoch). A study pins it (:func:`pin`) when it is created on a span that is still open — a
  recording still running, or a cluster without a recording — so the recorder appending requests
  afterwards does not change what the study replays.

Which requests: those whose completion the collector stored while the recording ran (the store's
own clock, so a twin's fast clock or a replica's skewed one does not matter); without a
recording, every stored completion of the cluster. What each request carries is the engine's own
record: its arrival time at the engine core (scheduled send times can lag by seconds under load;
the API server's arrival precedes tokenising and the hop to the core, which no scheduler
changes), its prompt and output lengths, tenant, type and the client's ``max_tokens``. A request
that stopped at its cap (reason ``length``) is marked truncated: its true length is unknown, at
least the cap. A row without a recorded cap (an older store, a replica that does not report it) gets
the fixed default cap, never its own output length.
"""

from __future__ import annotations

import hashlib
import math
import os
from collections.abc import Iterable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeGuard
from urllib.parse import parse_qsl, quote

import numpy as np

from scheduler.metrics import Completion
from sim import traces as tr
from storage.rows import CompletionRow

# The store's modules are imported inside load_recorded: storage.store (SQLAlchemy, Alembic) adds
# ~0.4 s to importing this module, which tuner.studies.spec and the TUI's start import (python -X
# importtime), and only a recorded trace needs it.
if TYPE_CHECKING:
    from storage.store import Store

PREFIX = "db:"
DB_ENV = "TAILPILOT_DB"
KEYS = ("recording", "cluster", "replicas", "from", "to", "stored_until_ms")


@dataclass(frozen=True)
class RecordedSpan:
    """What to replay from a store (see the module docstring)."""

    db: str | None = None
    recording: str | None = None
    cluster: str | None = None
    replicas: tuple[str, ...] = ()
    start_s: float | None = None  # "from"
    end_s: float | None = None  # "to"
    stored_until_ms: int | None = None  # completions stored before this (the store's clock)

    def url(self) -> str:
        """The ``db:`` URL naming this span (what ``recommend`` and studies report)."""
        keys = [
            ("recording", self.recording),
            ("cluster", self.cluster),
            ("replicas", ",".join(self.replicas) or None),
            ("from", self.start_s),
            ("to", self.end_s),
            ("stored_until_ms", self.stored_until_ms),
        ]
        frag = "&".join(
            f"{k}={v:g}" if isinstance(v, float) else f"{k}={quote(str(v), safe=',/@:')}"
            for k, v in keys
            if v is not None
        )
        return f"{PREFIX}{self.db or ''}" + (f"#{frag}" if frag else "")


def is_recorded(spec: object) -> TypeGuard[str]:
    return isinstance(spec, str) and spec.startswith(PREFIX)


def parse_url(url: str) -> RecordedSpan:
    """``db:[STORE][#key=value&...]`` → a RecordedSpan; a TraceError names the bad part."""
    if not is_recorded(url):
        raise tr.TraceError(f"{url!r}: a recorded trace URL starts with {PREFIX!r}")
    store, _, frag = url[len(PREFIX) :].partition("#")
    values: dict[str, str] = {}
    for key, value in parse_qsl(frag, keep_blank_values=True, strict_parsing=False):
        if key not in KEYS:
            raise tr.TraceError(f"{url!r}: unknown key {key!r}; known: {', '.join(KEYS)}")
        if key in values:
            raise tr.TraceError(f"{url!r}: {key!r} given twice")
        if not value:
            raise tr.TraceError(f"{url!r}: {key!r} is empty")
        values[key] = value
    bounds = {}
    for key in ("from", "to"):
        if key in values:
            try:
                bounds[key] = float(values[key])
            except ValueError:
                raise tr.TraceError(
                    f"{url!r}: {key}={values[key]!r} is not a number of seconds"
                ) from None
            if not (bounds[key] >= 0 and bounds[key] < float("inf")):
                raise tr.TraceError(
                    f"{url!r}: {key}={values[key]!r} must be a finite number of seconds >= 0"
                )
    if "from" in bounds and "to" in bounds and bounds["to"] <= bounds["from"]:
        raise tr.TraceError(
            f"{url!r}: to ({bounds['to']:g}) must be after from ({bounds['from']:g})"
        )
    stored_until_ms = None
    if "stored_until_ms" in values:
        text = values["stored_until_ms"]
        if not text.isdigit():
            raise tr.TraceError(
                f"{url!r}: stored_until_ms={text!r} must be a whole number of milliseconds >= 0"
            )
        stored_until_ms = int(text)
    replicas = tuple(r for r in values.get("replicas", "").split(",") if r)
    return RecordedSpan(
        db=store or None,
        recording=values.get("recording"),
        cluster=values.get("cluster"),
        replicas=replicas,
        start_s=bounds.get("from"),
        end_s=bounds.get("to"),
        stored_until_ms=stored_until_ms,
    )


def load_recorded(
    span: RecordedSpan,
    *,
    max_tokens_default: int = tr.DEFAULT_MAX_TOKENS,
    store: Store | None = None,
) -> tr.Trace:
    """The span's requests as a Trace (arrivals from the first one, ids ``replica/request`` when
    several replicas are merged), from ``store`` if given (else the span's db, opened and closed
    here). TraceError when the span names nothing or holds no request."""
    where = span.url()
    with _opened(span, store, where) as opened:
        cluster, name, replicas, rows = _read_rows(opened, span, where)
    served = sorted({row.replica for row in rows})
    if not rows:
        raise tr.TraceError(
            f"{where}: no completions stored for {', '.join(replicas) or 'any replica'} "
            f"of cluster {cluster!r} in this span"
        )
    if len(served) > 1 and not span.replicas:
        raise tr.TraceError(
            f"{where}: the span holds the traffic of {len(served)} replicas ({', '.join(served)}); "
            "the simulator replays one replica: add replicas=NAME (or replicas=a,b to merge)"
        )
    trace = rows_to_trace(
        rows,
        f"recording:{name}" + (f":{'+'.join(served)}" if served else ""),
        max_tokens_default=max_tokens_default,
        prefix_replica=len(served) > 1,
    )
    if span.start_s is not None or span.end_s is not None:
        start = span.start_s or 0.0
        end = span.end_s if span.end_s is not None else trace.requests[-1].arrival + 1.0
        if end > start:
            trace = tr.transform(trace, window=(start, end - start))
        else:
            trace = tr.Trace(trace.name, ())
    if len(trace) == 0:
        raise tr.TraceError(f"{where}: no request arrived between from and to")
    return trace


def _opened(span: RecordedSpan, store: Store | None, where: str) -> AbstractContextManager[Store]:
    """``store`` as is, or the span's db opened (and closed on leaving) here."""
    # start-up cost: see the note at the imports
    from storage.database import StoreOpenError
    from storage.engine import DatabaseMissing, require_existing  # start-up cost, likewise
    from storage.store import Store  # start-up cost, likewise

    if store is not None:
        return nullcontext(store)
    try:
        url = span.db or os.environ.get(DB_ENV)
        require_existing(url)  # reading a recording never creates an empty database
        return Store.open(url)
    except (DatabaseMissing, StoreOpenError) as err:
        raise tr.TraceError(f"{where}: {err}") from None


def _read_rows(
    store: Store, span: RecordedSpan, where: str
) -> tuple[str, str, list[str], list[CompletionRow]]:
    """(cluster, display name, replicas read, the span's stored completions)."""
    cluster, name, stored = _span(store, span, where)
    known = [r.name for r in store.recordings.replicas(cluster)]
    replicas = list(span.replicas) or known
    missing = [r for r in replicas if r not in known]
    if missing:
        raise tr.TraceError(
            f"{where}: cluster {cluster!r} has no replica {missing[0]!r}; "
            f"known: {', '.join(known) or 'none'}"
        )
    rows = [
        row
        for r in replicas
        for row in store.readings.completions(
            cluster, r, stored_since_ms=stored[0], stored_until_ms=stored[1]
        )
    ]
    return cluster, name, replicas, rows


def pin(url: str) -> str:
    """``url`` with its span closed at the last completion stored now (``stored_until_ms``) when
    the span is still open: a recording still running (the recorder keeps appending requests) or
    a cluster's completions without a recording. A study is created on the pinned URL, so it
    replays the same requests later however much the recording grew; a request stored inside the
    pinned span afterwards still changes its digest (the study refuses it). A closed span (an
    ended recording, or one pinned already) comes back as given."""
    span = parse_url(url)
    if span.stored_until_ms is not None:
        return url
    where = span.url()
    with _opened(span, None, where) as store:
        if _span(store, span, where)[2][1] is not None:
            return url  # an ended recording: what the store holds of it no longer grows
        cluster, _, replicas, rows = _read_rows(store, span, where)
        wanted: dict[str, list[str]] = {}
        for row in rows:
            wanted.setdefault(row.replica, []).append(row.request_id)
        stored_s = [
            t
            for replica in replicas
            for t in store.readings.completion_stored_s(cluster, replica, wanted.get(replica, []))
        ]
    if not stored_s:
        raise tr.TraceError(
            f"{where}: no completions stored for {', '.join(replicas) or 'any replica'} "
            f"of cluster {cluster!r} in this span"
        )
    # Just after the newest completion read: what is stored from now on is left out.
    return replace(span, stored_until_ms=round(max(stored_s) * 1000) + 1).url()


def rows_to_trace(
    rows: Iterable[CompletionRow],
    name: str,
    *,
    max_tokens_default: int = tr.DEFAULT_MAX_TOKENS,
    prefix_replica: bool = False,
) -> tr.Trace:
    """Stored completions (``storage.rows.CompletionRow``) as a trace: arrivals at the engine core
    (``engine_arrival_s``) from the first one, the recorded cap or the fixed default (never the
    output length), a request stopped at its cap marked truncated; ids ``replica/request`` with
    ``prefix_replica``. A request the replica refused on arrival (reason ``rejected``: a tenant's
    queue cap) never ran: left out."""
    if (
        isinstance(max_tokens_default, bool)
        or not isinstance(max_tokens_default, int)
        or max_tokens_default < 1
    ):
        raise ValueError(f"max_tokens_default must be an integer >= 1, got {max_tokens_default!r}")
    rows = [row for row in rows if row.reason != "rejected"]
    if not rows:
        return tr.Trace(name, ())
    t0 = min(engine_arrival_s(row) for row in rows)
    requests = []
    for row in rows:
        rid = f"{row.replica}/{row.request_id}" if prefix_replica else row.request_id
        cap = row.max_tokens if row.max_tokens and row.max_tokens > 0 else max_tokens_default
        requests.append(
            tr.TraceRequest(
                id=rid,
                arrival=round(engine_arrival_s(row) - t0, 6),
                prompt_tokens=max(row.prompt_tokens, 1),
                output_tokens=max(min(row.output_tokens, cap), 1),
                max_tokens=cap,
                tenant=row.tenant or "default",
                type=row.type if row.type in tr.REQUEST_TYPES else "chat",
                truncated=row.reason == "length" or row.output_tokens > cap,
            )
        )
    return tr.Trace(name, tuple(requests))


def engine_arrival_s(row: CompletionRow) -> float:
    """When the engine core received the request (its API-server arrival where not recorded)."""
    return row.arrival_s if row.received_s is None else row.received_s


def with_front_end(
    completions: Iterable[Completion], rows: Iterable[CompletionRow]
) -> list[Completion]:
    """Simulated completions (of a trace made by ``rows_to_trace`` from ``rows``, one replica) as
    the client's side sees them: each arrival moved back by its recorded front-end hop (API server
    to engine core), so TTFT and TTLT compare with the real ones (``as_completion``)."""
    hop = {r.request_id: engine_arrival_s(r) - r.arrival_s for r in rows}
    return [replace(c, arrival=c.arrival - hop.get(c.id, 0.0)) for c in completions]


def store_lag_s(store: Store, cluster: str, replica: str, rows: Sequence[CompletionRow]) -> float:
    """The replica's clock minus the store's, from stored completions (``rows``): the median
    finish time minus the median time the store received them (exact to a poll interval)."""
    stored = store.readings.completion_stored_s(cluster, replica, [r.request_id for r in rows])
    finished = float(np.median([r.finished_s for r in rows]))
    return finished - float(np.median(stored)) if stored else 0.0


def as_completion(row: CompletionRow, t0: float) -> Completion:
    """A stored completion as the metrics module's Completion, times from ``t0``."""
    return Completion(
        id=row.request_id,
        tenant=row.tenant,
        type=row.type,
        arrival=row.arrival_s - t0,
        scheduled_at=math.nan,
        first_token_at=math.nan if row.first_token_s is None else row.first_token_s - t0,
        finished_at=row.finished_s - t0,
        prompt_tokens=row.prompt_tokens,
        output_tokens=row.output_tokens,
        preemptions=row.preemptions,
    )


def _span(
    store: Store, span: RecordedSpan, where: str
) -> tuple[str, str, tuple[int | None, int | None]]:
    """(cluster, display name, stored_ms bounds) of the span."""
    if span.recording is None:
        clusters = store.recordings.clusters()
        if span.cluster is None:
            if len(clusters) != 1:
                raise tr.TraceError(
                    f"{where}: name a recording= or a cluster= (clusters in the store: "
                    f"{', '.join(clusters) or 'none'})"
                )
            return clusters[0], clusters[0], (None, span.stored_until_ms)
        if span.cluster not in clusters:
            raise tr.TraceError(
                f"{where}: no cluster {span.cluster!r} in the store; known: "
                f"{', '.join(clusters) or 'none'}"
            )
        return span.cluster, span.cluster, (None, span.stored_until_ms)
    found = [r for r in store.recordings.all(span.cluster) if r.name == span.recording]
    if not found:
        names = sorted({r.name for r in store.recordings.all(span.cluster)})
        raise tr.TraceError(
            f"{where}: no recording {span.recording!r}"
            + (f" of cluster {span.cluster!r}" if span.cluster else "")
            + f"; known: {', '.join(names) or 'none'}"
        )
    if len({r.cluster for r in found}) > 1:
        raise tr.TraceError(
            f"{where}: recordings named {span.recording!r} exist for clusters "
            f"{', '.join(sorted({r.cluster for r in found}))}: add cluster=NAME"
        )
    rec = found[-1]  # the newest of that name
    return rec.cluster, rec.name, (rec.started_ms, _earlier(rec.ended_ms, span.stored_until_ms))


def _earlier(a: int | None, b: int | None) -> int | None:
    """The earlier of two optional upper bounds (None: open)."""
    return b if a is None else a if b is None else min(a, b)


def load_any(
    spec: str | None, *, max_tokens_default: int = tr.DEFAULT_MAX_TOKENS, **kw: Any
) -> tr.Trace:
    """A trace from a file, the bundled window (None or "bundled"), or a ``db:`` URL."""
    if spec in (None, "bundled"):
        return tr.load_bundled(max_tokens_default=max_tokens_default)
    if is_recorded(spec):
        return load_recorded(parse_url(spec), max_tokens_default=max_tokens_default)
    return tr.load_trace(spec, max_tokens_default=max_tokens_default, **kw)


def canonical(url: str) -> str:
    """The URL with an SQLite store path made absolute (a study resumes from anywhere)."""
    span = parse_url(url)
    if span.db and "://" not in span.db:
        span = replace(span, db=str(Path(span.db).resolve()))
    return span.url()


def unpinned(url: str) -> str:
    """``url`` without the pin :func:`pin` adds: the span as the user names it (``--recording``,
    a ``db:`` URL), for comparing with a study's pinned one."""
    return replace(parse_url(url), stored_until_ms=None).url()


def trace_digest(trace: tr.Trace) -> str:
    """SHA-256 over every request (a study checks it on resume as it checks a file's; a study's
    recording is pinned, so only a change inside the pinned span alters it)."""
    h = hashlib.sha256()
    for r in trace:
        h.update(
            repr(
                (r.id, r.arrival, r.prompt_tokens, r.output_tokens, r.max_tokens, r.tenant, r.type)
            ).encode()
        )
    return h.hexdigest()


def source_digest(spec: str) -> str:
    """The digest of a trace source: a file's bytes, or a recorded span's requests."""
    if is_recorded(spec):
        return trace_digest(load_recorded(parse_url(spec)))
    h = hashlib.sha256()
    with open(spec, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def split_traces(text: str | None) -> list[str]:
    """``--trace`` of tune: comma-separated files, or one ``db:`` URL (whose keys hold commas)."""
    text = (text or "").strip()
    if is_recorded(text):
        return [text]
    return [p.strip() for p in text.split(",") if p.strip()]

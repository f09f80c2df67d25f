"""The schema: SQLAlchemy 2.x typed models, one class per table.

Conventions, and why:

* Times the collector stamps (``t_ms``, ``first_seen_ms``, ...) are integer milliseconds since the
  epoch (``BigInteger``): exact, sortable and indexable on every backend, and no time-zone games.
  Per-request times in ``completions`` stay float seconds on the replica's own clock (see
  :mod:`storage.rows`); ``completions.stored_ms`` is the store's clock, used only for retention.
* Rows point at ``replicas.id`` instead of repeating (cluster, name) strings: the hot tables stay
  narrow and a replica is one row however many samples it has.
* The big append-only tables use a ``BigInteger`` surrogate key (``INTEGER`` on SQLite, where only
  that spelling is the fast rowid alias) so a busy PostgreSQL deployment cannot run out of ids.
* JSON columns are ``JSONB`` on PostgreSQL, JSON text elsewhere.

The migration in ``storage/migrations/versions`` must produce exactly this schema; a test checks it
with Alembic's ``compare_metadata``.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    CheckConstraint,
    Column,
    Float,
    ForeignKey,
    Index,
    Integer,
    MetaData,
    String,
    Table,
    Text,
    UniqueConstraint,
)
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from storage.limits import (
    INSTANCE_CHARS,
    POLICY_CHARS,
    REASON_CHARS,
    REQUEST_ID_CHARS,
    TENANT_CHARS,
    TYPE_CHARS,
)
from storage.rows import PERCENTILE_FIELDS

# Deterministic constraint names, so migrations can refer to them on every backend.
NAMING_CONVENTION = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}

RowId = BigInteger().with_variant(Integer(), "sqlite")
Json = JSON().with_variant(JSONB(), "postgresql")
# A JSON column where Python None is SQL NULL (not the JSON text 'null'): a column that is empty
# nearly always.
NullableJson = JSON(none_as_null=True).with_variant(JSONB(none_as_null=True), "postgresql")
# Gauges folded into rollups as mean and max (see storage.retention); the percentile columns too.
SAMPLE_GAUGES: tuple[str, ...] = (
    "waiting",
    "running",
    "kv_usage",
    "kv_used_blocks",
    "gamma_live",
    "beta_live",
    "throughput_tok_s",
    "throughput_req_s",
    "preemptions_per_s",
)


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING_CONVENTION)


def _replica_fk() -> Mapped[int]:
    return mapped_column(ForeignKey("replicas.id"), nullable=False)


class Replica(Base):
    """A replica of a cluster, as attached; everything else points here."""

    __tablename__ = "replicas"
    __table_args__ = (UniqueConstraint("cluster", "name"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    cluster: Mapped[str] = mapped_column(String(200))
    name: Mapped[str] = mapped_column(String(200))
    api_url: Mapped[str | None] = mapped_column(String(500))
    control_url: Mapped[str | None] = mapped_column(String(500))
    first_seen_ms: Mapped[int] = mapped_column(BigInteger)
    last_seen_ms: Mapped[int | None] = mapped_column(BigInteger)  # newest healthy sample


class _Percentiles:
    """The twelve windowed tail-latency columns of SampleRow / GroupSampleRow, in seconds."""

    ttft_p50: Mapped[float | None] = mapped_column(Float)
    ttft_p90: Mapped[float | None] = mapped_column(Float)
    ttft_p95: Mapped[float | None] = mapped_column(Float)
    ttft_p99: Mapped[float | None] = mapped_column(Float)
    ttlt_p50: Mapped[float | None] = mapped_column(Float)
    ttlt_p90: Mapped[float | None] = mapped_column(Float)
    ttlt_p95: Mapped[float | None] = mapped_column(Float)
    ttlt_p99: Mapped[float | None] = mapped_column(Float)
    tbt_p50: Mapped[float | None] = mapped_column(Float)
    tbt_p90: Mapped[float | None] = mapped_column(Float)
    tbt_p95: Mapped[float | None] = mapped_column(Float)
    tbt_p99: Mapped[float | None] = mapped_column(Float)


class Sample(_Percentiles, Base):
    """One replica's state at one poll (SampleRow)."""

    __tablename__ = "samples"
    __table_args__ = (Index("ix_samples_replica_t", "replica_id", "t_ms"),)

    id: Mapped[int] = mapped_column(RowId, primary_key=True)
    replica_id: Mapped[int] = _replica_fk()
    t_ms: Mapped[int] = mapped_column(BigInteger)
    healthy: Mapped[bool]
    reason: Mapped[str | None] = mapped_column(Text)
    policy: Mapped[str | None] = mapped_column(String(POLICY_CHARS))
    settings_version: Mapped[int | None] = mapped_column(Integer)
    waiting: Mapped[int | None] = mapped_column(Integer)
    running: Mapped[int | None] = mapped_column(Integer)
    kv_usage: Mapped[float | None] = mapped_column(Float)
    kv_used_blocks: Mapped[int | None] = mapped_column(Integer)
    kv_total_blocks: Mapped[int | None] = mapped_column(Integer)
    gamma_live: Mapped[float | None] = mapped_column(Float)
    beta_live: Mapped[float | None] = mapped_column(Float)
    throughput_tok_s: Mapped[float | None] = mapped_column(Float)
    throughput_req_s: Mapped[float | None] = mapped_column(Float)
    preemptions_per_s: Mapped[float | None] = mapped_column(Float)
    # The replica's circuit-breaker trips since it started (migration 0009); None: not reported.
    breaker_trips: Mapped[int | None] = mapped_column(Integer)
    # What the collector could not store as the replica sent it since it started, per reason
    # (storage.limits.REASONS; migration 0009); None when nothing was.
    rejected: Mapped[Any | None] = mapped_column(NullableJson)


class GroupSample(_Percentiles, Base):
    """One tenant's or one request type's window on one replica (GroupSampleRow)."""

    __tablename__ = "group_samples"
    __table_args__ = (Index("ix_group_samples_replica_t", "replica_id", "t_ms"),)

    id: Mapped[int] = mapped_column(RowId, primary_key=True)
    replica_id: Mapped[int] = _replica_fk()
    t_ms: Mapped[int] = mapped_column(BigInteger)
    kind: Mapped[str] = mapped_column(String(20))  # "tenant" | "type"
    group_name: Mapped[str] = mapped_column(String(200))  # "group" is an SQL keyword
    completed: Mapped[int] = mapped_column(Integer)
    throughput_tok_s: Mapped[float | None] = mapped_column(Float)


class Completion(Base):
    """One finished request (CompletionRow). Unique per (replica, request_id): re-delivery is a
    no-op."""

    __tablename__ = "completions"
    __table_args__ = (
        UniqueConstraint("replica_id", "request_id"),
        Index("ix_completions_replica_finished", "replica_id", "finished_s"),
    )

    id: Mapped[int] = mapped_column(RowId, primary_key=True)
    replica_id: Mapped[int] = _replica_fk()
    request_id: Mapped[str] = mapped_column(String(REQUEST_ID_CHARS))
    tenant: Mapped[str] = mapped_column(String(TENANT_CHARS))
    type: Mapped[str] = mapped_column(String(TYPE_CHARS))
    arrival_s: Mapped[float] = mapped_column(Float)
    first_token_s: Mapped[float | None] = mapped_column(Float)
    finished_s: Mapped[float] = mapped_column(Float)
    prompt_tokens: Mapped[int] = mapped_column(Integer)
    output_tokens: Mapped[int] = mapped_column(Integer)
    preemptions: Mapped[int] = mapped_column(Integer)
    recomputed_tokens: Mapped[int] = mapped_column(Integer)
    reason: Mapped[str] = mapped_column(String(REASON_CHARS))
    stored_ms: Mapped[int] = mapped_column(BigInteger)  # the store's clock: retention only
    # The client's cap (migration 0003); None for rows stored before it and replicas that do not
    # report it.
    max_tokens: Mapped[int | None] = mapped_column(Integer)
    # When the engine core got it (migration 0006; arrival_s is the API server's); None: not
    # reported.
    received_s: Mapped[float | None] = mapped_column(Float)


class CollectorCursor(Base):
    """The control API cursor after the newest stored completion of a replica."""

    __tablename__ = "collector_cursors"
    __table_args__ = (CheckConstraint("cursor >= 0", name="cursor_not_negative"),)

    replica_id: Mapped[int] = mapped_column(ForeignKey("replicas.id"), primary_key=True)
    cursor: Mapped[int] = mapped_column(BigInteger)
    updated_ms: Mapped[int] = mapped_column(BigInteger)
    # The replica incarnation (its /state "instance") the cursor counts in; None for replicas
    # that do not report one.
    instance: Mapped[str | None] = mapped_column(String(INSTANCE_CHARS), nullable=True)


class SettingsSeen(Base):
    """A replica's settings document as the collector first saw it at a new version or instance.

    The audit log holds the changes tailpilot made; this holds what every replica actually ran,
    whoever changed it (or since start-up), so a replay shows the parameters in force at any
    time."""

    __tablename__ = "settings_seen"
    __table_args__ = (Index("ix_settings_seen_replica_t", "replica_id", "t_ms"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    replica_id: Mapped[int] = _replica_fk()
    t_ms: Mapped[int] = mapped_column(BigInteger)
    instance: Mapped[str | None] = mapped_column(String(INSTANCE_CHARS))
    version: Mapped[int | None] = mapped_column(Integer)
    settings: Mapped[Any] = mapped_column(Json)


class SettingsChange(Base):
    """Audit log: who tried to change which replica's settings, from what to what, and the
    outcome."""

    __tablename__ = "settings_changes"
    __table_args__ = (Index("ix_settings_changes_replica_t", "replica_id", "t_ms"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    t_ms: Mapped[int] = mapped_column(BigInteger)
    replica_id: Mapped[int] = _replica_fk()
    who: Mapped[str] = mapped_column(String(200))
    old: Mapped[Any | None] = mapped_column(Json)
    new: Mapped[Any | None] = mapped_column(Json)
    result: Mapped[str] = mapped_column(String(50))  # "applied" | "rejected" | "error" | ...
    message: Mapped[str | None] = mapped_column(Text)
    version: Mapped[int | None] = mapped_column(Integer)


class Recording(Base):
    """A named time span of one cluster; retention keeps the data inside it (see
    storage.retention)."""

    __tablename__ = "recordings"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    name: Mapped[str] = mapped_column(String(200))
    cluster: Mapped[str] = mapped_column(String(200))
    started_ms: Mapped[int] = mapped_column(BigInteger)
    ended_ms: Mapped[int | None] = mapped_column(BigInteger)
    note: Mapped[str | None] = mapped_column(Text)


class FidelityReport(Base):
    """How closely the simulator replayed a replica's recorded span (``tailpilot fidelity``)."""

    __tablename__ = "fidelity_reports"
    __table_args__ = (Index("ix_fidelity_reports_replica_created", "replica_id", "created_ms"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    replica_id: Mapped[int] = _replica_fk()
    created_ms: Mapped[int] = mapped_column(BigInteger)
    span: Mapped[str] = mapped_column(String(1000))  # the db: URL replayed
    summary: Mapped[Any] = mapped_column(Json)


class Prediction(Base):
    """A what-if prediction kept with the change it was made for (``set --preview``; ``verify``)."""

    __tablename__ = "predictions"
    __table_args__ = (Index("ix_predictions_replica_t", "replica_id", "t_ms"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    replica_id: Mapped[int] = _replica_fk()
    t_ms: Mapped[int] = mapped_column(BigInteger)  # when the change was applied
    version: Mapped[int | None] = mapped_column(Integer)  # the settings version it became
    summary: Mapped[Any] = mapped_column(Json)


class GovernanceWindow(Base):
    """A cluster's multi-tenant figures (SCR, JFI, type fairness, per tenant and type) over a
    window."""

    __tablename__ = "governance_windows"
    __table_args__ = (Index("ix_governance_windows_cluster_t", "cluster", "t_ms"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    cluster: Mapped[str] = mapped_column(String(200))
    t_ms: Mapped[int] = mapped_column(BigInteger)
    summary: Mapped[Any] = mapped_column(Json)


class AlertEvent(Base):
    """A governance alert firing (at a severity) or resolving, with the figures that moved it."""

    __tablename__ = "alert_events"
    __table_args__ = (Index("ix_alert_events_cluster_t", "cluster", "t_ms"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    cluster: Mapped[str] = mapped_column(String(200))
    t_ms: Mapped[int] = mapped_column(BigInteger)
    name: Mapped[str] = mapped_column(String(50))
    severity: Mapped[str] = mapped_column(String(20))
    state: Mapped[str] = mapped_column(String(20))
    summary: Mapped[Any] = mapped_column(Json)


class ControllerControl(Base):
    """A cluster controller's control row (``controller``: the governor, the autopilot): armed,
    dry-run or disarmed, paused, who set that and when, and what the controller last reported
    (the governor: active modes, what they replaced, the last decisions; the autopilot: per
    replica its choice, why, the last decisions)."""

    __tablename__ = "controller_control"

    cluster: Mapped[str] = mapped_column(String(200), primary_key=True)
    controller: Mapped[str] = mapped_column(String(20), primary_key=True)
    state: Mapped[str] = mapped_column(String(20))  # "armed" | "dry-run" | "disarmed"
    paused: Mapped[bool] = mapped_column(Boolean)
    who: Mapped[str | None] = mapped_column(String(200))
    updated_ms: Mapped[int] = mapped_column(BigInteger)
    status: Mapped[Any | None] = mapped_column(Json)  # the controller's own report


class Recommendation(Base):
    """A tuner study's recommended settings and the summary that justifies them."""

    __tablename__ = "recommendations"
    __table_args__ = (Index("ix_recommendations_study_created", "study", "created_ms"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    study: Mapped[str] = mapped_column(String(200))
    created_ms: Mapped[int] = mapped_column(BigInteger)
    settings: Mapped[Any] = mapped_column(Json)
    summary: Mapped[Any] = mapped_column(Json)


def _mean_max_columns(names: tuple[str, ...]) -> list[Column[Any]]:
    """``<name>_mean`` and ``<name>_max`` for each folded column (see storage.retention)."""
    return [
        Column(f"{name}_{agg}", Float, nullable=True) for name in names for agg in ("mean", "max")
    ]


# The rollups are plain Core tables: their columns are generated, and only retention (Core
# INSERT ... SELECT) and the read side touch them, so a mapped class would add nothing.
ROLLUP_SAMPLE_COLUMNS: tuple[str, ...] = SAMPLE_GAUGES + PERCENTILE_FIELDS
ROLLUP_GROUP_COLUMNS: tuple[str, ...] = ("completed", "throughput_tok_s", *PERCENTILE_FIELDS)

# Samples older than the raw retention, folded per replica into 1-minute buckets.
sample_rollups = Table(
    "sample_rollups",
    Base.metadata,
    Column("replica_id", ForeignKey("replicas.id"), primary_key=True),
    Column("minute_ms", BigInteger, primary_key=True),  # bucket start
    Column("n", Integer, nullable=False),  # samples folded
    Column("n_healthy", Integer, nullable=False),
    Column("settings_version_max", Integer, nullable=True),
    Column("kv_total_blocks_max", Integer, nullable=True),
    *_mean_max_columns(ROLLUP_SAMPLE_COLUMNS),
)

# Group samples folded per (replica, kind, group) into 1-minute buckets.
group_sample_rollups = Table(
    "group_sample_rollups",
    Base.metadata,
    Column("replica_id", ForeignKey("replicas.id"), primary_key=True),
    Column("minute_ms", BigInteger, primary_key=True),
    Column("kind", String(20), primary_key=True),
    Column("group_name", String(200), primary_key=True),
    Column("n", Integer, nullable=False),
    *_mean_max_columns(ROLLUP_GROUP_COLUMNS),
)


def table(model: type) -> Table:
    """A mapped class's ``Table`` (``Model.__table__`` is typed as any FromClause)."""
    return model.__table__  # type: ignore[attr-defined,no-any-return]

"""Database schema (SQLAlchemy 2 typed ORM).

Time is stored as timezone-aware UTC ``DateTime``.  A record's per-position counts
are JSON lists (JSONB on PostgreSQL); the sums per minute, hour and day keep them one row per position.
Indexes follow the queries the tuner and dashboards make: recent records per
(instance, class), step statistics per (instance, minute), decisions and alerts by time;
the sums' keys lead with (width, start) (range reads).
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    DateTime,
    Float,
    ForeignKey,
    Index,
    Integer,
    PrimaryKeyConstraint,
    String,
    Text,
    TypeDecorator,
    UniqueConstraint,
)
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

Json = JSON().with_variant(JSONB(), "postgresql")


class UtcDateTime(TypeDecorator):
    """Timezone-aware UTC in and out, also on SQLite (which stores it naive)."""

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Any) -> datetime | None:
        if value is not None and value.tzinfo is None:
            raise ValueError("naive datetime: store times as timezone-aware UTC")
        return None if value is None else value.astimezone(UTC)

    def process_result_value(self, value: datetime | None, dialect: Any) -> datetime | None:
        if value is None:
            return None
        return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)


class Base(DeclarativeBase):
    pass


class EngineInstance(Base):
    __tablename__ = "engine_instances"

    instance_id: Mapped[str] = mapped_column(String(128), primary_key=True)
    model: Mapped[str] = mapped_column(String(256))
    method: Mapped[str] = mapped_column(String(32))
    capacity: Mapped[int] = mapped_column(Integer)
    started_at: Mapped[datetime] = mapped_column(UtcDateTime())
    last_seen_at: Mapped[datetime] = mapped_column(UtcDateTime())
    degraded_reason: Mapped[str | None] = mapped_column(Text)
    draft_model: Mapped[str | None] = mapped_column(String(256))
    settings_version: Mapped[int | None] = mapped_column(Integer)  # the policy version the engine holds


class RequestRecordRow(Base):
    """One row per engine RequestRecord (idempotent by request_id)."""

    __tablename__ = "request_records"
    __table_args__ = (
        Index("ix_request_records_instance_class_finish", "instance_id", "prompt_class", "finish_time"),
        Index("ix_request_records_finish", "finish_time"),
    )

    request_id: Mapped[str] = mapped_column(String(128), primary_key=True)
    instance_id: Mapped[str] = mapped_column(String(128))
    model: Mapped[str] = mapped_column(String(256))
    prompt_class: Mapped[str] = mapped_column(String(32))
    arrival_time: Mapped[datetime] = mapped_column(UtcDateTime())
    first_token_time: Mapped[datetime | None] = mapped_column(UtcDateTime())
    finish_time: Mapped[datetime] = mapped_column(UtcDateTime())
    prompt_tokens: Mapped[int] = mapped_column(Integer)
    output_tokens: Mapped[int] = mapped_column(Integer)
    ttft_s: Mapped[float | None] = mapped_column(Float)
    tpot_s: Mapped[float | None] = mapped_column(Float)
    e2e_s: Mapped[float] = mapped_column(Float)
    speculation_method: Mapped[str] = mapped_column(String(32))
    speculation_enabled: Mapped[bool] = mapped_column(Boolean)
    num_speculative_tokens: Mapped[int] = mapped_column(Integer)
    settings_version: Mapped[int] = mapped_column(Integer)
    num_spec_steps: Mapped[int] = mapped_column(Integer)
    num_draft_tokens: Mapped[int] = mapped_column(Integer)
    num_accepted_tokens: Mapped[int] = mapped_column(Integer)
    drafted_per_position: Mapped[list[int]] = mapped_column(Json)
    accepted_per_position: Mapped[list[int]] = mapped_column(Json)
    batch_size_mean: Mapped[float | None] = mapped_column(Float)
    batch_size_max: Mapped[int | None] = mapped_column(Integer)
    finish_reason: Mapped[str] = mapped_column(String(16))
    error: Mapped[str | None] = mapped_column(Text)


class _PeriodKey:
    """The key of the sums: a period (``width_s`` long, from ``start``) x instance x class x N."""

    width_s: Mapped[int] = mapped_column(Integer, primary_key=True)
    start: Mapped[datetime] = mapped_column(UtcDateTime(), primary_key=True)
    instance_id: Mapped[str] = mapped_column(String(128), primary_key=True)
    prompt_class: Mapped[str] = mapped_column(String(32), primary_key=True)
    num_speculative_tokens: Mapped[int] = mapped_column(Integer, primary_key=True)


class RequestSum(_PeriodKey, Base):
    """Request records summed per period (``width_s`` long, from ``start``: a minute, an hour, a
    day) x instance x class x N, written in the transaction that inserts the records
    (``store.sums``): always equal to the records the period covers, kept after retention deletes
    them, read for every whole period of a range."""

    __tablename__ = "request_sums"

    requests: Mapped[int] = mapped_column(BigInteger)
    drafting_requests: Mapped[int] = mapped_column(BigInteger)  # requests that drafted at least one token
    errors: Mapped[int] = mapped_column(BigInteger)
    output_tokens: Mapped[int] = mapped_column(BigInteger)
    num_spec_steps: Mapped[int] = mapped_column(BigInteger)
    num_draft_tokens: Mapped[int] = mapped_column(BigInteger)
    num_accepted_tokens: Mapped[int] = mapped_column(BigInteger)
    ttft_s_sum: Mapped[float] = mapped_column(Float)
    e2e_s_sum: Mapped[float] = mapped_column(Float)


class RequestSumPosition(_PeriodKey, Base):
    """Drafted and accepted tokens per draft position (0-based) of a ``RequestSum``, over the
    requests that drafted: one row per position, so the database sums them with a plain GROUP BY."""

    __tablename__ = "request_sum_positions"
    # the key's order as the migration made it: (width, start, ...) leads, for range reads
    __table_args__ = (
        PrimaryKeyConstraint("width_s", "start", "instance_id", "prompt_class", "num_speculative_tokens", "position"),
    )

    position: Mapped[int] = mapped_column(Integer, primary_key=True)
    drafted: Mapped[int] = mapped_column(BigInteger)
    accepted: Mapped[int] = mapped_column(BigInteger)


class LatencyHistogram(Base):
    """Log-bucket counts of one latency metric over a closed hour's records of a class, fleet-wide
    (``store.histograms``); ``requests`` is how many records the hour held when it was computed."""

    __tablename__ = "latency_histograms"

    start: Mapped[datetime] = mapped_column(UtcDateTime(), primary_key=True)
    prompt_class: Mapped[str] = mapped_column(String(32), primary_key=True)
    metric: Mapped[str] = mapped_column(String(16), primary_key=True)
    requests: Mapped[int] = mapped_column(BigInteger)
    counts: Mapped[dict[str, int]] = mapped_column(Json)  # {bucket: values in it}


class RetentionHorizon(Base):
    """Rows of ``table`` finished before ``deleted_before`` may have been deleted by retention: a
    read that needs raw rows from before it says what it left out."""

    __tablename__ = "retention_horizons"

    table_name: Mapped[str] = mapped_column(String(64), primary_key=True)
    deleted_before: Mapped[datetime] = mapped_column(UtcDateTime())


class StepStat(Base):
    """Engine steps aggregated per instance x minute x batch bucket x N (sum over writers)."""

    __tablename__ = "step_stats"

    instance_id: Mapped[str] = mapped_column(String(128), primary_key=True)
    minute: Mapped[datetime] = mapped_column(UtcDateTime(), primary_key=True)
    batch_bucket: Mapped[int] = mapped_column(Integer, primary_key=True)
    num_speculative_tokens: Mapped[int] = mapped_column(Integer, primary_key=True)
    # Which recorder process wrote the row: each writes a key once, so replays
    # are idempotent and a restart inside a minute adds a row instead of losing one.
    writer: Mapped[str] = mapped_column(String(32), primary_key=True)
    steps: Mapped[int] = mapped_column(Integer)
    step_time_sum_s: Mapped[float] = mapped_column(Float)
    step_time_p50_s: Mapped[float] = mapped_column(Float)
    step_time_p95_s: Mapped[float] = mapped_column(Float)
    batch_size_sum: Mapped[int] = mapped_column(BigInteger)
    scheduled_tokens: Mapped[int] = mapped_column(BigInteger)
    num_draft_tokens: Mapped[int] = mapped_column(BigInteger)
    num_accepted_tokens: Mapped[int] = mapped_column(BigInteger)
    accepted_per_position: Mapped[list[int]] = mapped_column(Json)
    # Steps that also prefilled (not in the step times above): count, time, tokens they generated.
    prefill_steps: Mapped[int] = mapped_column(Integer, server_default="0")
    prefill_time_sum_s: Mapped[float] = mapped_column(Float, server_default="0")
    prefill_generated_tokens: Mapped[int] = mapped_column(BigInteger, server_default="0")


class Policy(Base):
    """The current version of each policy scope (global, class, instance)."""

    __tablename__ = "policies"

    scope: Mapped[str] = mapped_column(String(160), primary_key=True)
    version: Mapped[int] = mapped_column(Integer)
    body: Mapped[dict[str, Any]] = mapped_column(Json)
    updated_at: Mapped[datetime] = mapped_column(UtcDateTime())
    updated_by: Mapped[str] = mapped_column(String(128))


class PolicyVersion(Base):
    __tablename__ = "policy_versions"

    scope: Mapped[str] = mapped_column(String(160), primary_key=True)
    version: Mapped[int] = mapped_column(Integer, primary_key=True)
    body: Mapped[dict[str, Any]] = mapped_column(Json)
    created_at: Mapped[datetime] = mapped_column(UtcDateTime())
    created_by: Mapped[str] = mapped_column(String(128))


class AuditEntry(Base):
    __tablename__ = "audit_entries"
    __table_args__ = (Index("ix_audit_entries_at", "at"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    at: Mapped[datetime] = mapped_column(UtcDateTime())
    actor: Mapped[str] = mapped_column(String(128))
    action: Mapped[str] = mapped_column(String(64))
    scope: Mapped[str] = mapped_column(String(160))
    reason: Mapped[str | None] = mapped_column(Text)
    diff: Mapped[dict[str, Any]] = mapped_column(Json)


class TunerDecision(Base):
    __tablename__ = "tuner_decisions"
    __table_args__ = (Index("ix_tuner_decisions_instance_class_at", "instance_id", "prompt_class", "at"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    at: Mapped[datetime] = mapped_column(UtcDateTime())
    instance_id: Mapped[str] = mapped_column(String(128))
    prompt_class: Mapped[str] = mapped_column(String(32))
    batch_bucket: Mapped[int | None] = mapped_column(Integer)
    mode: Mapped[str] = mapped_column(String(16))
    action: Mapped[str] = mapped_column(String(32))
    n_before: Mapped[int] = mapped_column(Integer)
    n_after: Mapped[int] = mapped_column(Integer)
    predicted_speedup: Mapped[float | None] = mapped_column(Float)
    realised_speedup: Mapped[float | None] = mapped_column(Float)
    # How the realised speedup was measured (``tuner/outcomes.py``): "paired" (plain
    # and N steps in the same minutes, with its 90 % interval and minutes) or "unpaired" (no interval).
    realised_estimator: Mapped[str | None] = mapped_column(String(16))
    realised_low: Mapped[float | None] = mapped_column(Float)
    realised_high: Mapped[float | None] = mapped_column(Float)
    realised_minutes: Mapped[int | None] = mapped_column(Integer)
    # TTFT and TPOT of the setting against plain requests over the same span (``outcomes.latency``).
    realised_latency: Mapped[dict[str, Any] | None] = mapped_column(Json)
    inputs: Mapped[dict[str, Any]] = mapped_column(Json)
    applied: Mapped[bool] = mapped_column(Boolean)
    leader_epoch: Mapped[int | None] = mapped_column(BigInteger)  # the lease epoch of the tuner that decided


class RebuildSlot(Base):
    """At most one engine of the fleet rebuilds at a time (``store/rebuilds.py``)."""

    __tablename__ = "rebuild_slots"

    name: Mapped[str] = mapped_column(String(32), primary_key=True)
    holder: Mapped[str] = mapped_column(String(128))
    acquired_at: Mapped[datetime] = mapped_column(UtcDateTime())
    expires_at: Mapped[datetime] = mapped_column(UtcDateTime())


class TunerLease(Base):
    """The tuner leader's lease: the epoch grows with every new leader (``store/leader.py``)."""

    __tablename__ = "tuner_leases"

    name: Mapped[str] = mapped_column(String(32), primary_key=True)
    epoch: Mapped[int] = mapped_column(BigInteger)
    holder: Mapped[str] = mapped_column(String(128))
    acquired_at: Mapped[datetime] = mapped_column(UtcDateTime())


class DiagnosticsReport(Base):
    __tablename__ = "diagnostics_reports"
    __table_args__ = (Index("ix_diagnostics_reports_created", "created_at"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    created_at: Mapped[datetime] = mapped_column(UtcDateTime())
    finished_at: Mapped[datetime | None] = mapped_column(UtcDateTime())
    trigger: Mapped[str] = mapped_column(String(32))
    prompt_class: Mapped[str | None] = mapped_column(String(32))
    status: Mapped[str] = mapped_column(String(16))
    summary: Mapped[str | None] = mapped_column(Text)
    report: Mapped[dict[str, Any] | None] = mapped_column(Json)
    error: Mapped[str | None] = mapped_column(Text)


class AlertEvent(Base):
    __tablename__ = "alert_events"
    __table_args__ = (
        Index("ix_alert_events_received", "received_at"),
        # Alertmanager repeats a notification; concurrent deliveries must store it once.
        UniqueConstraint("fingerprint", "status", "starts_at", name="uq_alert_events_notification"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    fingerprint: Mapped[str] = mapped_column(String(64))
    status: Mapped[str] = mapped_column(String(16))
    alertname: Mapped[str] = mapped_column(String(128))
    labels: Mapped[dict[str, Any]] = mapped_column(Json)
    starts_at: Mapped[datetime] = mapped_column(UtcDateTime())
    received_at: Mapped[datetime] = mapped_column(UtcDateTime())
    diagnosis_id: Mapped[int | None] = mapped_column(ForeignKey("diagnostics_reports.id"))


class SampledPrompt(Base):
    """Prompts kept for diagnostics: opt-in, sampled, with an expiry."""

    __tablename__ = "sampled_prompts"
    __table_args__ = (Index("ix_sampled_prompts_class_expires", "prompt_class", "expires_at"),)

    request_id: Mapped[str] = mapped_column(String(128), primary_key=True)
    prompt_class: Mapped[str] = mapped_column(String(32))
    prompt: Mapped[str] = mapped_column(Text)
    completion: Mapped[str | None] = mapped_column(Text)
    created_at: Mapped[datetime] = mapped_column(UtcDateTime())
    expires_at: Mapped[datetime] = mapped_column(UtcDateTime())


class DeadLetter(Base):
    """A spooled item the database refused (e.g. NUL in text on PostgreSQL), kept instead of
    blocking every later record; ``payload`` is the item as ASCII-escaped JSON, so it always stores."""

    __tablename__ = "dead_letters"
    __table_args__ = (Index("ix_dead_letters_at", "at"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    at: Mapped[datetime] = mapped_column(UtcDateTime())
    kind: Mapped[str] = mapped_column(String(16))
    request_id: Mapped[str | None] = mapped_column(String(128))
    error: Mapped[str] = mapped_column(Text)
    payload: Mapped[str] = mapped_column(Text)


class FidelityCheck(Base):
    """A served greedy request compared with its plain replay (``engine/fidelity.py``)."""

    __tablename__ = "fidelity_checks"
    __table_args__ = (Index("ix_fidelity_checks_class_checked", "prompt_class", "checked_at"),)

    request_id: Mapped[str] = mapped_column(String(128), primary_key=True)
    instance_id: Mapped[str] = mapped_column(String(128))
    prompt_class: Mapped[str] = mapped_column(String(32))
    checked_at: Mapped[datetime] = mapped_column(UtcDateTime())
    speculation_method: Mapped[str] = mapped_column(String(16))
    num_speculative_tokens: Mapped[int] = mapped_column(Integer)
    result: Mapped[str] = mapped_column(String(16))
    compared_tokens: Mapped[int] = mapped_column(Integer)
    diverged_at: Mapped[int | None] = mapped_column(Integer)
    served_margin: Mapped[float | None] = mapped_column(Float)
    plain_margin: Mapped[float | None] = mapped_column(Float)
    served_gap: Mapped[float | None] = mapped_column(Float)
    reason: Mapped[str] = mapped_column(Text)

"""Aggregates over request records, computed in the database over every row they cover.

No read here pulls raw rows into Python or stops at a row limit: sums, counts and
per-position sums are SQL aggregates, per-position lists are expanded by the
database's own JSON functions (PostgreSQL ``jsonb_array_elements_text WITH
ORDINALITY``, SQLite ``json_each``), and latency percentiles are exact nearest-rank
(PostgreSQL ``percentile_disc``; SQLite a window function over the same order).
SQLite answers the same, only slower.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta

from sqlalchemy import BigInteger, Engine, bindparam, cast, func, select, text

from .histograms import METRICS, histogram_latency
from .models import RequestRecordRow, RequestSum, RequestSumPosition, UtcDateTime
from .sums import WIDTHS, Parts, decompose, in_periods

LATENCY_METRICS = METRICS
QUANTILES = (("p50", 0.5), ("p95", 0.95), ("p99", 0.99))


@dataclass
class ClassAcceptance:
    requests: int = 0
    drafted: int = 0
    accepted: int = 0
    drafted_per_position: list[int] = field(default_factory=list)
    accepted_per_position: list[int] = field(default_factory=list)


def _filters(since: datetime, until: datetime | None, instance: str | None, prompt_class: str | None = None):
    """(SQL condition, parameters) shared by the raw statements, on ``request_records r``."""
    where, params = ["r.finish_time >= :since"], {"since": since}
    for column, name, value in (("finish_time", "until", until), ("instance_id", "instance", instance),
                                ("prompt_class", "cls", prompt_class)):  # fmt: skip
        if value is not None:
            where.append(f"r.{column} {'<' if name == 'until' else '='} :{name}")
            params[name] = value
    return " AND ".join(where), params


def _statement(sql: str, params: dict):
    """A raw statement whose times bind as the column does (SQLite keeps naive UTC text)."""
    times = [bindparam(k, type_=UtcDateTime()) for k in ("since", "until") if k in params]
    return text(sql).bindparams(*times)


_POSITIONS = {
    "postgresql": """
        SELECT r.prompt_class, e.ord - 1, sum(e.d::bigint), sum(coalesce(e.a, '0')::bigint)
        FROM request_records r,
             ROWS FROM (jsonb_array_elements_text(r.drafted_per_position),
                        jsonb_array_elements_text(r.accepted_per_position)) WITH ORDINALITY AS e(d, a, ord)
        WHERE {where} AND r.num_draft_tokens > 0
        GROUP BY r.prompt_class, e.ord""",
    "sqlite": """
        SELECT r.prompt_class, d.key, sum(d.value), sum(coalesce(a.value, 0))
        FROM request_records r
        JOIN json_each(r.drafted_per_position) d
        LEFT JOIN json_each(r.accepted_per_position) a ON a.key = d.key
        WHERE {where} AND r.num_draft_tokens > 0
        GROUP BY r.prompt_class, d.key""",
}


def acceptance_by_class(
    db: Engine,
    since: datetime,
    until: datetime | None = None,
    instance: str | None = None,
    drafted_only: bool = False,
) -> dict[str, ClassAcceptance]:
    """Per class over the records finished in [since, until): requests, drafted and accepted
    tokens, and both per draft position (over the requests that drafted). ``drafted_only``: count
    only requests that drafted.  Whole days, hours and minutes come from the sums (``store.sums``),
    the partial minutes at the edges from the records."""
    parts = decompose(since, until, datetime.now(UTC))
    out: dict[str, ClassAcceptance] = {}
    with db.connect() as conn:
        for lo, hi in parts.raw:
            _add_acceptance(out, _raw_acceptance(conn, lo, hi, instance, drafted_only))
        _add_acceptance(out, _summed_acceptance(conn, parts.periods, instance, drafted_only))
    return out


def _add_acceptance(out: dict[str, ClassAcceptance], rows) -> None:
    """Fold (class, requests, drafted, accepted, {position: (drafted, accepted)}) rows into ``out``."""
    for cls, requests, drafted, accepted, positions in rows:
        entry = out.setdefault(cls, ClassAcceptance())
        entry.requests += int(requests)
        entry.drafted += int(drafted or 0)
        entry.accepted += int(accepted or 0)
        for position, (d, a) in positions.items():
            for values, value in ((entry.drafted_per_position, d), (entry.accepted_per_position, a)):
                values += [0] * (position + 1 - len(values))
                values[position] += int(value)


def _grouped(totals, positions):
    per_class: dict[str, dict[int, tuple]] = {}
    for cls, position, drafted, accepted in positions:
        per_class.setdefault(cls, {})[int(position)] = (drafted, accepted)
    return [(cls, n, d, a, per_class.get(cls, {})) for cls, n, d, a in totals]


def _raw_acceptance(conn, since: datetime, until: datetime | None, instance: str | None, drafted_only: bool):
    where, params = _filters(since, until, instance)
    params["min_drafted"] = 0 if drafted_only else -1
    totals = _statement(
        "SELECT r.prompt_class, count(*), sum(r.num_draft_tokens), sum(r.num_accepted_tokens) FROM request_records r"
        f" WHERE {where} AND r.num_draft_tokens > :min_drafted GROUP BY r.prompt_class",
        params,
    )
    positions = _statement(_POSITIONS[conn.dialect.name].format(where=where), params)
    return _grouped(conn.execute(totals, params).all(), conn.execute(positions, params).all())


def _summed_acceptance(conn, periods, instance: str | None, drafted_only: bool):
    if not periods:
        return []
    S, P = RequestSum, RequestSumPosition
    requests = func.sum(S.drafting_requests if drafted_only else S.requests)
    totals = select(S.prompt_class, requests, func.sum(S.num_draft_tokens), func.sum(S.num_accepted_tokens))
    positions = select(P.prompt_class, P.position, func.sum(P.drafted), func.sum(P.accepted))
    totals = totals.where(in_periods(S, periods)).group_by(S.prompt_class).having(requests > 0)
    positions = positions.where(in_periods(P, periods)).group_by(P.prompt_class, P.position)
    if instance is not None:
        totals, positions = totals.where(S.instance_id == instance), positions.where(P.instance_id == instance)
    return _grouped(conn.execute(totals).all(), conn.execute(positions).all())


EXACT_UP_TO = timedelta(hours=2)  # ranges up to this long sort their raw records: exact percentiles


def latency_by_class(
    db: Engine,
    since: datetime,
    until: datetime | None = None,
    instance: str | None = None,
    prompt_class: str | None = None,
    quantiles: Sequence[tuple[str, float]] = QUANTILES,
) -> dict[str, dict]:
    """Per class: requests, output tokens and nearest-rank percentiles of each latency metric over
    every record finished in [since, until) (None where a metric has no value), and
    ``percentile_error``: 0 where the records were sorted (ranges up to ``EXACT_UP_TO``, and any
    range of one instance), else the histograms' relative error bound (``store.histograms``)."""
    end = until or datetime.now(UTC)
    if instance is not None or end - since <= EXACT_UP_TO:
        return _exact_latency(db, since, until, instance, prompt_class, quantiles)
    return histogram_latency(db, since, until, prompt_class, quantiles)


def _exact_latency(db, since, until, instance, prompt_class, quantiles) -> dict[str, dict]:
    where, params = _filters(since, until, instance, prompt_class)
    totals = _statement(
        f"SELECT r.prompt_class, count(*), sum(r.output_tokens) FROM request_records r WHERE {where}"
        " GROUP BY r.prompt_class",
        params,
    )
    out: dict[str, dict] = {}
    with db.connect() as conn:
        for cls, requests, tokens in conn.execute(totals, params):
            out[cls] = {"requests": int(requests), "output_tokens": int(tokens or 0), "percentile_error": 0.0}
            for metric in LATENCY_METRICS:
                out[cls][metric] = {name: None for name, _ in quantiles}
        for metric in LATENCY_METRICS:
            for (cls,), name, value in _percentiles(conn, db.dialect.name, metric, where, params, quantiles):
                out[cls][metric][name] = value
    return out


ARM_QUANTILES = (("p50", 0.5), ("p95", 0.95))
# 1 where the request was admitted speculating (N > 0), 0 where it ran plain
_SPECULATING = "CASE WHEN r.num_speculative_tokens > 0 THEN 1 ELSE 0 END"


@dataclass(frozen=True)
class ArmLatency:
    """One arm's requests (speculating or plain) and nearest-rank percentiles of their time to first
    token and time per output token (None where no record has the metric)."""

    requests: int
    ttft_s: dict[str, float | None]
    tpot_s: dict[str, float | None]


def latency_by_arm(
    db: Engine,
    since: datetime,
    until: datetime | None = None,
    prompt_class: str | None = None,
    batch: tuple[float, float] | None = None,
) -> dict[str, dict[bool, ArmLatency]]:
    """class -> {speculating: its ``ArmLatency``} over every record finished in [since, until).
    Speculating: N > 0 at admission; plain: N = 0 (a class that is off, a control request, a batch its
    table keeps plain).  ``batch`` (lo, hi): only records whose mean batch size lies in (lo, hi]."""
    where, params = _filters(since, until, None, prompt_class)
    if batch is not None:
        where += " AND r.batch_size_mean > :batch_lo AND r.batch_size_mean <= :batch_hi"
        params.update(batch_lo=batch[0], batch_hi=batch[1])
    keys = ("r.prompt_class", _SPECULATING)
    counts = _statement(
        f"SELECT {', '.join(keys)}, count(*) FROM request_records r WHERE {where} GROUP BY {', '.join(keys)}", params
    )
    values: dict[tuple, dict[str, dict[str, float | None]]] = {}
    with db.connect() as conn:
        requests = {(cls, bool(arm)): int(k) for cls, arm, k in conn.execute(counts, params)}
        for metric in ("ttft_s", "tpot_s"):
            for (cls, arm), name, value in _percentiles(
                conn, db.dialect.name, metric, where, params, ARM_QUANTILES, keys
            ):
                values.setdefault((cls, bool(arm)), {}).setdefault(metric, {})[name] = value
    out: dict[str, dict[bool, ArmLatency]] = {}
    for (cls, arm), k in requests.items():
        got = values.get((cls, arm), {})
        none = {name: None for name, _ in ARM_QUANTILES}
        out.setdefault(cls, {})[arm] = ArmLatency(k, got.get("ttft_s", none), got.get("tpot_s", none))
    return out


def _percentiles(conn, dialect: str, metric: str, where: str, params: dict, quantiles, keys=("r.prompt_class",)):
    """(key, quantile name, value) rows per group of ``keys`` (SQL expressions; the key is their
    tuple): the value at rank ceil(q * n) of the group's non-null values."""
    group = ", ".join(keys)
    if dialect == "postgresql":
        columns = ", ".join(f"percentile_disc({q}) WITHIN GROUP (ORDER BY r.{metric})" for _, q in quantiles)
        sql = f"SELECT {group}, {columns} FROM request_records r WHERE {where} AND r.{metric} IS NOT NULL"
        for row in conn.execute(_statement(sql + f" GROUP BY {group}", params), params):
            for (name, _), value in zip(quantiles, row[len(keys) :], strict=True):
                yield tuple(row[: len(keys)]), name, value
        return
    # ceil(q * n) without SQLite's optional math functions; the same doubles as Python's
    ranks = " OR ".join(f"rn = max(1, CAST({q} * n AS INTEGER) + ({q} * n > CAST({q} * n AS INTEGER)))"
                        for _, q in quantiles)  # fmt: skip
    named = ", ".join(f"{k} AS k{i}" for i, k in enumerate(keys))
    sql = f"""
        SELECT {", ".join(f"k{i}" for i in range(len(keys)))}, rn, n, v FROM (
            SELECT {named}, r.{metric} AS v,
                   row_number() OVER (PARTITION BY {group} ORDER BY r.{metric}) AS rn,
                   count(*) OVER (PARTITION BY {group}) AS n
            FROM request_records r WHERE {where} AND r.{metric} IS NOT NULL
        ) WHERE {ranks}"""
    for *key, rn, n, value in conn.execute(_statement(sql, params), params):
        for name, q in quantiles:
            if rn == max(1, math.ceil(q * n)):
                yield tuple(key), name, value


def timeseries_by_class(db: Engine, since: datetime, bucket_s: float) -> list[tuple[str, float, int, int, int, int]]:
    """(class, bucket start as epoch seconds, requests, drafted, accepted, output tokens) per class
    and ``bucket_s``-wide time bucket of the records finished since ``since``, oldest first.

    Buckets are integer divisions of microseconds since the epoch (exact on both databases).  A sums
    period lies in one bucket where the bucket width is a multiple of its width: those periods come
    from the sums, the rest from the records."""
    width = max(1, round(bucket_s * 1_000_000))
    usable = [w for w in WIDTHS if width % (w * 1_000_000) == 0]
    parts = decompose(since, None, datetime.now(UTC), usable) if usable else Parts(raw=[(since, None)])
    R, S = RequestRecordRow, RequestSum
    raw_sums = [func.count(), func.sum(R.num_draft_tokens), func.sum(R.num_accepted_tokens), func.sum(R.output_tokens)]
    summed = [func.sum(S.requests), func.sum(S.num_draft_tokens), func.sum(S.num_accepted_tokens),
              func.sum(S.output_tokens)]  # fmt: skip
    queries = []
    if parts.periods:
        index = (_epoch_micros(db, S.start) // width).label("bucket")
        queries.append(select(S.prompt_class, index, *summed).where(in_periods(S, parts.periods))
                       .group_by(S.prompt_class, index))  # fmt: skip
    index = (_epoch_micros(db, R.finish_time) // width).label("bucket")
    for lo, hi in parts.raw:
        query = select(R.prompt_class, index, *raw_sums).where(R.finish_time >= lo)
        queries.append((query if hi is None else query.where(R.finish_time < hi)).group_by(R.prompt_class, index))
    totals: dict[tuple[str, int], list[int]] = {}
    with db.connect() as conn:
        for query in queries:
            for cls, b, *values in conn.execute(query):
                entry = totals.setdefault((cls, int(b)), [0, 0, 0, 0])
                for i, v in enumerate(values):
                    entry[i] += int(v or 0)
    return sorted(
        ((cls, b * width / 1e6, *values) for (cls, b), values in totals.items()),
        key=lambda row: (row[1], row[0]),
    )


def _epoch_micros(db: Engine, column):
    """Microseconds since the epoch of a time column, as a bigint expression."""
    if db.dialect.name == "postgresql":
        return cast(func.extract("epoch", column) * 1_000_000, BigInteger)
    # SQLAlchemy keeps SQLite times as 'YYYY-MM-DD HH:MM:SS.ffffff' (naive UTC)
    return cast(func.strftime("%s", column), BigInteger) * 1_000_000 + cast(func.substr(column, 21, 6), BigInteger)

"""sums of request records per minute, hour and day, written with the records (request_sums, per
position in request_sum_positions), replace the per-minute rollups retention wrote (request_rollups):
existing records and rollups are converted; hourly latency histograms (computed by a job, empty here) and
retention's horizon

Rollups (minutes whose records retention deleted) did not count the requests that drafted: their
``drafting_requests`` is taken as every request of a rollup row that drafted any token (an upper
bound, said here because it cannot be recovered).

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-02 22:00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql, sqlite

from spectune.store.sums import WIDTHS, period_start, record_sums

revision: str = "0005"
down_revision: str | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

KEY = ("width_s", "start", "instance_id", "prompt_class", "num_speculative_tokens")
OLD_KEY = ("minute", "instance_id", "prompt_class", "num_speculative_tokens")
TOTALS = ("requests", "drafting_requests", "errors", "output_tokens", "num_spec_steps", "num_draft_tokens",
          "num_accepted_tokens", "ttft_s_sum", "e2e_s_sum")  # fmt: skip
CHUNK = 20_000
Json = sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), "postgresql")


def _key_columns(position: bool = False) -> list[sa.Column]:
    columns = [
        sa.Column("width_s", sa.Integer(), nullable=False),
        sa.Column("start", sa.DateTime(timezone=True), nullable=False),
        sa.Column("instance_id", sa.String(length=128), nullable=False),
        sa.Column("prompt_class", sa.String(length=32), nullable=False),
        sa.Column("num_speculative_tokens", sa.Integer(), nullable=False),
    ]
    return columns + ([sa.Column("position", sa.Integer(), nullable=False)] if position else [])


def _rollups_table(create: bool) -> sa.Table:
    columns = [
        sa.Column("instance_id", sa.String(length=128), nullable=False),
        sa.Column("prompt_class", sa.String(length=32), nullable=False),
        sa.Column("num_speculative_tokens", sa.Integer(), nullable=False),
        sa.Column("minute", sa.DateTime(timezone=True), nullable=False),
        sa.Column("requests", sa.Integer(), nullable=False),
        sa.Column("errors", sa.Integer(), nullable=False),
        sa.Column("output_tokens", sa.BigInteger(), nullable=False),
        sa.Column("num_spec_steps", sa.BigInteger(), nullable=False),
        sa.Column("num_draft_tokens", sa.BigInteger(), nullable=False),
        sa.Column("num_accepted_tokens", sa.BigInteger(), nullable=False),
        sa.Column("drafted_per_position", Json, nullable=False),
        sa.Column("accepted_per_position", Json, nullable=False),
        sa.Column("ttft_s_sum", sa.Float(), nullable=False),
        sa.Column("e2e_s_sum", sa.Float(), nullable=False),
    ]
    if create:
        return op.create_table(
            "request_rollups", *columns,
            sa.PrimaryKeyConstraint("instance_id", "prompt_class", "num_speculative_tokens", "minute"),
        )  # fmt: skip
    return sa.table("request_rollups", *(sa.column(c.name, c.type) for c in columns))


def _add(conn: sa.Connection, table: sa.Table, keys: Sequence[str], rows: list[dict]) -> None:
    """Additive upsert (a minute may span chunks, and a rollup row meets its raw remainder)."""
    if not rows:
        return
    stmt = (postgresql if conn.dialect.name == "postgresql" else sqlite).insert(table)
    added = {c.name: table.c[c.name] + stmt.excluded[c.name] for c in table.columns if c.name not in keys}
    conn.execute(stmt.on_conflict_do_update(index_elements=list(keys), set_=added), rows)


def _records(conn: sa.Connection):
    """request_records rows in chunks, by (finish_time, request_id) (keyset: no cursor held open)."""
    types = {"finish_time": sa.DateTime(timezone=True), "drafted_per_position": Json, "accepted_per_position": Json}
    names = ("request_id", "finish_time", "instance_id", "prompt_class", "num_speculative_tokens", "output_tokens",
             "num_spec_steps", "num_draft_tokens", "num_accepted_tokens", "drafted_per_position",
             "accepted_per_position", "ttft_s", "e2e_s", "finish_reason")  # fmt: skip
    r = sa.table("request_records", *(sa.column(c, types.get(c)) for c in names))
    query = sa.select(r).order_by(r.c.finish_time, r.c.request_id).limit(CHUNK)
    after = None
    while True:
        page = query if after is None else query.where(sa.tuple_(r.c.finish_time, r.c.request_id) > after)
        rows = [dict(m) for m in conn.execute(page).mappings()]
        if not rows:
            return
        yield rows
        after = (rows[-1]["finish_time"], rows[-1]["request_id"])


def upgrade() -> None:
    sums = op.create_table(
        "request_sums", *_key_columns(),
        *(sa.Column(c, sa.Float() if c.endswith("_sum") else sa.BigInteger(), nullable=False) for c in TOTALS),
        sa.PrimaryKeyConstraint(*KEY),
    )  # fmt: skip
    positions = op.create_table(
        "request_sum_positions", *_key_columns(position=True),
        sa.Column("drafted", sa.BigInteger(), nullable=False),
        sa.Column("accepted", sa.BigInteger(), nullable=False),
        sa.PrimaryKeyConstraint(*KEY, "position"),
    )  # fmt: skip
    op.create_table(
        "latency_histograms",
        sa.Column("start", sa.DateTime(timezone=True), nullable=False),
        sa.Column("prompt_class", sa.String(length=32), nullable=False),
        sa.Column("metric", sa.String(length=16), nullable=False),
        sa.Column("requests", sa.BigInteger(), nullable=False),
        sa.Column("counts", Json, nullable=False),
        sa.PrimaryKeyConstraint("start", "prompt_class", "metric"),
    )
    op.create_table(
        "retention_horizons",
        sa.Column("table_name", sa.String(length=64), nullable=False),
        sa.Column("deleted_before", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("table_name"),
    )
    conn = op.get_bind()
    for rows in _records(conn):
        totals, per_position = record_sums(rows)
        _add(conn, sums, KEY, totals)
        _add(conn, positions, (*KEY, "position"), per_position)
    rollups = _rollups_table(create=False)
    for old in conn.execute(sa.select(rollups)).mappings():
        totals = {c: old[c] for c in TOTALS if c in old}
        totals["drafting_requests"] = old["requests"] if old["num_draft_tokens"] > 0 else 0
        accepted = old["accepted_per_position"] or []
        for width in WIDTHS:
            key = {"width_s": width, "start": period_start(old["minute"], width),
                   **{k: old[k] for k in OLD_KEY if k != "minute"}}  # fmt: skip
            _add(conn, sums, KEY, [{**key, **totals}])
            _add(conn, positions, (*KEY, "position"), [
                {**key, "position": i, "drafted": d, "accepted": accepted[i] if i < len(accepted) else 0}
                for i, d in enumerate(old["drafted_per_position"] or [])
            ])  # fmt: skip
    op.drop_table("request_rollups")


def downgrade() -> None:
    """request_rollups again: what the per-minute sums hold beyond the records still stored."""
    conn = op.get_bind()
    rollups = _rollups_table(create=True)
    typed = {"start": sa.DateTime(timezone=True)}
    sums = sa.table("request_sums", *(sa.column(c, typed.get(c)) for c in (*KEY, *TOTALS)))
    positions = sa.table("request_sum_positions",
                         *(sa.column(c, typed.get(c)) for c in (*KEY, "position", "drafted", "accepted")))  # fmt: skip
    stored: dict[tuple, dict] = {}
    stored_positions: dict[tuple, list[int]] = {}
    for rows in _records(conn):
        totals, per_position = record_sums(rows, widths=(60,))
        for t in totals:
            entry = stored.setdefault(tuple(t[k] for k in KEY), dict.fromkeys(TOTALS, 0))
            for c in TOTALS:
                entry[c] += t[c]
        for p in per_position:
            entry = stored_positions.setdefault((*(p[k] for k in KEY), p["position"]), [0, 0])
            entry[0] += p["drafted"]
            entry[1] += p["accepted"]
    per_key: dict[tuple, tuple[list[int], list[int]]] = {}
    minute_positions = sa.select(positions).where(positions.c.width_s == 60)
    for p in conn.execute(minute_positions.order_by(*(positions.c[k] for k in KEY), positions.c.position)):
        key = tuple(getattr(p, k) for k in KEY)
        raw = stored_positions.get((*key, p.position))
        drafted, accepted = per_key.setdefault(key, ([], []))
        drafted.append(p.drafted - (raw[0] if raw else 0))
        accepted.append(p.accepted - (raw[1] if raw else 0))
    rows = []
    for m in conn.execute(sa.select(sums).where(sums.c.width_s == 60)).mappings():
        key = tuple(m[k] for k in KEY)
        left = {c: m[c] - stored.get(key, {}).get(c, 0) for c in TOTALS}
        if left["requests"] <= 0:
            continue
        drafted, accepted = per_key.get(key, ([], []))
        rows.append({"minute": m["start"], **{k: m[k] for k in OLD_KEY if k != "minute"},
                     **{c: left[c] for c in TOTALS if c != "drafting_requests"},
                     "drafted_per_position": drafted, "accepted_per_position": accepted})  # fmt: skip
    if rows:
        conn.execute(sa.insert(rollups), rows)
    op.drop_table("request_sum_positions")
    op.drop_table("request_sums")
    op.drop_table("retention_horizons")
    op.drop_table("latency_histograms")

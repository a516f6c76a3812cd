"""Synthetic fleet traffic for the store at scale: request records over 7 days from 200
instances and 6 prompt classes, step statistics and tuner decisions, loaded with COPY
(PostgreSQL) or batched INSERTs (SQLite).  The generated columns stay in memory as numpy
arrays: they are the brute-force reference every aggregate is checked against."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from datetime import UTC, datetime

import numpy as np
from sqlalchemy import Engine, insert, text

from spectune.store.models import StepStat, TunerDecision
from spectune.store.sums import insert_new_records

DAYS = 7
INSTANCES = 200
K_MAX = 5
# class: (N, acceptance of position k given k-1 accepted, median TTFT s, median TPOT s, share of traffic)
CLASSES = {
    "code": (5, [0.90, 0.88, 0.85, 0.80, 0.75], 0.12, 0.025, 0.30),
    "chat": (3, [0.75, 0.70, 0.62], 0.08, 0.030, 0.25),
    "qa": (3, [0.70, 0.62, 0.55], 0.06, 0.030, 0.20),
    "summarize": (2, [0.65, 0.55], 0.25, 0.028, 0.10),
    "translate": (1, [0.60], 0.07, 0.030, 0.10),
    "long": (0, [], 0.90, 0.040, 0.05),
}
NAMES = list(CLASSES)
CHUNK = 200_000


@dataclass
class Records:
    """The generated records, column by column (one entry per record)."""

    cls: np.ndarray  # index into NAMES
    instance: np.ndarray
    finish_us: np.ndarray  # microseconds since the epoch (as stored)
    ttft: np.ndarray  # NaN: none (the request failed before its first token)
    tpot: np.ndarray
    e2e: np.ndarray
    output_tokens: np.ndarray
    drafted: np.ndarray  # [records, K_MAX]
    accepted: np.ndarray


def generate(rows: int, end: float, seed: int = 0) -> Records:
    rng = np.random.default_rng(seed)
    shares = np.array([c[4] for c in CLASSES.values()])
    cls = rng.choice(len(NAMES), size=rows, p=shares / shares.sum()).astype(np.int8)
    finish_us = np.rint(rng.uniform(end - DAYS * 86_400, end, rows) * 1e6).astype(np.int64)
    out = rng.integers(16, 512, rows).astype(np.int32)
    drafted = np.zeros((rows, K_MAX), np.int32)
    accepted = np.zeros((rows, K_MAX), np.int32)
    ttft, tpot = np.empty(rows), np.empty(rows)
    for i, (n, conditional, ttft_median, tpot_median, _) in enumerate(CLASSES.values()):
        mine = np.flatnonzero(cls == i)
        ttft[mine] = rng.lognormal(math.log(ttft_median), 0.6, mine.size)
        tpot[mine] = rng.lognormal(math.log(tpot_median), 0.3, mine.size)
        if n == 0:
            continue
        expected = sum(math.prod(conditional[: k + 1]) for k in range(n))  # accepted tokens per step
        steps = np.ceil(out[mine] / (1 + expected)).astype(np.int32)
        drafted[mine, :n] = steps[:, None]
        previous = steps
        for k in range(n):
            previous = rng.binomial(previous, conditional[k]).astype(np.int32)
            accepted[mine, k] = previous
    e2e = ttft + tpot * (out - 1)
    failed = rng.random(rows) < 0.01
    ttft[failed] = np.nan
    tpot[failed] = np.nan
    return Records(cls, rng.integers(0, INSTANCES, rows).astype(np.int16), finish_us, ttft, tpot, e2e, out, drafted,
                   accepted)  # fmt: skip


COLUMNS = [
    "request_id", "instance_id", "model", "prompt_class", "arrival_time", "first_token_time", "finish_time",
    "prompt_tokens", "output_tokens", "ttft_s", "tpot_s", "e2e_s", "speculation_method", "speculation_enabled",
    "num_speculative_tokens", "settings_version", "num_spec_steps", "num_draft_tokens", "num_accepted_tokens",
    "drafted_per_position", "accepted_per_position", "batch_size_mean", "batch_size_max", "finish_reason",
]  # fmt: skip


def _times(micros: np.ndarray) -> list[str]:
    return [s + "+00" for s in np.datetime_as_string(micros.astype("datetime64[us]"), unit="us")]


def _rows(r: Records, lo: int, hi: int):
    """request_records rows [lo, hi) as COPY text fields."""
    sl = slice(lo, hi)
    ns = [CLASSES[NAMES[c]][0] for c in r.cls[sl]]
    ttft, tpot = r.ttft[sl], r.tpot[sl]
    arrival = r.finish_us[sl] - np.rint(r.e2e[sl] * 1e6).astype(np.int64)
    first = arrival + np.rint(np.nan_to_num(ttft) * 1e6).astype(np.int64)
    drafted, accepted = r.drafted[sl], r.accepted[sl]
    for i, (arr, ft, fin) in enumerate(zip(_times(arrival), _times(first), _times(r.finish_us[sl]), strict=True)):
        n, failed = ns[i], bool(np.isnan(ttft[i]))
        d, a = drafted[i, :n].tolist(), accepted[i, :n].tolist()
        yield (
            f"r{lo + i}", f"engine-{r.instance[lo + i]:03d}", "demo", NAMES[r.cls[lo + i]], arr,
            None if failed else ft, fin, 120, int(r.output_tokens[lo + i]), None if failed else float(ttft[i]),
            None if failed else float(tpot[i]), float(r.e2e[lo + i]), "draft_model", n > 0, n, 1,
            d[0] if d else 0, sum(d), sum(a), json.dumps(d), json.dumps(a), 4.0, 8,
            "error" if failed else "length",
        )  # fmt: skip


def load_records(db: Engine, r: Records, progress) -> None:
    total = r.cls.size
    for lo in range(0, total, CHUNK):
        hi = min(total, lo + CHUNK)
        if db.dialect.name == "postgresql":
            raw = db.raw_connection()
            try:
                with raw.cursor() as cur, cur.copy(f"COPY request_records ({', '.join(COLUMNS)}) FROM STDIN") as cp:
                    for row in _rows(r, lo, hi):
                        cp.write_row(row)
                raw.commit()
            finally:
                raw.close()
        else:  # the write path's own functions: the records and their sums in one transaction
            with db.begin() as conn:
                insert_new_records(conn, [_as_values(row) for row in _rows(r, lo, hi)])
        progress(hi)
    if db.dialect.name == "postgresql":
        with db.begin() as conn:  # COPY bypasses the write path: sum the loaded records in the database
            for statement in SUM_COPIED_RECORDS:
                conn.execute(text(statement))


# What ``store.sums.insert_new_records`` adds per record, for the records COPY loaded (every one new):
# minutes from the records, then each wider period from the one below it.
_START = "to_timestamp(floor(extract(epoch FROM {t}) / {w}) * {w})"
_TOTALS = ("requests", "drafting_requests", "errors", "output_tokens", "num_spec_steps", "num_draft_tokens",
           "num_accepted_tokens", "ttft_s_sum", "e2e_s_sum")  # fmt: skip
_KEY = "width_s, start, instance_id, prompt_class, num_speculative_tokens"
SUM_COPIED_RECORDS = (
    f"""INSERT INTO request_sums ({_KEY}, {", ".join(_TOTALS)})
       SELECT 60, {_START.format(t="finish_time", w=60)}, instance_id, prompt_class, num_speculative_tokens,
              count(*), count(*) FILTER (WHERE num_draft_tokens > 0), count(*) FILTER (WHERE finish_reason = 'error'),
              sum(output_tokens), sum(num_spec_steps), sum(num_draft_tokens), sum(num_accepted_tokens),
              coalesce(sum(ttft_s), 0), sum(e2e_s)
       FROM request_records GROUP BY 2, 3, 4, 5""",
    f"""INSERT INTO request_sum_positions ({_KEY}, position, drafted, accepted)
       SELECT 60, {_START.format(t="r.finish_time", w=60)}, r.instance_id, r.prompt_class, r.num_speculative_tokens,
              e.ord - 1, sum(e.d::bigint), sum(coalesce(e.a, '0')::bigint)
       FROM request_records r,
            ROWS FROM (jsonb_array_elements_text(r.drafted_per_position),
                       jsonb_array_elements_text(r.accepted_per_position)) WITH ORDINALITY AS e(d, a, ord)
       WHERE r.num_draft_tokens > 0 GROUP BY 2, 3, 4, 5, 6""",
    *(
        statement
        for narrow, wide in ((60, 3600), (3600, 86400))
        for statement in (
            f"""INSERT INTO request_sums ({_KEY}, {", ".join(_TOTALS)})
                SELECT {wide}, {_START.format(t="start", w=wide)}, instance_id, prompt_class, num_speculative_tokens,
                       {", ".join(f"sum({c})" for c in _TOTALS)}
                FROM request_sums WHERE width_s = {narrow} GROUP BY 2, 3, 4, 5""",
            f"""INSERT INTO request_sum_positions ({_KEY}, position, drafted, accepted)
                SELECT {wide}, {_START.format(t="start", w=wide)}, instance_id, prompt_class, num_speculative_tokens,
                       position, sum(drafted), sum(accepted)
                FROM request_sum_positions WHERE width_s = {narrow} GROUP BY 2, 3, 4, 5, 6""",
        )
    ),
)


def _as_values(row: tuple) -> dict:
    values = dict(zip(COLUMNS, row, strict=True))
    for key in ("arrival_time", "first_token_time", "finish_time"):
        if values[key] is not None:
            values[key] = datetime.fromisoformat(values[key].replace("+00", "+00:00"))
    for key in ("drafted_per_position", "accepted_per_position"):
        values[key] = json.loads(values[key])
    return values


def load_steps_and_decisions(db: Engine, rows: int, end: float, seed: int = 1) -> tuple[int, int]:
    """Step statistics (every minute, a share of the instances, buckets 1-8 at N 0 and 3) and a
    tuner decision per class and minute: (step rows, decision rows)."""
    rng = np.random.default_rng(seed)
    minutes = DAYS * 1440
    per_minute = max(1, min(INSTANCES, rows // 4 // minutes))
    first = (int(end) // 60 - minutes) * 60
    steps, decisions = [], []
    for m in range(minutes):
        at = datetime.fromtimestamp(first + 60 * m, UTC)
        for inst in rng.choice(INSTANCES, per_minute, replace=False):
            bucket, n = int(rng.choice([1, 2, 4, 8])), int(rng.choice([0, 3]))
            count, t = int(rng.integers(50, 500)), 0.02 * bucket**0.5 * (1 + 0.3 * n)
            steps.append(dict(instance_id=f"engine-{inst:03d}", minute=at, batch_bucket=bucket,
                              num_speculative_tokens=n, writer="w", steps=count, step_time_sum_s=t * count,
                              step_time_p50_s=t, step_time_p95_s=1.3 * t, batch_size_sum=bucket * count,
                              scheduled_tokens=bucket * (n + 1) * count, num_draft_tokens=bucket * n * count,
                              num_accepted_tokens=bucket * n * count // 2, accepted_per_position=[],
                              prefill_steps=count // 10, prefill_time_sum_s=2 * t * (count // 10),
                              prefill_generated_tokens=bucket * (count // 10)))  # fmt: skip
        for cls in NAMES:
            n = CLASSES[cls][0]
            decisions.append(dict(at=at, instance_id="*", prompt_class=cls, batch_bucket=4, mode="auto",
                                  action="keep", n_before=n, n_after=n, predicted_speedup=1.2,
                                  realised_speedup=None if m >= minutes - 10 else 1.15, applied=False,
                                  leader_epoch=1,
                                  inputs={"reason": "synthetic", "acceptance": 0.7}))  # fmt: skip
        if len(steps) >= 50_000 or m == minutes - 1:
            with db.begin() as conn:
                conn.execute(insert(StepStat), steps)
                conn.execute(insert(TunerDecision), decisions)
            steps, decisions = [], []
    return minutes * per_minute, minutes * len(NAMES)

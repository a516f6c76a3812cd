"""Aggregates computed in the database equal a brute-force reference on the same rows
(SQLite and PostgreSQL): sums exactly, percentiles exactly (nearest rank)."""

from __future__ import annotations

import math
import random
from datetime import UTC, datetime, timedelta

import pytest

from spectune.store.aggregates import (
    ARM_QUANTILES,
    LATENCY_METRICS,
    QUANTILES,
    acceptance_by_class,
    latency_by_arm,
    latency_by_class,
    timeseries_by_class,
)
from spectune.store.db import insert_records, make_engine, upgrade
from spectune.store.steps import add_positions, percentile

from records import make_records

NOW = datetime(2026, 6, 1, 12, tzinfo=UTC)


def _records(n: int, seed: int):
    """Ragged and empty per-position lists, missing latencies, ties, three instances, four classes."""
    rng = random.Random(seed)
    out = []
    for r in make_records(n, prefix=f"s{seed}", seed=seed):
        k = rng.choice([0, 0, 1, 3, 5])
        drafted = [rng.randint(1, 9) for _ in range(k)]
        accepted = [rng.randint(0, d) for d in drafted][: rng.choice([k, max(0, k - 1)])]  # shorter: zeros
        finish = (NOW - timedelta(seconds=rng.uniform(0, 7200))).timestamp()
        out.append(
            r.model_copy(
                update={
                    "instance_id": rng.choice(["a", "b", "c"]),
                    "prompt_class": rng.choice(["qa", "code", "chat", "long"]),
                    "finish_time": finish,
                    "drafted_per_position": drafted,
                    "accepted_per_position": accepted,
                    "num_draft_tokens": sum(drafted),
                    "num_accepted_tokens": sum(accepted),
                    "ttft_s": None if rng.random() < 0.1 else round(rng.lognormvariate(-3, 1), 2),  # ties
                    "tpot_s": None if rng.random() < 0.2 else rng.lognormvariate(-4, 0.5),
                    "e2e_s": rng.lognormvariate(0, 1),
                    "output_tokens": rng.randint(1, 64),
                }
            )
        )
    return out


def _reference_acceptance(records, since, until, instance, drafted_only):
    out = {}
    for r in records:
        at = datetime.fromtimestamp(r.finish_time, UTC)
        if at < since or (until and at >= until) or (instance and r.instance_id != instance):
            continue
        if drafted_only and r.num_draft_tokens == 0:
            continue
        g = out.setdefault(r.prompt_class, [0, 0, 0, [], []])
        g[0] += 1
        g[1] += r.num_draft_tokens
        g[2] += r.num_accepted_tokens
        add_positions(g[3], r.drafted_per_position)
        add_positions(g[4], r.accepted_per_position)
    for g in out.values():  # accepted counts exist for every drafted position
        g[4] += [0] * (len(g[3]) - len(g[4]))
    return out


@pytest.mark.parametrize("seed", [1, 2])
def test_aggregates_equal_a_brute_force_reference(db_url, seed):
    upgrade(db_url)
    db = make_engine(db_url)
    records = _records(600, seed)
    insert_records(db, records)
    windows = [
        (NOW - timedelta(hours=3), None),
        (NOW - timedelta(minutes=30), NOW - timedelta(minutes=5)),
        # partial minutes at both edges: raw records there, the per-minute sums between
        (NOW - timedelta(minutes=47, seconds=13.5), NOW - timedelta(minutes=5, seconds=2.25)),
        (NOW - timedelta(seconds=50), NOW - timedelta(seconds=10)),  # inside one minute
    ]
    for since, until in windows:
        for instance in (None, "b"):
            for drafted_only in (False, True):
                got = acceptance_by_class(db, since, until, instance, drafted_only)
                want = _reference_acceptance(records, since, until, instance, drafted_only)
                assert {
                    c: [g.requests, g.drafted, g.accepted, g.drafted_per_position, g.accepted_per_position]
                    for c, g in got.items()
                } == want
            for cls in (None, "qa"):
                got = latency_by_class(db, since, until, instance, cls)
                mine = [
                    r
                    for r in records
                    if since <= datetime.fromtimestamp(r.finish_time, UTC) < (until or NOW + timedelta(days=1))
                    and (instance is None or r.instance_id == instance)
                    and (cls is None or r.prompt_class == cls)
                ]
                assert set(got) == {r.prompt_class for r in mine}
                for c, entry in got.items():
                    of_class = [r for r in mine if r.prompt_class == c]
                    assert entry["requests"] == len(of_class)
                    assert entry["output_tokens"] == sum(r.output_tokens for r in of_class)
                    for metric in LATENCY_METRICS:
                        values = sorted(getattr(r, metric) for r in of_class if getattr(r, metric) is not None)
                        want = {name: percentile(values, q) if values else None for name, q in QUANTILES}
                        rel = entry["percentile_error"] or 1e-12  # ranges over 2 h: histograms, bound declared
                        assert entry[metric] == (pytest.approx(want, rel=rel * 1.0001) if values else want), (c, metric)


@pytest.mark.parametrize("seed", [1, 2])
def test_latency_by_arm_equals_a_brute_force_reference(db_url, seed):
    """Per class and arm (speculating: N > 0 at admission), optionally at one batch bucket (mean batch
    size in (lo, hi]): request counts and nearest-rank TTFT / TPOT percentiles, exactly."""
    upgrade(db_url)
    db = make_engine(db_url)
    rng = random.Random(seed)
    batches = [None, 1.0, 1.5, 4.0, 4.5, 8.0]  # bucket edges: (lo, hi] holds hi, not lo
    records = [
        r.model_copy(
            update={"num_speculative_tokens": rng.choice([0, 0, 1, 3]), "batch_size_mean": rng.choice(batches)}
        )
        for r in _records(500, seed)
    ]
    insert_records(db, records)
    since, until = NOW - timedelta(minutes=40), NOW - timedelta(minutes=3)
    for cls, batch in ((None, None), ("qa", (0, 1)), ("code", (4, 8)), (None, (1, 2))):
        got = latency_by_arm(db, since, until, cls, batch)
        want: dict = {}
        for r in records:
            at = datetime.fromtimestamp(r.finish_time, UTC)
            if not since <= at < until or (cls is not None and r.prompt_class != cls):
                continue
            if batch is not None and (r.batch_size_mean is None or not batch[0] < r.batch_size_mean <= batch[1]):
                continue
            want.setdefault(r.prompt_class, {}).setdefault(r.num_speculative_tokens > 0, []).append(r)
        assert {c: set(arms) for c, arms in got.items()} == {c: set(arms) for c, arms in want.items()}
        for c, arms in want.items():
            for arm, rows in arms.items():
                entry = got[c][arm]
                assert entry.requests == len(rows)
                for metric in ("ttft_s", "tpot_s"):
                    values = sorted(getattr(r, metric) for r in rows if getattr(r, metric) is not None)
                    expected = {name: percentile(values, q) if values else None for name, q in ARM_QUANTILES}
                    assert getattr(entry, metric) == expected, (c, arm, metric)


def test_nearest_rank_at_rank_boundaries(db_url):
    """n where q * n is a whole number and where it is not: the rank is ceil(q * n)."""
    upgrade(db_url)
    db = make_engine(db_url)
    for n in (1, 2, 19, 20, 21, 100):
        records = [
            r.model_copy(update={"prompt_class": f"n{n}", "e2e_s": float(i + 1), "finish_time": NOW.timestamp()})
            for i, r in enumerate(make_records(n, prefix=f"b{n}"))
        ]
        insert_records(db, records)
    got = latency_by_class(db, NOW - timedelta(minutes=1), NOW + timedelta(minutes=1))  # short: sorted, exact
    for n in (1, 2, 19, 20, 21, 100):
        assert got[f"n{n}"]["e2e_s"] == {name: float(max(1, math.ceil(q * n))) for name, q in QUANTILES}


@pytest.mark.parametrize(("bucket_s", "offset_s"), [(60.0, 0.0), (120.0, 17.5), (450.0, 0.0), (7.5, 0.0)])
def test_timeseries_buckets_every_record_once(db_url, bucket_s, offset_s):
    """Whole-minute widths read the per-minute sums (and the records at a partial first minute)."""
    upgrade(db_url)
    db = make_engine(db_url)
    records = _records(400, 3)
    insert_records(db, records)
    since = NOW - timedelta(hours=1, seconds=offset_s)
    want: dict[tuple[str, float], list[int]] = {}
    for r in records:
        if r.finish_time >= since.timestamp():
            p = want.setdefault((r.prompt_class, r.finish_time // bucket_s * bucket_s), [0, 0, 0, 0])
            for i, v in enumerate((1, r.num_draft_tokens, r.num_accepted_tokens, r.output_tokens)):
                p[i] += v
    got = timeseries_by_class(db, since, bucket_s)
    assert {(c, t): [n, d, a, k] for c, t, n, d, a, k in got} == want
    assert [t for _, t, *_ in got] == sorted(t for _, t, *_ in got)

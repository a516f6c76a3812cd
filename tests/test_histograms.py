"""Percentiles over long ranges from hourly histograms: within the documented relative error of the
exact nearest-rank value, never from a stale histogram, recomputed when late records land."""

from __future__ import annotations

import random
from collections import Counter
from datetime import timedelta

import pytest
from hypothesis import given
from hypothesis import strategies as st

from spectune.store.aggregates import LATENCY_METRICS, QUANTILES, latency_by_class
from spectune.store.db import insert_records, make_engine, upgrade
from spectune.store.histograms import RELATIVE_ERROR, bucket_of, nearest_rank, refresh, value_of
from spectune.store.steps import percentile

from records import NOW, make_records

SINCE = NOW - timedelta(hours=6, minutes=17, seconds=30)  # partial first hour and minute


@given(st.floats(1e-6, 1e5))
def test_a_value_is_reported_within_the_relative_error(v):
    assert abs(value_of(bucket_of(v)) - v) <= RELATIVE_ERROR * v * (1 + 1e-9)


@given(st.lists(st.floats(1e-4, 100.0), min_size=1, max_size=300), st.sampled_from([0.5, 0.95, 0.99]))
def test_a_histogram_percentile_is_within_the_error_of_the_exact_one(values, q):
    exact = percentile(sorted(values), q)
    assert nearest_rank(Counter(map(bucket_of, values)), q) == pytest.approx(exact, rel=RELATIVE_ERROR * 1.0001)


def _records(n: int, seed: int, prefix: str):
    rng = random.Random(seed)
    out = []
    for r in make_records(n, prefix=prefix, seed=seed):
        finish = NOW - timedelta(seconds=rng.uniform(0, 7 * 3600))
        out.append(r.model_copy(update={
            "finish_time": finish.timestamp(), "prompt_class": rng.choice(["qa", "code", "chat"]),
            "instance_id": rng.choice("abc"), "output_tokens": rng.randint(1, 64),
            "ttft_s": None if rng.random() < 0.1 else rng.lognormvariate(-3, 1),
            "tpot_s": None if rng.random() < 0.2 else rng.lognormvariate(-4, 0.5), "e2e_s": rng.lognormvariate(0, 1),
        }))  # fmt: skip
    return out


def _check(db, records, prompt_class=None):
    got = latency_by_class(db, SINCE, None, prompt_class=prompt_class)
    mine = [r for r in records if r.finish_time >= SINCE.timestamp() and prompt_class in (None, r.prompt_class)]
    assert set(got) == {r.prompt_class for r in mine}
    for cls, entry in got.items():
        of_class = [r for r in mine if r.prompt_class == cls]
        assert (entry["requests"], entry["output_tokens"]) == (len(of_class), sum(r.output_tokens for r in of_class))
        assert entry["percentile_error"] == RELATIVE_ERROR
        for metric in LATENCY_METRICS:
            values = sorted(v for r in of_class if (v := getattr(r, metric)) is not None)
            for name, q in QUANTILES:
                assert entry[metric][name] == pytest.approx(percentile(values, q), rel=RELATIVE_ERROR * 1.0001)


def test_long_ranges_read_fresh_histograms_and_raw_records_for_the_rest(db_url):
    upgrade(db_url)
    db = make_engine(db_url)
    records = _records(900, 1, "h")
    insert_records(db, records)
    _check(db, records)  # nothing computed yet: every hour from its records
    first, last = NOW - timedelta(hours=7), NOW + timedelta(hours=1)
    assert refresh(db, first, last) == 7  # every hour with records (05:00 to 11:00)
    assert refresh(db, first, last) == 0  # all current
    _check(db, records)
    _check(db, records, "qa")
    # late records land in a computed hour: that hour is not used until recomputed, and is recomputed
    late = [r.model_copy(update={"request_id": f"late-{i}", "e2e_s": 50.0 + i}) for i, r in enumerate(records[:40])]
    insert_records(db, late)
    _check(db, records + late)
    assert 0 < refresh(db, first, last) <= 7
    _check(db, records + late)
    # ranges up to 2 h and ranges of one instance are sorted exactly
    short = latency_by_class(db, NOW - timedelta(hours=2), NOW)
    assert {e["percentile_error"] for e in short.values()} == {0.0}
    assert {e["percentile_error"] for e in latency_by_class(db, SINCE, None, instance="a").values()} == {0.0}
    db.dispose()

"""What the benchmark times and checks: every read the dashboard, the API and the tuner make,
each aggregate against the brute-force reference, one tuner run, and retention under ingest."""

from __future__ import annotations

import math
import statistics
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta

import numpy as np
from sqlalchemy import Engine

from spectune.control import PolicyService
from spectune.store.aggregates import QUANTILES, acceptance_by_class, latency_by_class, timeseries_by_class
from spectune.store.policies import PolicyRepository
from spectune.store.retention import expire_records
from spectune.store.sums import insert_new_records
from spectune.tuner.job import Tuner
from spectune.tuner.policy import PolicyDocument

from .synth import NAMES, Records

RANGES = {"1 h": 3600.0, "24 h": 86_400.0, "7 d": 7 * 86_400.0}
EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


def at_us(micros: int) -> datetime:
    """Microseconds since the epoch as a datetime, exactly (a float of them is not)."""
    return EPOCH + timedelta(microseconds=int(micros))


def http_reads(window_s: float, since: datetime) -> list[tuple[str, str, dict]]:
    """(who reads it, path, query) for one range: the dashboard's pages (``dashboards/operator/views.py``)
    and the API's own reads."""
    iso = since.isoformat()
    return [
        ("dashboard overview", "/api/v1/classes", {}),
        ("dashboard overview", "/api/v1/instances", {}),
        ("dashboard overview", "/api/v1/stats/timeseries", {"window_s": window_s, "bucket_s": max(60, window_s // 60)}),
        ("dashboard overview", "/api/v1/stats/latency", {"window_s": window_s}),
        ("dashboard acceptance", "/api/v1/stats/acceptance", {"window_s": window_s, "group_by": "position"}),
        ("dashboard acceptance", "/api/v1/stats/acceptance", {"window_s": window_s, "group_by": "batch_bucket"}),
        ("dashboard tuner", "/api/v1/decisions", {"limit": 1000}),
        ("api", "/api/v1/stats/acceptance", {"window_s": window_s}),
        ("api", "/api/v1/stats/latency", {"window_s": window_s, "class": "code"}),
        ("api", "/api/v1/records", {"limit": 100, "since": iso}),
        ("api", "/api/v1/records", {"limit": 100, "class": "qa", "since": iso}),
    ]


def time_reads(client, repeat: int) -> list[dict]:
    """Each read ``repeat`` times per range: p50 / p95 (nearest rank) in ms."""
    out = []
    for name, window_s in RANGES.items():
        since = datetime.now(UTC) - timedelta(seconds=window_s)
        for who, path, params in http_reads(window_s, since):
            samples = []
            for _ in range(repeat):
                began = time.perf_counter()
                response = client.get(path, params=params)
                samples.append((time.perf_counter() - began) * 1000)
                if response.status_code != 200:
                    raise RuntimeError(f"{path} {params}: {response.status_code} {response.text[:200]}")
            samples.sort()
            shown = ", ".join(f"{k}={v}" for k, v in params.items() if k not in ("since", "window_s"))
            p95 = samples[max(0, math.ceil(0.95 * repeat) - 1)]
            read = f"{path.removeprefix('/api/v1')} {shown}".strip()
            out.append(dict(range=name, who=who, read=read, p50=statistics.median(samples), p95=p95))
    return out


def _nearest_rank(values: np.ndarray, q: float) -> float | None:
    if values.size == 0:
        return None
    k = max(1, math.ceil(q * values.size)) - 1
    return float(np.partition(values, k)[k])


def check_aggregates(db: Engine, r: Records, end_us: int) -> list[str]:
    """Every aggregate over each range against the generated rows; the mismatches (none: all equal)."""
    bad = []
    end = at_us(end_us + 1)
    for name, window_s in RANGES.items():
        since_us = end_us + 1 - int(window_s * 1e6)
        since = at_us(since_us)
        inside = r.finish_us >= since_us
        got = acceptance_by_class(db, since, end)
        lat = latency_by_class(db, since, end)
        for i, cls in enumerate(NAMES):
            mine = inside & (r.cls == i)
            if not mine.any():
                continue
            g = got.get(cls)
            drafted, accepted = r.drafted[mine].sum(axis=0), r.accepted[mine].sum(axis=0)
            k = int(np.max(np.nonzero(drafted)[0], initial=-1)) + 1
            want = [int(mine.sum()), int(drafted.sum()), int(accepted.sum()), drafted[:k].tolist()]
            want.append(accepted[:k].tolist())
            have = g and [g.requests, g.drafted, g.accepted, g.drafted_per_position, g.accepted_per_position]
            if have != want:
                bad.append(f"{name} acceptance {cls}: {have} != {want}")
            for metric, values in (("ttft_s", r.ttft), ("tpot_s", r.tpot), ("e2e_s", r.e2e)):
                v = values[mine]
                v = v[~np.isnan(v)]
                expected = {q_name: _nearest_rank(v, q) for q_name, q in QUANTILES}
                entry = lat.get(cls, {})
                have = entry.get(metric) or {}
                error = entry.get("percentile_error", 0.0)  # 0: sorted; else the histograms' declared bound
                off = [k for k, want in expected.items() if (have.get(k) is None) != (want is None)
                       or (want is not None and abs(have[k] - want) > error * want + 1e-12)]  # fmt: skip
                if off or set(have) != set(expected):
                    bad.append(f"{name} latency {cls} {metric}: {have} != {expected} (error bound {error:.4f})")
        bucket_s = max(60, window_s // 60)
        series = {(c, t): (n, d, a, tok) for c, t, n, d, a, tok in timeseries_by_class(db, since, bucket_s)}
        width = round(bucket_s * 1e6)
        index = r.finish_us[inside] // width
        drafted_total = r.drafted[inside].sum(axis=1)
        for i, cls in enumerate(NAMES):
            of_class = r.cls[inside] == i
            buckets, where, counts = np.unique(index[of_class], return_inverse=True, return_counts=True)
            drafted = np.bincount(where, weights=drafted_total[of_class], minlength=buckets.size)
            have = {t: v[:2] for (c, t), v in series.items() if c == cls}
            want = {int(b) * width / 1e6: (int(n), int(d)) for b, n, d in zip(buckets, counts, drafted, strict=True)}
            if have != want:
                bad.append(f"{name} timeseries {cls}: {len(have)} buckets vs {len(want)}, differing")
    return bad


def tuner_run(db: Engine, r: Records, end_us: int, records_in_window: int) -> dict:
    """One tuner run whose acceptance window holds ``records_in_window`` records: seconds, and whether
    the acceptance it decided on equals the reference."""
    PolicyRepository(db).ensure(PolicyDocument().body(), "store-scale benchmark")
    newest = np.sort(r.finish_us)[-records_in_window:]
    window = timedelta(microseconds=int(end_us - newest[0]) + 1)
    now = at_us(end_us + 1)
    tuner = Tuner(PolicyService(db, set(NAMES), clock=lambda: now), window=window, interval=timedelta(minutes=1))
    began = time.perf_counter()
    decisions = tuner.run_once()
    seconds = time.perf_counter() - began
    exact = True
    for d in decisions:
        # the window it decided on: the interval's alone where it saw acceptance shift within the window
        span = tuner.interval if d["inputs"].get("recent_window_used") else window
        inside = r.finish_us >= end_us + 1 - int(span.total_seconds() * 1e6)
        mine = inside & (r.cls == NAMES.index(d["prompt_class"])) & (r.drafted[:, 0] > 0)
        k = int(np.max(np.nonzero(r.drafted[mine].sum(axis=0))[0], initial=-1)) + 1
        exact &= d["inputs"]["drafted_per_position"] == r.drafted[mine].sum(axis=0)[:k].tolist()
    records = int((r.finish_us >= end_us + 1 - int(window.total_seconds() * 1e6)).sum())
    return {"seconds": seconds, "records": records, "decisions": len(decisions), "exact": exact}


def retention_under_ingest(db: Engine, end_us: int, make_batch: Callable[[int], list], rate: float) -> dict:
    """Delete one day of records (the oldest) while another thread ingests at ``rate`` records/s in
    batches of 1,000 request_records rows (``make_batch``, built before the clock starts, as a
    recorder's spool holds them): the ingest rate reached and its longest stall."""
    stop, commits, deleted = threading.Event(), [], []

    def ingest() -> None:
        k, began = 0, time.perf_counter()
        while not stop.is_set():
            with db.begin() as conn:  # the recorder's write: records and their sums
                insert_new_records(conn, make_batch(k))
            commits.append(time.perf_counter())
            k += 1
            ahead = began + k * 1000 / rate - time.perf_counter()
            if ahead > 0:
                stop.wait(ahead)

    thread = threading.Thread(target=ingest, name="ingest")
    now = at_us(end_us)
    started = time.perf_counter()
    thread.start()
    try:
        deleted.append(expire_records(db, timedelta(days=6), now=now))
    finally:
        retention_s = time.perf_counter() - started
        stop.set()
        thread.join()
    gaps = [b - a for a, b in zip([started, *commits], commits, strict=False)]
    return {
        "deleted": deleted[0] if deleted else 0,
        "retention_s": retention_s,
        "ingest_rate": 1000 * len(commits) / (commits[-1] - started) if commits else 0.0,
        "longest_stall_s": max(gaps, default=float("inf")),
    }

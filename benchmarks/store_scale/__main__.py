"""The store at fleet scale: load N synthetic records, then time every read and check every aggregate.

    python -m benchmarks.store_scale --rows N [--db URL] [--repeat 5] [--out FILE]

Without ``--db`` a throwaway PostgreSQL 15 is started (as the tests start it).  Loads N
request records (7 days, 200 instances, 6 classes; per-position acceptance and latency
drawn per class), with COPY on PostgreSQL, plus step statistics and tuner decisions; then
times every read the dashboard and the API make over 1 h, 24 h and 7 d (in-process HTTP
through the real app), checks each aggregate against a brute-force reference computed on
the generated rows, times one tuner run with 1,000,000 records (or all) in its window and one
retention run (the oldest day) while ingest continues at 10,000 records/s.  Prints a table
and ends with ``max p95 = <ms> ms``.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

import numpy as np
from fastapi.testclient import TestClient
from rich.console import Console

from spectune.api.auth import Role, TokenSpec
from spectune.app import create_app
from spectune.engine.classifier import PromptClassifier
from spectune.store.db import make_engine, record_row, upgrade
from spectune.store.histograms import refresh_closed_hours

from .reads import check_aggregates, retention_under_ingest, time_reads, tuner_run
from .synth import DAYS, NAMES, generate, load_records, load_steps_and_decisions

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))

from pgserver import PgServer
from records import make_records

TOKEN = "store-scale"


def main(rows: int, db_url: str | None, repeat: int, out: Path | None) -> None:
    console = Console()
    with contextlib.ExitStack() as stack:
        if db_url is None:
            server = PgServer().init()
            stack.callback(server.destroy)
            db_url = server.url
        upgrade(db_url)
        db = make_engine(db_url)
        stack.callback(db.dispose)
        end = time.time()
        began = time.perf_counter()
        records = generate(rows, end)
        console.log(f"generated {rows:,} records in {time.perf_counter() - began:.0f} s")
        began = time.perf_counter()
        load_records(db, records, lambda n: console.log(f"loaded {n:,}") if n % 1_000_000 == 0 else None)
        load_s = time.perf_counter() - began
        steps, decisions = load_steps_and_decisions(db, rows, end)
        with db.begin() as conn:
            conn.exec_driver_sql("ANALYZE")
        console.log(f"loaded in {load_s:.0f} s ({rows / load_s:,.0f} records/s); {steps:,} step rows, "
                    f"{decisions:,} decisions")  # fmt: skip
        began = time.perf_counter()  # what the scheduled job does: every closed hour's histograms
        hours = refresh_closed_hours(db, timedelta(days=DAYS + 1), datetime.fromtimestamp(end, UTC))
        histograms_s = time.perf_counter() - began
        console.log(f"latency histograms of {hours} closed hours in {histograms_s:.0f} s")
        end_us = int(records.finish_us.max())
        classes = PromptClassifier(default_class="long", extra_classes=[c for c in NAMES if c != "long"])
        app = create_app(None, db, {"bench": TokenSpec(token=TOKEN, role=Role.VIEWER)}, classifier=classes)
        with TestClient(app, headers={"Authorization": f"Bearer {TOKEN}"}) as client:
            timings = time_reads(client, repeat)
        mismatches = check_aggregates(db, records, end_us)
        tuner = tuner_run(db, records, end_us, min(rows, 1_000_000))
        pool = [[record_row(r.model_dump()) for r in make_records(1000, prefix="ingest", seed=k)] for k in range(8)]
        retention = retention_under_ingest(  # each batch: a pooled one under new request ids
            db,
            end_us,
            lambda k: [{**row, "request_id": f"ingest{k}-{i}"} for i, row in enumerate(pool[k % 8])],
            rate=10_000,
        )
    lines = [
        f"{rows:,} records ({db.dialect.name}), loaded at {rows / load_s:,.0f} records/s; reads repeated {repeat}x "
        "(in-process HTTP through the app).",
        "",
        "| range | who | read | p50 (ms) | p95 (ms) |",
        "|---|---|---|---|---|",
        *[f"| {t['range']} | {t['who']} | `{t['read']}` | {t['p50']:.0f} | {t['p95']:.0f} |" for t in timings],
        "",
        f"Aggregates vs brute force: {'all equal' if not mismatches else f'{len(mismatches)} differ'}.",
        *[f"- {m}" for m in mismatches[:20]],
        f"Tuner run: {tuner['seconds']:.2f} s with {tuner['records']:,} records in its window, "
        f"{tuner['decisions']} decisions, acceptance input {'exact' if tuner['exact'] else 'NOT exact'}.",
        f"Latency histograms: {hours} closed hours computed from their records in {histograms_s:.0f} s (once; "
        "then each hour as it closes).",
        f"Retention: {retention['deleted']:,} records (one day) deleted in {retention['retention_s']:.1f} s while "
        f"ingest ran at {retention['ingest_rate']:,.0f} records/s, longest stall {retention['longest_stall_s']:.2f} s.",
        "",
        f"max p95 = {max(t['p95'] for t in timings):.0f} ms",
    ]
    print("\n".join(lines))
    if out is not None:
        out.write_text("\n".join(lines) + "\n")
    if mismatches or not tuner["exact"]:
        raise SystemExit(1)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, required=True)
    parser.add_argument("--db", help="database URL (default: a throwaway PostgreSQL 15)")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    np.seterr(all="ignore")
    main(args.rows, args.db, args.repeat, args.out)
